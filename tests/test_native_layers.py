"""Native decoder layers (issue 37): ``hebrus::decode_gdn_layer``, ``decode_moe_tail``, ``decode_attention_head``,
``decode_attention_tail``, ``decode_attention_layer`` and ``decode_ple_gate`` on the CPU.

- each op equals the ops it is made of (``hebrus_torch.reference.decode``) bit for bit, outputs and the pools it
  updates in place, on random inputs of packed rows of several sequences, fp32 and bf16; opcheck passes; bad
  weight lists are refused with a HebrusError;
- ``NativeLayers`` resolves a stock model's layers (the whole GDN layers, every layer's tail) and sees every kind
  of change the packed forward's checks read (a hook, an instance forward, a module or weight replaced, a cast),
  re-resolving so that a hooked module takes its module path from the next step;
- the engine gives the same tokens and bitwise the same state with the native layers as without, prefill, decode
  and speculation (a fault inside a native GDN layer rolls its step back bitwise: tests/test_engine.py's fault
  suite).

The bitwise comparisons hold with the ops' dense products pinned to ATen's ``mm`` (``hebrus_torch.row_kernel``:
the row kernel's fixed order is not the model's ``nn.Linear`` bits): every test here runs with the row kernel off
unless it says otherwise; ``test_with_the_row_kernel_*`` run the default.
"""

from __future__ import annotations

import copy

import pytest
import torch

from test_engine import EOS, make_model, prompts_for  # noqa: E402  (skips without transformers)

from hebrus_torch import reference
from hebrus_torch.engine import Engine, EngineConfig
from hebrus_torch.errors import HebrusError
from hebrus_torch.models.qwen4_exp.native import (ModuleWatch, NativeLayers, decode_attention_layer, decode_gdn_layer,
                                                  decode_moe_tail)
from hebrus_torch.row_kernel import dense_row_kernel


@pytest.fixture(autouse=True)
def atens_dense_products(request):
    """The ops' dense products of a few rows are ATen's mm (the modules' bits), except in the row kernel's tests."""
    with dense_row_kernel(request.node.name.startswith("test_with_the_row_kernel")):
        yield


def native_calls(model: torch.nn.Module, dtype: torch.dtype = torch.float32):
    text = model.model
    layers = NativeLayers(text.layers, text.config.num_hidden_layers)
    hc = text.layers[0].mlp_hyper_connection
    with torch.no_grad():
        return layers, layers.calls(torch.empty(0, hc.hc_count * hc.hidden_size, dtype=dtype))


def gdn_inputs(model: torch.nn.Module, call, dtype: torch.dtype, seed: int):
    """Random streams of two sequences (1 and 3 tokens) at slots 2 and 0 of random pools."""
    g = torch.Generator().manual_seed(seed)
    gdn = model.model.layers[0].linear_attn
    hc = model.model.layers[0].mlp_hyper_connection
    conv_dim = call.gdn[0].shape[0]
    k = gdn.conv1d.weight.shape[-1]
    h = torch.randn(4, hc.hc_count * hc.hidden_size, generator=g).to(dtype)
    conv_pool = torch.randn(3, k - 1, conv_dim, generator=g).to(dtype)
    recurrent_pool = torch.randn(3, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, generator=g)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    cu_seqlens = torch.tensor([0, 1, 4], dtype=torch.int32)
    return h, conv_pool, recurrent_pool, slots, cu_seqlens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_gdn_layer_is_its_ops_bit_for_bit(dtype):
    model = make_model("lin-idx", seed=3).to(dtype)
    _, calls = native_calls(model, dtype)
    call = calls[0].layer
    assert call is not None
    for seed in range(3):
        h, conv_pool, recurrent_pool, slots, cu = gdn_inputs(model, call, dtype, seed)
        pools = (conv_pool.clone(), recurrent_pool.clone())
        with torch.no_grad():
            got = call(h, conv_pool, recurrent_pool, slots, cu)
            t = call.tail
            want = reference.decode_gdn_layer(h, call.attn_hc, call.gdn, pools[0], pools[1], slots, cu, t.mlp_hc,
                                              t.moe, call.heads, call.eps, call.conv_activation,
                                              call.norm_activation, t.hc_count, t.top_k, t.norm_topk_prob)
        assert got.dtype == dtype and got.shape == h.shape
        assert torch.equal(got, want)
        assert torch.equal(conv_pool, pools[0]) and torch.equal(recurrent_pool, pools[1])
        assert not torch.equal(conv_pool, gdn_inputs(model, call, dtype, seed)[1])     # the op did write them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_moe_tail_is_its_ops_bit_for_bit(dtype):
    model = make_model("lin-idx", seed=4).to(dtype)
    _, calls = native_calls(model, dtype)
    for layer in (0, 1):
        tail = calls[layer].tail
        hc = model.model.layers[layer].mlp_hyper_connection
        g = torch.Generator().manual_seed(layer)
        hyper = torch.randn(5, hc.hc_count * hc.hidden_size, generator=g).to(dtype)
        out = torch.randn(5, hc.hidden_size, generator=g).to(dtype)
        inject = torch.rand(5, hc.hc_count, generator=g).to(dtype)
        with torch.no_grad():
            got = tail(hyper, out, inject)
            want = reference.decode_moe_tail(hyper, out, inject, tail.mlp_hc, tail.moe, tail.hc_count, tail.hc_eps,
                                             tail.top_k, tail.norm_topk_prob)
        assert torch.equal(got, want)


def attention_inputs(model: torch.nn.Module, layer: int, dtype: torch.dtype, seed: int, rope_dims: int = 16):
    g = torch.Generator().manual_seed(seed)
    hc = model.model.layers[layer].attn_hyper_connection
    h = torch.randn(3, hc.hc_count * hc.hidden_size, generator=g).to(dtype)
    angles = torch.rand(3, rope_dims // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    return h, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_head_and_tail_are_their_ops_bit_for_bit(dtype):
    model = make_model("lin-idx", seed=8).to(dtype)
    _, calls = native_calls(model, dtype)
    call = calls[1].attention
    assert call is not None and calls[0].attention is None
    for seed in range(3):
        h, cos, sin = attention_inputs(model, 1, dtype, seed, rope_dims=min(call.rope_dims, 16))
        with torch.no_grad():
            got = call.head(h, cos, sin)
            want = reference.decode_attention_head(h, call.attn_hc, call.attention, cos, sin, call.dims, call.eps,
                                                   call.tail.hc_count)
            assert len(got) == 7
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            inject, q, gate = got[0], got[3], got[6]
            attn_out = torch.randn(q.shape).to(dtype)
            t = call.tail
            assert torch.equal(call.finish(h, attn_out, gate, inject),
                               reference.decode_attention_tail(h, attn_out, gate, call.o_proj, inject, t.mlp_hc,
                                                               t.moe, t.hc_count, t.hc_eps, t.top_k,
                                                               t.norm_topk_prob))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_ple_gate_is_its_ops_bit_for_bit(dtype):
    model = make_model("lin-idx", seed=11).to(dtype)
    _, calls = native_calls(model, dtype)
    ple_layers = [i for i, c in enumerate(calls) if c.ple is not None]
    assert ple_layers == [i for i, layer in enumerate(model.model.layers) if layer.ple is not None] != []
    for i in ple_layers:
        gate, ple = calls[i].ple, model.model.layers[i].ple
        g = torch.Generator().manual_seed(i)
        table = ple.ple_embedding.ngram_embedding
        rows = table(torch.randint(0, table.weight.shape[0], (5, gate.ple[0].shape[1] // table.weight.shape[1]),
                                   generator=g))
        h = torch.randn(5, gate.hc_count * gate.hidden, generator=g).to(dtype)
        with torch.no_grad():
            got = gate(rows, h)
            want = reference.decode_ple_gate(rows, h, gate.ple, gate.groups, gate.eps, gate.hc_count, gate.hidden)
        assert all(torch.equal(a, b) and a.dtype == dtype for a, b in zip(got, want))


@pytest.mark.parametrize("hidden", [3, 6, 10, 16])
@pytest.mark.parametrize("rows_count", [1, 3, 5])
def test_decode_ple_gates_float_loops_give_the_aten_ops_bits(hidden, rows_count):
    # (float32 runs the gate's elementwise tail as loops: a hidden size whose square root is inexact, rows whose
    # streams fill ATen's vectors or not, dot products of zero, -0.0 and NaN: the ATen ops' bits each time)
    hc, n, dim = 4, 2, 8
    g = torch.Generator().manual_seed(hidden * 10 + rows_count)
    weights = [torch.randn(hc * hidden, n * dim, generator=g), torch.randn(hc * hidden, generator=g) * 0.1,
               torch.randn(hidden, n * dim, generator=g), torch.randn(hc * hidden, generator=g) * 0.1,
               torch.randn(hc * hidden, generator=g) * 0.1]
    groups, eps = [hidden, hidden, hc * hidden], [1e-6, 1e-6, 1e-6]
    rows = torch.randn(rows_count, n, dim, generator=g)
    h = torch.randn(rows_count, hc * hidden, generator=g)
    cases = [(rows, h)]
    zero_key = [w.clone() for w in weights]
    zero_key[0][:hidden] = 0.0                                            # stream 0's dot products are +0.0
    cases.append((rows, h, zero_key))
    neg_zero = h.clone()
    neg_zero[:, :hidden] = -0.0                                            # stream 0's query: -0.0 products
    cases.append((rows.abs(), neg_zero, [weights[0].abs(), *weights[1:]]))
    nan_h = h.clone()
    nan_h[0, 1] = float("nan")
    cases.append((rows, nan_h))
    for case in cases:
        r, x, w = (*case, weights) if len(case) == 2 else case
        with torch.no_grad():
            got = torch.ops.hebrus.decode_ple_gate.default(r, x, w, groups, eps, hc, hidden)
            want = reference.decode_ple_gate(r, x, w, groups, eps, hc, hidden)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
            assert torch.equal(torch.nan_to_num(a).view(torch.int32), torch.nan_to_num(b).view(torch.int32))


@pytest.mark.parametrize("ties", ["none", "many", "nan"])
def test_moe_routes_selection_and_renormalised_weights_are_the_modules_bits(ties):
    # (the CPU kernel selects the top k by hand where the answer is unique and divides by their sum in a loop: equal
    # probabilities at or inside the top k, or a NaN, take torch.topk; every case gives the module's ids and bits)
    from hebrus_torch.reference import moe_route as reference_route

    g = torch.Generator().manual_seed(3)
    for rows, experts, k in [(1, 8, 2), (3, 512, 10), (17, 64, 8), (5, 7, 3), (2, 4, 4)]:
        logits = torch.randn(rows, experts, generator=g) * 3
        if ties == "many":
            logits = torch.randint(0, 3, (rows, experts), generator=g).float()
        elif ties == "nan":
            logits[0, experts // 2] = float("nan")
        shared = torch.randn(rows, 1, generator=g)
        for sh in (None, shared):
            (ids, weights), (want_ids, want_weights) = (torch.ops.hebrus.moe_route.default(logits, sh, k, True),
                                                        reference_route(logits, sh, k, True))
            # (the shared gate's sigmoid is hebrus's own row arithmetic: the routed weights are the ones compared)
            assert torch.equal(ids, want_ids)
            assert torch.equal(weights[:, :k].nan_to_num(), want_weights[:, :k].nan_to_num())


def captured_attention_layers(model, prompts, monkeypatch, **config) -> list[tuple]:
    """Every ``decode_attention_layer`` call of an engine serving ``prompts``: (the layer's call, then its arguments,
    each tensor cloned as the call found it), the engine's tokens and state as they come."""
    from hebrus_torch.models.qwen4_exp.native import AttentionLayerCall

    seen, whole, bound = [], AttentionLayerCall.whole, AttentionLayerCall.bound

    def record(call, h, cos, sin, planes, qsa, plan, sizes, qsa_eps):
        seen.append((call, h.clone(), cos.clone(), sin.clone(), [p.clone() for p in planes],
                     [q.clone() for q in qsa], [p.clone() for p in plan], list(sizes), qsa_eps))

    def capture(self, h, cos, sin, planes, qsa, plan, sizes, qsa_eps):
        record(self, h, cos, sin, planes, qsa, plan, sizes, qsa_eps)
        return whole(self, h, cos, sin, planes, qsa, plan, sizes, qsa_eps)

    def capture_bound(self, cos, sin, planes, qsa, plan, sizes, qsa_eps, then=None):
        # (the call bound before the step's first layer: recorded when it runs)
        made = bound(self, cos, sin, planes, qsa, plan, sizes, qsa_eps, then)
        op = made.op

        def recording(h, *args):
            record(self, h, cos, sin, planes, qsa, plan, sizes, qsa_eps)
            return op(h, *args)
        made.op = recording
        return made

    monkeypatch.setattr(AttentionLayerCall, "whole", capture)
    monkeypatch.setattr(AttentionLayerCall, "bound", capture_bound)
    run(model, prompts, True, **config)
    return seen


def attention_layer_args(call, h, cos, sin, planes, qsa, plan, sizes, qsa_eps) -> tuple:
    t = call.tail
    return (h, call.attn_hc, call.attention, cos, sin, call.dims, call.eps, t.hc_count, planes, qsa, plan, sizes,
            qsa_eps, call.scaling, call.o_proj, t.mlp_hc, t.moe, t.hc_eps, t.top_k, t.norm_topk_prob)


def test_decode_attention_layer_is_its_ops_bit_for_bit(monkeypatch):
    """On the calls of an engine serving random prompts (packed rows of several sequences, prefill chunks and
    decode, steps that complete groups and steps that do not): the output and the four planes it writes equal the
    reference's bit for bit."""
    model = make_model("idx-lin-idx-lin", seed=14)
    seen = captured_attention_layers(model, prompts_for(3, lengths=(10, 4, 15, 1)), monkeypatch,
                                     max_batch_tokens=7, block_size=4)
    assert any(c[6][3].numel() for c in seen) and any(not c[6][3].numel() for c in seen)     # groups pooled or not
    assert any(c[6][4].shape[0] > 1 for c in seen) and any(c[1].shape[0] > 1 for c in seen)  # several rows / tokens
    for i, (call, h, cos, sin, planes, qsa, plan, sizes, qsa_eps) in enumerate(seen):
        mine, ref = [p.clone() for p in planes], [p.clone() for p in planes]
        with torch.no_grad():
            got = torch.ops.hebrus.decode_attention_layer.default(
                *attention_layer_args(call, h, cos, sin, mine, qsa, plan, sizes, qsa_eps))
            want = reference.decode_attention_layer(*attention_layer_args(call, h, cos, sin, ref, qsa, plan, sizes,
                                                                          qsa_eps))
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(mine, ref))
        assert not all(torch.equal(a, b) for a, b in zip(mine, planes))       # it wrote the chunk's cells
        if i < 4:
            # Planes whose rows have a stride past their length are written by index_copy_ itself: the same bits.
            strided = [torch.cat([p, p], dim=-1)[..., :p.shape[-1]] for p in planes]
            assert not any(p.is_contiguous() for p in strided)
            with torch.no_grad():
                again = torch.ops.hebrus.decode_attention_layer.default(
                    *attention_layer_args(call, h, cos, sin, strided, qsa, plan, sizes, qsa_eps))
            assert torch.equal(again, want) and all(torch.equal(a, b) for a, b in zip(strided, ref))


def test_decode_attention_layer_opcheck_and_bad_lists(monkeypatch):
    model = make_model("lin-idx", seed=15)
    seen = captured_attention_layers(model, [[5, 6, 7, 8, 9, 10]], monkeypatch, max_batch_tokens=64)
    call, h, cos, sin, planes, qsa, plan, sizes, qsa_eps = seen[-1]
    with torch.no_grad():
        torch.library.opcheck(torch.ops.hebrus.decode_attention_layer.default,
                              attention_layer_args(call, h, cos, sin, planes, qsa, plan, sizes, qsa_eps))
        before = [p.clone() for p in planes]
        for bad, match in (((planes, qsa, plan[:9], sizes), "plan must hold 10 tensors, got 9"),
                           ((planes[:3], qsa, plan, sizes), "planes must hold 4 tensors, got 3"),
                           ((planes, qsa, plan, sizes[:1]), "sizes must be")):
            with pytest.raises(HebrusError, match=match):
                decode_attention_layer(*attention_layer_args(call, h, cos, sin, *bad, qsa_eps))
        assert all(torch.equal(a, b) for a, b in zip(planes, before))        # refused before any write


def test_opcheck():
    model = make_model("lin-idx", seed=5)
    _, calls = native_calls(model)
    call = calls[0].layer
    h, conv_pool, recurrent_pool, slots, cu = gdn_inputs(model, call, torch.float32, 0)
    t = call.tail
    with torch.no_grad():
        torch.library.opcheck(torch.ops.hebrus.decode_gdn_layer.default,
                              (h, call.attn_hc, call.gdn, conv_pool, recurrent_pool, slots, cu, t.mlp_hc, t.moe,
                               call.heads, call.eps, call.conv_activation, call.norm_activation, t.hc_count, t.top_k,
                               t.norm_topk_prob))
        hc = model.model.layers[1].mlp_hyper_connection
        tail = calls[1].tail
        torch.library.opcheck(torch.ops.hebrus.decode_moe_tail.default,
                              (h, torch.randn(4, hc.hidden_size), torch.rand(4, hc.hc_count), tail.mlp_hc, tail.moe,
                               tail.hc_count, tail.hc_eps, tail.top_k, tail.norm_topk_prob))
        att = calls[1].attention
        ha, cos, sin = attention_inputs(model, 1, torch.float32, 0)
        torch.library.opcheck(torch.ops.hebrus.decode_attention_head.default,
                              (ha, att.attn_hc, att.attention, cos, sin, att.dims, att.eps, tail.hc_count))
        ple_layer = next(i for i, c in enumerate(calls) if c.ple is not None)
        pg = calls[ple_layer].ple
        emb = model.model.layers[ple_layer].ple.ple_embedding.ngram_embedding
        rows = emb(torch.randint(0, emb.weight.shape[0], (3, pg.ple[0].shape[1] // emb.weight.shape[1])))
        torch.library.opcheck(torch.ops.hebrus.decode_ple_gate.default,
                              (rows, torch.randn(3, pg.hc_count * pg.hidden), pg.ple, pg.groups, pg.eps, pg.hc_count,
                               pg.hidden))
        _, _, _, q, _, _, gate = att.head(ha, cos, sin)
        torch.library.opcheck(torch.ops.hebrus.decode_attention_tail.default,
                              (ha, torch.randn(q.shape), gate, att.o_proj, torch.rand(3, hc.hc_count), tail.mlp_hc,
                               tail.moe, tail.hc_count, tail.hc_eps, tail.top_k, tail.norm_topk_prob))


def test_bad_weight_lists_are_refused():
    model = make_model("lin-idx", seed=6)
    _, calls = native_calls(model)
    tail = calls[1].tail
    hc = model.model.layers[1].mlp_hyper_connection
    hyper, out, inject = torch.randn(2, hc.hc_count * hc.hidden_size), torch.randn(2, hc.hidden_size), \
        torch.rand(2, hc.hc_count)
    with torch.no_grad():
        with pytest.raises(HebrusError, match="moe must hold 7 tensors, got 6"):
            decode_moe_tail(hyper, out, inject, tail.mlp_hc, tail.moe[:6], tail.hc_count, tail.hc_eps, tail.top_k,
                            tail.norm_topk_prob)
        call = calls[0].layer
        h, conv_pool, recurrent_pool, slots, cu = gdn_inputs(model, call, torch.float32, 0)
        before = (conv_pool.clone(), recurrent_pool.clone())
        with pytest.raises(HebrusError, match="heads must be"):
            decode_gdn_layer(h, call.attn_hc, call.gdn, conv_pool, recurrent_pool, slots, cu, tail.mlp_hc, tail.moe,
                             call.heads[:3], call.eps, call.conv_activation, call.norm_activation, tail.hc_count,
                             tail.top_k, tail.norm_topk_prob)
        assert torch.equal(conv_pool, before[0]) and torch.equal(recurrent_pool, before[1])


def test_a_stock_model_resolves_and_every_change_is_seen():
    model = make_model("idx-lin-idx-lin", seed=1)
    layers, calls = native_calls(model)
    assert [c.layer is not None for c in calls] == [False, True, False, True]
    assert [c.attention is not None for c in calls] == [True, False, True, False]
    assert all(c.tail is not None for c in calls)
    h = torch.empty(0, calls[0].tail.hc_count * model.config.hidden_size)
    text = model.model

    def resolved():
        with torch.no_grad():
            return layers.calls(h)

    n = layers.resolutions
    resolved()
    assert layers.resolutions == n                      # nothing changed: nothing resolved
    mlp = text.layers[1].mlp
    handle = mlp.register_forward_hook(lambda *a: None)
    n = layers.resolutions
    got = resolved()
    assert layers.resolutions == n + 1 and got[1].tail is None and got[1].layer is None and got[3].tail is not None
    handle.remove()
    assert resolved()[1].layer is not None
    pre = text.layers[2].mlp_hyper_connection.register_forward_pre_hook(lambda *a: None)
    assert resolved()[2].tail is None
    pre.remove()
    k_norm = text.layers[0].self_attn.k_norm.register_forward_hook(lambda *a: None)
    got = resolved()
    assert got[0].attention is None and got[0].tail is not None and got[2].attention is not None
    k_norm.remove()
    assert resolved()[0].attention is not None
    shared = mlp.shared_expert
    old_up = shared.up_proj
    shared.up_proj = copy.deepcopy(old_up)
    got = resolved()
    assert got[1].tail.moe[5] is shared.up_proj.weight
    shared.up_proj = old_up
    out_proj = text.layers[3].linear_attn.out_proj
    weight = out_proj.weight
    out_proj.weight = torch.nn.Parameter(weight.detach().clone())
    assert resolved()[3].layer.gdn[8] is out_proj.weight
    out_proj.weight = weight
    assert resolved()[3].layer.gdn[8] is weight
    gate = text.layers[0].mlp.gate
    gate.forward = gate.forward                         # an instance forward of its own: the module path
    assert resolved()[0].tail is None
    del gate.forward
    assert resolved()[0].tail is not None
    old_layer = text.layers[1]
    text.layers[1] = copy.deepcopy(old_layer)
    assert resolved()[1].tail.moe[0] is text.layers[1].mlp.gate.weight
    text.layers[1] = old_layer
    text.layers[0].mlp.to(torch.float64)                # a cast: that layer's weights no longer fit the streams
    assert resolved()[0].tail is None
    text.layers[0].mlp.to(torch.float32)
    assert resolved()[0].tail is not None


@pytest.mark.parametrize("check", ["unchanged", "unchanged_in_python"])
def test_module_watch_sees_each_kind_of_change(check):
    """The compiled snapshot's comparisons (the default) and the Python ones (a build without the extension) alike."""
    if check == "unchanged":
        assert ModuleWatch([torch.nn.ReLU()])._snapshot is not None     # (the extension is built in the suites)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    watch = ModuleWatch(list(net.modules()))
    assert getattr(watch, check)() and getattr(watch, check)()
    h = net[0].register_forward_hook(lambda *a: None)
    assert not getattr(watch, check)()                          # a hook registered anywhere since
    watch = ModuleWatch(list(net.modules()))
    h.remove()
    assert not getattr(watch, check)()                          # one of its modules' hooks removed
    changes = [lambda: setattr(net[1], "bias", torch.nn.Parameter(torch.zeros(2))),       # a weight replaced
               lambda: net.add_module("extra", torch.nn.ReLU()),                          # a module added
               lambda: setattr(net, "0", torch.nn.Linear(4, 4)),                         # a module replaced
               lambda: setattr(net[0], "forward", net[0].forward),                       # an instance forward
               lambda: net[1].half(),                                                    # a cast
               lambda: net[0].__dict__["_forward_hooks"].__setitem__(10 ** 9, print)]    # a hook put in directly
    for change in changes:
        watch = ModuleWatch(list(net.modules()))
        assert getattr(watch, check)()
        change()
        assert not getattr(watch, check)(), change


def test_a_copied_module_watch_watches_the_copied_modules():
    """copy.deepcopy of an engine copies its watch with the modules: the copy compares the copied modules with what
    the resolution read (a change made to the original before the copy shows in both), and each sees only its own
    changes after."""
    import copy
    import pickle

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    watch = ModuleWatch(list(net.modules()))
    twin_net, twin = copy.deepcopy((net, watch))
    assert twin._snapshot is not None and twin.unchanged() and watch.unchanged()
    twin_net[1].half()
    assert not twin.unchanged() and watch.unchanged()
    net[0].forward = net[0].forward
    assert not watch.unchanged()
    late_net, late = copy.deepcopy((net, watch))           # (copied after the change: still a change)
    assert not late.unchanged()
    loaded_net, loaded = pickle.loads(pickle.dumps((twin_net, ModuleWatch(list(twin_net.modules())))))
    assert loaded.unchanged()
    loaded_net.add_module("extra", torch.nn.ReLU())
    assert not loaded.unchanged()


def test_module_watch_keeps_what_it_compares_alive():
    """The snapshot holds a reference to each object it compares: a module dropped from the model (and from every
    other reference) cannot be freed and its address reused by a new object that would then compare as the same."""
    import gc
    import weakref

    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    watch = ModuleWatch(list(net.modules()))
    old = weakref.ref(net[0])
    net[0] = torch.nn.Linear(4, 4)
    gc.collect()
    assert old() is not None and not watch.unchanged()
    del watch
    gc.collect()
    assert old() is None


def run(model, prompts, native: bool, **config):
    engine = Engine(model, EngineConfig(capacity_tokens=1024, max_sequences=8, native_layers=native, **config))
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=8, eos_token_id=EOS)
    with torch.inference_mode():
        engine.run()
    return engine


@pytest.mark.parametrize("shape", ["lin-idx", "idx-lin-idx-lin"])
@pytest.mark.parametrize("config", [dict(max_batch_tokens=7, block_size=4), dict(max_batch_tokens=512)])
def test_the_engine_gives_the_same_tokens_and_state_either_way(shape, config, monkeypatch):
    from hebrus_torch.qsa.planning import _Planning

    model = make_model(shape, seed=2)
    prompts = prompts_for(2, lengths=(10, 4, 15, 1))
    settled, settle = [], _Planning.settle_step_plan
    monkeypatch.setattr(_Planning, "settle_step_plan", lambda self, plan, layers: (settled.extend(layers),
                                                                                    settle(self, plan, layers)))
    python = run(model, prompts, False, **config)
    assert not settled
    native = run(model, prompts, True, **config)
    assert settled                  # the indexed layers ran as one call each over the cache's step plan
    assert native.runner.forward.native.resolutions == 1
    assert {r: q.generated for r, q in native.requests.items()} == \
        {r: q.generated for r, q in python.requests.items()}
    assert native.cache.digest() == python.cache.digest()


@pytest.mark.parametrize("shape", ["lin-idx", "idx-lin-idx-lin"])
def test_with_the_row_kernel_the_engine_gives_the_python_paths_tokens(shape, monkeypatch):
    """The default: the native layers' projections of a decode step's rows and its lm_head (``dense_projection``)
    by the row kernel, the Python path's by nn.Linear. Greedy tokens are the same (the logits differ in the last
    bits: SPEC §8's tolerance); the native layers ran."""
    import hebrus_torch.models.qwen4_exp.native as native_module

    model = make_model(shape, seed=2)
    prompts = prompts_for(2, lengths=(10, 4, 15, 1))
    projected = []
    project = native_module.dense_projection
    monkeypatch.setattr(native_module, "dense_projection", lambda x, w: (projected.append(x.shape[0]), project(x, w))[1])
    python = run(model, prompts, False, max_batch_tokens=512)
    assert not projected
    native = run(model, prompts, True, max_batch_tokens=512)
    assert len(projected) == native.counters.steps and min(projected) <= 8      # every step's lm_head, decode rows too
    assert native.runner.forward.native.resolutions == 1
    assert {r: q.generated for r, q in native.requests.items()} == \
        {r: q.generated for r, q in python.requests.items()}


def test_with_the_row_kernel_a_decode_layers_rows_are_each_its_own_and_close_to_the_modules():
    """A native GDN layer of 1..8 rows: each row's output is bitwise the 1-row call's (the row kernel's order does
    not depend on the row count, where ATen's BLAS picks its kernel by it), and within fp32 rounding of the ops
    it is made of (nn.Linear's products)."""
    model = make_model("lin-idx", seed=3)
    _, calls = native_calls(model)
    call = calls[0].layer
    g = torch.Generator().manual_seed(5)
    hc = model.model.layers[0].mlp_hyper_connection
    width = hc.hc_count * hc.hidden_size
    h = torch.randn(8, width, generator=g)
    gdn = model.model.layers[0].linear_attn
    k = gdn.conv1d.weight.shape[-1]
    conv = torch.randn(8, k - 1, call.gdn[0].shape[0], generator=g)
    rec = torch.randn(8, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, generator=g)

    def layer(rows, pools):
        slots = torch.arange(rows.shape[0], dtype=torch.int32)
        cu = torch.arange(rows.shape[0] + 1, dtype=torch.int32)
        with torch.no_grad():
            return call(rows, pools[0][: rows.shape[0]].clone(), pools[1][: rows.shape[0]].clone(), slots, cu)

    alone = torch.cat([layer(h[i:i + 1], (conv[i:i + 1], rec[i:i + 1])) for i in range(8)])
    for m in (2, 5, 8):
        assert torch.equal(layer(h[:m], (conv, rec)), alone[:m])
    with dense_row_kernel(False):
        modules = layer(h, (conv, rec))
    assert not torch.equal(modules, alone)        # (another order: the comparison above means something)
    torch.testing.assert_close(alone, modules, rtol=1e-5, atol=1e-5)


def test_speculation_with_native_layers_gives_the_same_tokens_and_state():
    from hebrus_torch.engine.speculative import SpeculativeConfig

    model = make_model("lin-idx", seed=9)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9, 10, 9]]
    spec = dict(max_batch_tokens=64, speculative=SpeculativeConfig(3))
    python, native = run(model, prompts, False, **spec), run(model, prompts, True, **spec)
    assert native.counters.spec_drafted_tokens > 0
    assert {r: q.generated for r, q in native.requests.items()} == \
        {r: q.generated for r, q in python.requests.items()}
    assert native.cache.digest() == python.cache.digest()


def test_a_hook_added_between_steps_runs_from_the_next_step():
    model = make_model("lin-idx", seed=10)
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2, max_batch_tokens=64))
    engine.add_request([5, 6, 7, 8], request_id="r", max_new_tokens=6, eos_token_id=-1)
    seen = []
    with torch.inference_mode():
        engine.step()
        engine.step()
        handle = model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        engine.step()
        assert seen                                     # the hooked block ran as its module
        handle.remove()
        n = len(seen)
        engine.step()
        assert len(seen) == n
    assert engine.runner.forward.native.resolutions == 3


def test_the_final_mixer_runs_natively_and_a_change_to_it_is_seen(monkeypatch):
    """The text model's ``hyper_connection_mixer`` runs as one ``hc_premix`` call resolved with the layers
    (``MixerCall``); a hook on it, or a mixer replaced on the text model, is seen at the next step."""
    from hebrus_torch.models.qwen4_exp.native import MixerCall

    model = make_model("lin-idx", seed=12)
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2, max_batch_tokens=64))
    engine.add_request([5, 6, 7, 8], request_id="r", max_new_tokens=8, eos_token_id=-1)
    ran, call = [], MixerCall.__call__
    monkeypatch.setattr(MixerCall, "__call__", lambda self, h: (ran.append(self), call(self, h))[1])
    text, seen = model.model, []
    engine.step()
    assert len(ran) == 1 and ran[0].weights[1] is text.hyper_connection_mixer.input_mix_weight_down.weight
    handle = text.hyper_connection_mixer.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    engine.step()
    assert len(ran) == 1 and len(seen) == 1            # the hooked mixer ran as its module
    handle.remove()
    engine.step()
    assert len(ran) == 2
    text.hyper_connection_mixer = copy.deepcopy(text.hyper_connection_mixer)
    engine.step()
    assert len(ran) == 3 and ran[-1].weights[1] is text.hyper_connection_mixer.input_mix_weight_down.weight
    engine.run()
    python = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2, max_batch_tokens=64, native_layers=False))
    python.add_request([5, 6, 7, 8], request_id="r", max_new_tokens=8, eos_token_id=-1)
    python.run()
    assert len(ran) > 3 and engine.requests["r"].generated == python.requests["r"].generated


def test_native_layers_must_be_a_bool_and_off_means_the_python_path():
    with pytest.raises(HebrusError, match="native_layers must be a bool"):
        EngineConfig(native_layers="yes")
    model = make_model("lin-idx", seed=12)
    engine = run(model, [[5, 6, 7]], False, max_batch_tokens=64)
    assert engine.runner.forward.native.resolutions == 0 and engine.requests["r0"].generated


def test_the_calls_compile_in_a_full_graph():
    model = make_model("lin-idx", seed=13)
    _, calls = native_calls(model)
    tail, att = calls[1].tail, calls[1].attention
    h, cos, sin = attention_inputs(model, 1, torch.float32, 0)

    def layer(h, cos, sin):
        inject, q_index, raw_keys, q, k, v, gate = att.head(h, cos, sin)
        return att.finish(h, q * 0.5, gate, inject)

    with torch.no_grad():
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(h, cos, sin)
        assert torch.equal(got, layer(h, cos, sin))


def test_layer_views_are_kept_only_while_their_bases_are_the_same_tensors():
    from hebrus_torch.state.layer_views import LayerViews

    views = LayerViews()
    a, b = torch.zeros(3, 2), torch.ones(3, 4)
    first = views.views((a, b), 1)
    assert views.views((a, b), 1) is first and first[0].data_ptr() == a[1].data_ptr()
    grown = torch.full((5, 4), 2.0)                 # a holder replaces a state tensor (growth, a move, a restore)
    again = views.views((a, grown), 1)
    assert again is not first and torch.equal(again[1], grown[1]) and again[0].data_ptr() == a[1].data_ptr()


def test_the_whole_attention_layer_compiles_in_a_full_graph(monkeypatch):
    """decode_attention_layer (its planes a mutated tensor list) under torch.compile(fullgraph=True): the same output
    and the same planes as eager."""
    model = make_model("lin-idx", seed=16)
    seen = captured_attention_layers(model, [[5, 6, 7, 8, 9, 10, 11]], monkeypatch, max_batch_tokens=64)
    monkeypatch.undo()                                      # (the layer's own call again)
    call, h, cos, sin, planes, qsa, plan, sizes, qsa_eps = seen[-1]

    def layer(h, planes):
        return call.whole(h, cos, sin, planes, qsa, plan, sizes, qsa_eps)

    compiled, eager = [p.clone() for p in planes], [p.clone() for p in planes]
    with torch.no_grad():
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(h, compiled)
        want = layer(h, eager)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(compiled, eager))


def test_the_bound_layers_bookkeeping_is_settled_before_the_first_layer(monkeypatch):
    """Indexed layers bound ahead (``ChunkStep.qsa_layer_call``) have their bookkeeping settled once, before the first
    layer runs (with the host work's warm caches); none is left while the layers run or after them."""
    from hebrus_torch.models.qwen4_exp import forward
    from hebrus_torch.model_cache import ChunkStep

    model = make_model("idx-lin-idx-lin", seed=29)
    seen = []
    layer_call = forward.PackedQwen4Exp.decoder_layer

    def spy(self, step, idx, *args, **kwargs):
        seen.append((idx, step._unsettled))
        return layer_call(self, step, idx, *args, **kwargs)

    settle = ChunkStep.settle_qsa_layers
    monkeypatch.setattr(forward.PackedQwen4Exp, "decoder_layer", spy)
    monkeypatch.setattr(ChunkStep, "settle_qsa_layers", lambda step: (seen.append(("settle", step._unsettled)),
                                                                       settle(step)))
    run(model, prompts_for(7, lengths=(5,)), True, max_batch_tokens=512)
    # The last step (a decode of one token): the settle of both bound layers, the layers, the forward's and the
    # transaction block's settles (none left).
    assert seen[-7:] == [("settle", (0, 1)), (0, ()), (1, ()), (2, ()), (3, ()), ("settle", ()), ("settle", ())]


def test_a_step_whose_bound_indexed_layer_never_ran_does_not_commit(monkeypatch):
    """A bound indexed layer's bookkeeping is settled before it runs: a step that ends without running the call
    raises ``HebrusError`` naming the layer, and rolls back (the cache as before the step)."""
    from hebrus_torch.models.qwen4_exp import native

    model = make_model("lin-idx", seed=37)
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2, max_batch_tokens=512))
    engine.add_request(prompts_for(9, lengths=(6,))[0], request_id="r", max_new_tokens=8, eos_token_id=EOS)
    engine.step()
    engine.step()
    req = engine.requests["r"]
    before = engine.cache.digest()
    call = native.BoundLayer.__call__
    skipped = []

    def skip_attention(self, h):
        if "attention" in str(self.op):
            skipped.append(self.op)
            return h                # (the layer's call never runs)
        return call(self, h)
    monkeypatch.setattr(native.BoundLayer, "__call__", skip_attention)
    with torch.inference_mode(), pytest.raises(HebrusError, match="never ran"):
        engine.runner.execute([req.seq], [[req.tokens[-1]]], [True], [len(req.tokens) - 1])
    assert skipped
    assert engine.cache.digest() == before


def test_the_holders_host_work_runs_before_the_first_layer(monkeypatch):
    """With native layers, the QSA step plan, the GDN state's step pools, the native PLE layers' n-gram ids and each
    layer's call bound to them are made before the first decoder layer runs, once per step: between the layers'
    calls none of that host work is left."""
    from hebrus_torch.models.qwen4_exp import forward
    from hebrus_torch.model_cache import ChunkStep

    model = make_model("lin-idx", seed=31)
    assert any(layer.ple is not None for layer in model.model.layers)
    seen = []

    def spy(cls, name, tag):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            seen.append(tag)
            return original(*args, **kwargs)
        monkeypatch.setattr(cls, name, wrapper)

    spy(forward.PackedQwen4Exp, "_layers_forward", "step")
    spy(forward.PackedQwen4Exp, "decoder_layer", "layer")
    spy(ChunkStep, "qsa_step_plan", "plan")
    spy(ChunkStep, "gdn_step_pools", "pools")
    spy(ChunkStep, "ple_ngram_ids", "ids")
    python = run(model, prompts_for(8, lengths=(6,)), False, max_batch_tokens=512)
    seen.clear()
    native = run(model, prompts_for(8, lengths=(6,)), True, max_batch_tokens=512)
    assert seen.count("step") >= 8                          # (a prefill step and the decode steps)
    last = seen[len(seen) - seen[::-1].index("step"):]      # (the last step: a decode)
    first_layer = last.index("layer")
    assert sorted(set(last[:first_layer])) == ["ids", "plan", "pools"]
    assert last[:first_layer].count("ids") == 1
    assert set(last[first_layer:]) == {"layer"}         # (each layer's call was bound to the plan and the pools)
    assert {r: q.generated for r, q in native.requests.items()} == \
        {r: q.generated for r, q in python.requests.items()}
    assert native.cache.digest() == python.cache.digest()


@pytest.mark.parametrize("hooked, fused, seed, prompt_seed", [(2, 0, 17, 5), (0, 1, 23, 6)],
                         ids=["hooked after fused", "fused after hooked"])
def test_a_hooked_indexed_layer_and_a_fused_one_in_one_step_give_the_python_paths_state(hooked, fused, seed,
                                                                                        prompt_seed, monkeypatch):
    """One indexed layer (decoder layer ``hooked``) runs through its modules and the QSA cache's own write and plan,
    the other (QSA cache layer ``fused``) as one call over the step plan, in one step. The plan is made before the
    first layer and each layer's part of it is its own, so it holds after the hooked layer wrote; the fused layer's
    bookkeeping is settled after the layers. Tokens and state as the Python path's."""
    from hebrus_torch.qsa.planning import _Planning

    model = make_model("idx-lin-idx-lin", seed=seed)
    prompts = prompts_for(prompt_seed, lengths=(9, 3))
    python = run(model, prompts, False, max_batch_tokens=7, block_size=4)
    settled, settle = [], _Planning.settle_step_plan
    monkeypatch.setattr(_Planning, "settle_step_plan", lambda self, plan, layers: (settled.extend(layers),
                                                                                    settle(self, plan, layers)))
    handle = model.model.layers[hooked].self_attn.q_proj.register_forward_hook(lambda m, args, out: None)
    try:
        native = run(model, prompts, True, max_batch_tokens=7, block_size=4)
    finally:
        handle.remove()
    assert settled and set(settled) == {fused}
    assert {r: q.generated for r, q in native.requests.items()} == \
        {r: q.generated for r, q in python.requests.items()}
    assert native.cache.digest() == python.cache.digest()

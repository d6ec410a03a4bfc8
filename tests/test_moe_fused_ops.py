"""The MoE block's fused ops (issue 37). hebrus::moe_route: the router after its linear (softmax in fp32, top-k,
renormalisation, cast) and the shared expert's sigmoid gate in one dispatch; hebrus::moe_shared_expert: the
shared expert times its gate added to the routed output in one dispatch; hebrus::moe_shared_expert_quantized: the
same over a shared expert whose projections are QuantizedLinear (4 and 8 bits, groups of 32, 64, 128). On CPU the
router gives the bits of transformers' Qwen4ExpTextTopKRouter (with torch.topk's order among equal probabilities);
the shared gate's sigmoid and the shared expert's activation and sum are hebrus's own row arithmetic, within a
tolerance of the block's sigmoid and Qwen4ExpTextMLP (tests/tolerance.py), in every dtype; rows are independent of
each other (so the engine fuses them on CPU too); bad metadata is refused with a HebrusError; opcheck (schema, fake,
autograd registration) passes and they compile in a full graph. The engine's MoE block
(hebrus_torch.moe.block.packed_moe) runs them and still gives the block's output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_models import modeling as M, random_model  # noqa: E402  (skips without transformers)
import hebrus_torch
from hebrus_torch import reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.moe import block
from hebrus_torch.moe.quantized_linear import quantize_linears
from moe_fused_cases import ROUTE_BAD, SHARED_BAD, SHARED_QUANT_BAD, quantized_shared_args  # noqa: E402
from tolerance import near  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def router_and_gate(experts, top_k, norm, dtype, hidden=24, seed=0, tied_rows=0):
    """transformers' router and a shared gate with random weights; the first `tied_rows` router rows are copies
    of row 0 (equal logits, so equal probabilities: ties inside and across the top-k boundary)."""
    config = M.Qwen4ExpTextConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                                  norm_topk_prob=norm)
    router = M.Qwen4ExpTextTopKRouter(config)
    gate = torch.nn.Linear(hidden, 1, bias=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=g) * 0.5)
        router.weight[1:tied_rows] = router.weight[0]
        gate.weight.copy_(torch.randn(1, hidden, generator=g))
    return router.to(dtype), gate.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k,norm,tied", [(64, 10, True, 0), (64, 10, False, 0), (16, 16, True, 0),
                                                      (40, 6, True, 12), (9, 1, False, 9), (512, 10, True, 30)])
def test_cpu_kernel_matches_the_modules(dtype, experts, top_k, norm, tied):
    router, gate = router_and_gate(experts, top_k, norm, dtype, seed=experts + tied, tied_rows=tied)
    x = torch.randn(13, 24, generator=torch.Generator().manual_seed(tied)).to(dtype)
    if tied:
        x[3] = 0            # every logit 0: all E probabilities equal
    with torch.no_grad():
        _, want_weights, want_ids = router(x)
        want_gate = torch.sigmoid(gate(x))
        logits = F.linear(x, router.weight)
        for fn in (hebrus_torch.moe_route, reference.moe_route):
            ids, weights = fn(logits, gate(x), top_k, norm)
            assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
            assert weights.dtype == dtype and torch.equal(weights[:, :top_k], want_weights)
            assert near(weights[:, top_k:], want_gate)
        ids, weights = hebrus_torch.moe_route(logits, None, top_k, norm)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_rows_are_independent():
    router, gate = router_and_gate(48, 8, True, torch.bfloat16, seed=3, tied_rows=10)
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        logits, shared = F.linear(x, router.weight), gate(x)
        ids, weights = hebrus_torch.moe_route(logits, shared, 8, True)
        for row in (0, 4, 8):
            one_ids, one_weights = hebrus_torch.moe_route(logits[row:row + 1], shared[row:row + 1], 8, True)
            assert torch.equal(one_ids[0], ids[row]) and torch.equal(one_weights[0], weights[row])


def test_empty_rows():
    ids, weights = hebrus_torch.moe_route(torch.empty(0, 8), torch.empty(0, 2), 3, True)
    assert ids.shape == (0, 3) and ids.dtype == torch.int64 and weights.shape == (0, 5)


@pytest.mark.parametrize("bad,match", ROUTE_BAD)
def test_bad_metadata_raises_and_changes_nothing(bad, match):
    logits, shared = torch.randn(3, 8), torch.randn(3, 1)
    l0, s0 = logits.clone(), shared.clone()
    for fn in (hebrus_torch.moe_route, reference.moe_route):
        with pytest.raises(HebrusError, match=match):
            fn(*bad(logits, shared), True)
    assert torch.equal(logits, l0) and torch.equal(shared, s0)


def test_opcheck():
    logits, shared = torch.randn(5, 16), torch.randn(5, 1)
    op = torch.ops.hebrus.moe_route.default
    torch.library.opcheck(op, (logits, shared, 4, True))
    torch.library.opcheck(op, (logits.to(torch.bfloat16), None, 16, False))


def test_compile_fullgraph():
    logits, shared = torch.randn(5, 16), torch.randn(5, 1)
    fn = torch.compile(hebrus_torch.moe_route, fullgraph=True, backend="eager")
    got, want = fn(logits, shared, 4, True), hebrus_torch.moe_route(logits, shared, 4, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_no_backward():
    logits = torch.randn(3, 8, requires_grad=True)
    _, weights = hebrus_torch.moe_route(logits, None, 2, True)
    with pytest.raises(RuntimeError, match="moe_route"):
        weights.sum().backward()


def blocks(dtype, rows=7, seed=0):
    model = random_model(seed, dtype=dtype, num_experts=8, num_experts_per_tok=3)
    layers = model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return [layer.mlp for layer in layers], x


@pytest.mark.parametrize("dtype", DTYPES)
def test_route_gives_the_blocks_router_and_gate(dtype, monkeypatch):
    """packed_moe's router (one moe_route call) is the block's own, bit for bit; its shared gate within the
    tolerance of the block's sigmoid."""
    seen = []
    real = block.moe_route
    monkeypatch.setattr(block, "moe_route", lambda *a: seen.append(a[0].shape) or real(*a))
    mlps, x = blocks(dtype)
    with torch.inference_mode():
        for mlp in mlps:
            ids, weights, shared_gate = block.route(mlp, x, fused=True)
            _, want_weights, want_ids = mlp.gate(x)
            assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
            assert near(shared_gate, torch.sigmoid(mlp.shared_expert_gate(x)))
    assert len(seen) == len(mlps)


def test_a_hooked_router_runs_as_itself(monkeypatch):
    seen, calls = [], []
    real = block.moe_route
    monkeypatch.setattr(block, "moe_route", lambda *a: calls.append(1) or real(*a))
    mlps, x = blocks(torch.float32)
    mlps[0].gate.register_forward_hook(lambda mod, args, out: seen.append(out[2].shape))
    with torch.inference_mode():
        ids, _, _ = block.route(mlps[0], x)
    assert calls == [] and seen == [ids.shape]


# ---- moe_shared_expert ----------------------------------------------------------------------------------------

def routed_and_gate(mlp, x, k=3, seed=1):
    """A random routed output, and the block's shared gate as moe_route returns it (the last column of [T, k + 1]
    weights: a strided view)."""
    routed = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.dtype)
    weights = torch.cat([torch.rand(x.shape[0], k).to(x.dtype), torch.sigmoid(mlp.shared_expert_gate(x))], dim=1)
    return routed, weights[:, k:]


def shared_args(mlp, x):
    """The op's arguments for a block (:func:`routed_and_gate`)."""
    routed, gate = routed_and_gate(mlp, x)
    sh = mlp.shared_expert
    return routed, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, gate


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_expert_cpu_kernel_matches_the_block(dtype):
    mlps, x = blocks(dtype, rows=9)
    with torch.inference_mode():
        for mlp in mlps:
            routed, gp, up, dp, gate = shared_args(mlp, x)
            want = routed + torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
            assert near(hebrus_torch.moe_shared_expert(x, routed, gp, up, dp, gate), want)
            assert torch.equal(reference.moe_shared_expert(x, routed, gp, up, dp, gate), want)


def test_shared_expert_rows_are_independent():
    mlps, x = blocks(torch.bfloat16, rows=9)
    with torch.inference_mode():
        routed, gp, up, dp, gate = shared_args(mlps[0], x)
        whole = hebrus_torch.moe_shared_expert(x, routed, gp, up, dp, gate)
        for t in (0, 4, 8):
            one = hebrus_torch.moe_shared_expert(x[t:t + 1], routed[t:t + 1], gp, up, dp, gate[t:t + 1])
            assert torch.equal(one[0], whole[t])


@pytest.mark.parametrize("bad,match", SHARED_BAD)
def test_shared_expert_bad_metadata_raises_and_changes_nothing(bad, match):
    g = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(s, generator=g) for s in ((3, 8), (3, 8), (6, 8), (6, 8), (8, 6), (3, 1)))
    before = [a.clone() for a in args]
    for fn in (hebrus_torch.moe_shared_expert, reference.moe_shared_expert):
        with pytest.raises(HebrusError, match=match):
            fn(*bad(args))
    assert all(torch.equal(a, b) for a, b in zip(args, before))


def test_shared_expert_opcheck_and_compile():
    g = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(s, generator=g) for s in ((3, 8), (3, 8), (6, 8), (6, 8), (8, 6), (3, 1)))
    torch.library.opcheck(torch.ops.hebrus.moe_shared_expert.default, args)
    torch.library.opcheck(torch.ops.hebrus.moe_shared_expert.default, tuple(a.to(torch.bfloat16) for a in args))
    fn = torch.compile(hebrus_torch.moe_shared_expert, fullgraph=True, backend="eager")
    assert torch.equal(fn(*args), hebrus_torch.moe_shared_expert(*args))


@pytest.mark.parametrize("fused", [True, None, False])
def test_packed_moe_runs_both_ops_and_gives_the_blocks_output(monkeypatch, fused):
    """fused=True (the default, on CPU too): moe_route with the gate, then moe_shared_expert; fused=False: the
    gate's sigmoid and the shared expert stay module calls; the block's output either way."""
    calls = []
    for name in ("moe_route", "moe_shared_expert"):
        real = getattr(block, name)
        monkeypatch.setattr(block, name, lambda *a, _real=real, _name=name: calls.append((_name, a[1] is not None))
                            or _real(*a))
    mlps, x = blocks(torch.float32, rows=5)
    with torch.inference_mode():
        for mlp in mlps:
            torch.testing.assert_close(block.packed_moe(mlp, x, fused), mlp(x[None])[0], atol=1e-6, rtol=1e-6)
    want = [("moe_route", True), ("moe_shared_expert", True)] if fused is not False else [("moe_route", False)]
    assert calls == want * len(mlps)


def test_a_wrapped_shared_expert_runs_as_itself(monkeypatch):
    calls, seen = [], []
    real = block.moe_shared_expert
    monkeypatch.setattr(block, "moe_shared_expert", lambda *a: calls.append(1) or real(*a))
    mlps, x = blocks(torch.float32, rows=5)
    mlps[0].shared_expert.down_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    with torch.inference_mode():
        torch.testing.assert_close(block.packed_moe(mlps[0], x, fused=True), mlps[0](x[None])[0], atol=1e-6,
                                   rtol=1e-6)
        assert block.shared_expert_weights(mlps[0].shared_expert, x) is None
    assert calls == [] and len(seen) == 2


# ---- moe_shared_expert_quantized --------------------------------------------------------------------------------

SHARED_PROJECTIONS = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")


def quantized_block(dtype, bits, group_size, hidden=256, inter=128, seed=0):
    """transformers' MoE block with random weights and its shared expert's projections QuantizedLinear (what the
    converter writes by default), and packed rows x [9, hidden]."""
    config = M.Qwen4ExpTextConfig(hidden_size=hidden, shared_expert_intermediate_size=inter, moe_intermediate_size=32,
                                  num_experts=4, num_experts_per_tok=2)
    mlp = M.Qwen4ExpTextSparseMoeBlock(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    mlp = quantize_linears(mlp.to(dtype).eval(), SHARED_PROJECTIONS, bits, group_size)
    return mlp, torch.randn(9, hidden, generator=g).to(dtype)


def quantized_args(mlp, x):
    """The op's arguments for a block with a quantized shared expert (:func:`routed_and_gate`)."""
    routed, gate = routed_and_gate(mlp, x)
    sh = mlp.shared_expert
    tensors = [t for p in (sh.gate_proj, sh.up_proj, sh.down_proj) for t in (p.weight, p.scales, p.biases)]
    return (x, routed, *tensors, gate, sh.gate_proj.group_size, sh.gate_proj.bits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_shared_expert_quantized_cpu_kernel_matches_the_modules(dtype, bits, group_size):
    """The CPU kernel = the block's tail with its QuantizedLinear shared expert, bit for bit; the reference (torch's
    sums of the folded groups) to rounding."""
    mlp, x = quantized_block(dtype, bits, group_size)
    with torch.inference_mode():
        args = quantized_args(mlp, x)
        want = args[1] + torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
        assert near(hebrus_torch.moe_shared_expert_quantized(*args), want)
        tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}[dtype]
        torch.testing.assert_close(reference.moe_shared_expert_quantized(*args), want, atol=tol, rtol=tol)


def test_shared_expert_quantized_rows_are_independent():
    mlp, x = quantized_block(torch.bfloat16, 4, 64)
    with torch.inference_mode():
        args = quantized_args(mlp, x)
        whole = hebrus_torch.moe_shared_expert_quantized(*args)
        for t in (0, 4, 8):
            one = hebrus_torch.moe_shared_expert_quantized(x[t:t + 1], args[1][t:t + 1], *args[2:11],
                                                           args[11][t:t + 1], *args[12:])
            assert torch.equal(one[0], whole[t])


def test_shared_expert_quantized_empty_rows():
    args = quantized_shared_args(0, 64, 32, torch.float16, 4, 32)
    assert hebrus_torch.moe_shared_expert_quantized(*args).shape == (0, 64)


@pytest.mark.parametrize("bad,match", SHARED_QUANT_BAD)
def test_shared_expert_quantized_bad_metadata_raises_and_changes_nothing(bad, match):
    args = quantized_shared_args(3, 64, 32, torch.float32, 4, 32)
    before = [a.clone() for a in args[:12]]
    for fn in (hebrus_torch.moe_shared_expert_quantized, reference.moe_shared_expert_quantized):
        with pytest.raises(HebrusError, match=match):
            fn(*bad(args))
    assert all(torch.equal(a, b) for a, b in zip(args, before))


def test_shared_expert_quantized_opcheck_and_compile():
    op = torch.ops.hebrus.moe_shared_expert_quantized.default
    for dtype, bits in ((torch.float32, 4), (torch.bfloat16, 8)):
        args = quantized_shared_args(3, 64, 32, dtype, bits, 32)
        torch.library.opcheck(op, args)
    fn = torch.compile(hebrus_torch.moe_shared_expert_quantized, fullgraph=True, backend="eager")
    assert torch.equal(fn(*args), hebrus_torch.moe_shared_expert_quantized(*args))


@pytest.mark.parametrize("fused", [True, None, False])
def test_packed_moe_runs_the_quantized_shared_expert_op(monkeypatch, fused):
    """A block whose shared expert is QuantizedLinear (the converter's default): with fused=True (the default) the
    tail is one moe_shared_expert_quantized call, with the block's output; with fused=False the module call."""
    calls = []
    for name in ("moe_shared_expert", "moe_shared_expert_quantized"):
        real = getattr(block, name)
        monkeypatch.setattr(block, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    for bits, group_size in ((4, 32), (8, 128)):
        mlp, x = quantized_block(torch.float32, bits, group_size)
        with torch.inference_mode():
            torch.testing.assert_close(block.packed_moe(mlp, x, fused), mlp(x[None])[0], atol=1e-5, rtol=1e-5)
    assert calls == (["moe_shared_expert_quantized"] * 2 if fused is not False else [])


@pytest.mark.parametrize("change", ["mixed_bits", "mixed_groups", "one_plain_linear", "hooked"])
def test_other_quantized_shared_experts_run_as_modules(monkeypatch, change):
    calls = []
    real = block.moe_shared_expert_quantized
    monkeypatch.setattr(block, "moe_shared_expert_quantized", lambda *a: calls.append(1) or real(*a))
    mlp, x = quantized_block(torch.float32, 4, 32)
    sh = mlp.shared_expert
    if change == "mixed_bits":
        sh.up_proj = type(sh.up_proj).from_linear(torch.nn.Linear(256, 128, bias=False), 8, 32)
    elif change == "mixed_groups":
        sh.down_proj = type(sh.down_proj).from_linear(torch.nn.Linear(128, 256, bias=False), 4, 64)
    elif change == "one_plain_linear":
        sh.gate_proj = torch.nn.Linear(256, 128, bias=False)
    else:
        sh.down_proj.register_forward_hook(lambda mod, args, out: None)
    with torch.inference_mode():
        torch.testing.assert_close(block.packed_moe(mlp, x, fused=True), mlp(x[None])[0], atol=1e-5, rtol=1e-5)
        assert block.shared_expert_quantized_weights(sh, x) is None
    assert calls == []


def test_packed_moe_with_the_quantized_shared_expert_op_compiles_fullgraph(monkeypatch):
    """The selection of the fused tail (module types, bits / group sizes, autograd) traces without a graph break."""
    calls = []
    real = block.moe_shared_expert_quantized
    monkeypatch.setattr(block, "moe_shared_expert_quantized", lambda *a: calls.append(1) or real(*a))
    mlp, x = quantized_block(torch.float32, 4, 32)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = block.packed_moe(mlp, x, True)
            got = torch.compile(lambda v: block.packed_moe(mlp, v, True), fullgraph=True, backend="aot_eager")(x)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want) and len(calls) >= 2

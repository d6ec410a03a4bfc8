"""GDNState: lifecycle, transactions, saved state, bitwise chunk invariance and transformers parity (SPEC §4, §5, §8)."""

import hashlib
import json
import random
import struct

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch.errors import CorruptStateError, HebrusError, StaleHandleError
from hebrus_torch.gdn import GDNSnapshot, GDNState, gated_delta_rule, gdn_forward
from hebrus_torch.gdn import state as gdn_state_mod
from hebrus_torch.gdn.forward import _sigmoid, _softplus
from hebrus_torch.state import blob as blob_mod

LAYERS, HK, HV, DK, DV, K = 2, 2, 4, 8, 8, 4
CONV_DIM = 2 * HK * DK + HV * DV


def make_state(device="cpu", dtype=torch.float32, max_sequences=6, seed=0, hk=HK, hv=HV, dk=DK, dv=DV, layers=LAYERS):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    weights = [(torch.randn(conv_dim, K, generator=g) * 0.5).to(dtype).to(device) for _ in range(layers)]
    return GDNState(layers, num_key_heads=hk, num_value_heads=hv, key_head_dim=dk, value_head_dim=dv,
                    conv_kernel_size=K, max_sequences=max_sequences, dtype=dtype, device=device,
                    conv_weights=weights)


def seq_inputs(n, seed, dtype=torch.float32, hk=HK, hv=HV, dk=DK, dv=DV):
    """One sequence's conv input x [n, conv_dim] and per-token a/b (for g, beta) [n, Hv]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 * hk * dk + hv * dv, generator=g).to(dtype)
    a = torch.randn(n, hv, generator=g)
    b = torch.randn(n, hv, generator=g)
    return x, a, b


def cu_of(lengths, device="cpu"):
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0)), dtype=torch.int32,
                        device=device)


def run_step(state, seqs, rows, device="cpu", txn=True):
    """One packed step through every layer (conv, then the delta rule on the conv's output), in a transaction
    of its own unless ``txn`` is False.

    rows: per sequence (x, a, b) slices. Returns per layer (y, out) packed."""
    if txn:
        with ht.transaction(state):
            return run_step(state, seqs, rows, device, txn=False)
    lengths = [r[0].shape[0] for r in rows]
    cu = cu_of(lengths, device)
    x = torch.cat([r[0] for r in rows]).to(device)
    a = torch.cat([r[1] for r in rows]).to(device)
    b = torch.cat([r[2] for r in rows]).to(device)
    T = x.shape[0]
    hk, hv, dk, dv = state.num_key_heads, state.num_value_heads, state.key_head_dim, state.value_head_dim
    outs = []
    for layer in range(state.num_layers):
        y = state.conv(layer, seqs, x * (layer + 1), cu)
        q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
        # torch.sigmoid / F.softplus round differently by position in a CPU loop; these helpers do not
        g = -_softplus(a.float() + layer)
        beta = _sigmoid(b.float())
        out = state.delta_rule(layer, seqs, cu, q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv),
                               g, beta)
        outs.append((y, out))
    return outs


def split(t, lengths):
    return list(torch.split(t, lengths))


def advance(state, seq, n, seed):
    run_step(state, [seq], [seq_inputs(n, seed)])


# ----------------------------------------------------------------------------- bitwise chunk invariance
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(HK, HV, DK, DV), (4, 8, 32, 16), (3, 3, 5, 7)])
def test_chunk_invariance_bitwise_under_cuts_and_batching(dtype, shape):
    """The same stream in one shot, as 1/2/1-token steps and random cuts, each step packed with other
    sequences (random lengths, random row order, 0-token rows): bitwise equal outputs, tails, recurrent
    states and digest(seq)."""
    hk, hv, dk, dv = shape
    n = 37
    x, a, b = seq_inputs(n, 1, dtype, hk, hv, dk, dv)
    rng = random.Random(5)
    pattern, pos, one_two_one = [1, 2, 1], 0, []
    while pos < n:
        pos = min(pos + pattern[len(one_two_one) % 3], n)
        one_two_one.append(pos)
    plans = {"one_shot": [n], "1/2/1": one_two_one, "tokens": list(range(1, n + 1)),
             "random": sorted(rng.sample(range(1, n), 7)) + [n]}
    results = {}
    for name, cuts in plans.items():
        for batched in (False, True):
            state = make_state(dtype=dtype, hk=hk, hv=hv, dk=dk, dv=dv, max_sequences=5)
            others = [state.new_sequence() for _ in range(2)]
            seq = state.new_sequence()
            ys, outs, start = [[] for _ in range(LAYERS)], [[] for _ in range(LAYERS)], 0
            for step, stop in enumerate(cuts):
                seqs, rows = [seq], [(x[start:stop], a[start:stop], b[start:stop])]
                if batched:
                    for j, o in enumerate(others):
                        m = rng.choice([0, 1, 1, 3, 9, 40])
                        seqs.append(o)
                        rows.append(seq_inputs(m, 100 + 10 * step + j, dtype, hk, hv, dk, dv))
                    order = list(range(len(seqs)))
                    rng.shuffle(order)
                    seqs, rows = [seqs[i] for i in order], [rows[i] for i in order]
                lengths = [r[0].shape[0] for r in rows]
                mine = seqs.index(seq)
                for layer, (y, out) in enumerate(run_step(state, seqs, rows)):
                    ys[layer].append(split(y, lengths)[mine])
                    outs[layer].append(split(out, lengths)[mine])
                start = stop
            results[(name, batched)] = ([torch.cat(t) for t in ys], [torch.cat(t) for t in outs],
                                        state.snapshot(seq), state.digest(seq))
    base = results[("one_shot", False)]
    for key, (ys, outs, snap, digest) in results.items():
        for layer in range(LAYERS):
            assert torch.equal(ys[layer], base[0][layer]), key
            assert torch.equal(outs[layer], base[1][layer]), key
        assert torch.equal(snap.conv_tails, base[2].conv_tails), key
        assert torch.equal(snap.recurrent, base[2].recurrent), key
        assert digest == base[3], key


@pytest.mark.parametrize("hk,hv,dk,dv", [(HK, HV, DK, DV), (4, 16, 64, 32)])
def test_delta_rule_rows_do_not_depend_on_the_batch(hk, hv, dk, dv):
    """The functional rule: a row alone, and the same row among 63 others of other lengths, gives the
    same bits (the per-row arithmetic does not depend on how many rows are active)."""
    gen = torch.Generator().manual_seed(7)
    lengths = [random.Random(i).randint(0, 9) for i in range(64)]
    lengths[17], lengths[40] = 6, 9
    T = sum(lengths)
    q, k = torch.randn(T, hk, dk, generator=gen), torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    g, beta = -torch.rand(T, hv, generator=gen), torch.rand(T, hv, generator=gen)
    state = torch.randn(64, hv, dk, dv, generator=gen)
    cu = cu_of(lengths)
    out, new = gated_delta_rule(q, k, v, g, beta, cu, state)
    for row in (17, 40, 0):
        s, e = int(cu[row]), int(cu[row + 1])
        one = torch.tensor([0, e - s], dtype=torch.int32)
        out1, new1 = gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], one, state[row:row + 1])
        assert torch.equal(out1, out[s:e]) and torch.equal(new1[0], new[row]), row
    zero = [i for i, n in enumerate(lengths) if n == 0]
    assert zero and all(torch.equal(new[i], state[i]) for i in zero)


# ----------------------------------------------------------------------------- transformers parity
def _hf():
    return pytest.importorskip("hf_models", reason="needs transformers==5.23.0")


@pytest.mark.hf
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_delta_rule_matches_transformers_recurrent_and_chunked(hk, hv):
    modeling = _hf().modeling
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 70, 0, 130, 5]
    T = sum(lengths)
    q, k = torch.randn(T, hk, DK, generator=gen), torch.randn(T, hk, DK, generator=gen)
    v = torch.randn(T, hv, DV, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(T, hv, generator=gen))
    beta = torch.rand(T, hv, generator=gen)
    init = torch.randn(len(lengths), hv, DK, DV, generator=gen) * 0.3
    cu = cu_of(lengths)
    out, new = gated_delta_rule(q, k, v, g, beta, cu, init)
    for i, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(new[i], init[i])
            continue
        s, e = int(cu[i]), int(cu[i + 1])
        args = [t[s:e][None] for t in (q, k, v, g, beta)]
        for fn in (modeling.torch_recurrent_gated_delta_rule, modeling.torch_chunk_gated_delta_rule):
            want, want_state = fn(*args[:3], g=args[3], beta=args[4], initial_state=init[i:i + 1].clone(),
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(out[s:e], want[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(new[i], want_state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.hf
def test_conv_matches_transformers_causal_conv1d():
    """Prefill chunks against causal_conv1d_fn on the whole stream, a decode step against
    causal_conv1d_update with transformers' [1, C, K] state built from the holder's tail."""
    modeling = _hf().modeling
    state = make_state(max_sequences=2)
    seq = state.new_sequence()
    n = 13
    x, _, _ = seq_inputs(n + 1, 3)
    w = state._conv_weights[0]
    ys = []
    for s, e in ((0, 5), (5, 6), (6, n)):
        ys.append(state.conv(0, [seq], x[s:e], cu_of([e - s])))
    want = modeling.causal_conv1d_fn(x[:n].T[None], w, None, activation="silu")[0].T
    torch.testing.assert_close(torch.cat(ys), want, atol=1e-5, rtol=1e-5)
    tail = state.snapshot(seq).conv_tails[0]                              # [K-1, C]
    hf_state = torch.cat([torch.zeros(1, CONV_DIM), tail]).T[None].clone()   # [1, C, K]
    want_y = modeling.causal_conv1d_update(x[n:].T[None], hf_state, w, None, "silu")[0].T
    y = state.conv(0, [seq], x[n:], cu_of([1]))
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    assert torch.equal(state.snapshot(seq).conv_tails[0], x[n - K + 2:n + 1])


def _tiny_gdn_module(hf, **overrides):
    config = hf.tiny_indexer_config(**overrides)
    torch.manual_seed(0)
    module = hf.modeling.Qwen4ExpTextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():   # transformers' init leaves some weights at 0/1; random ones test every path
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        module.A_log.copy_(torch.rand_like(module.A_log).log())
    return config, module


@pytest.mark.hf
@pytest.mark.parametrize("overrides,dtype", [({}, torch.float32),
                                             ({"linear_num_key_heads": 1, "linear_num_value_heads": 2}, torch.float32),
                                             ({}, torch.bfloat16)])
def test_gdn_forward_matches_the_module_with_a_dynamic_cache(overrides, dtype):
    """Three sequences, packed together (prefill chunks of different lengths, then decode steps), against
    each sequence run alone through the module's own forward with a DynamicCache."""
    hf = _hf()
    from transformers.cache_utils import DynamicCache
    config, module = _tiny_gdn_module(hf, **overrides)
    module.to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    state = GDNState(1, num_key_heads=module.num_k_heads, num_value_heads=module.num_v_heads,
                     key_head_dim=module.head_k_dim, value_head_dim=module.head_v_dim,
                     conv_kernel_size=module.conv_kernel_size, max_sequences=4, dtype=dtype)
    seqs = [state.new_sequence() for _ in range(3)]
    plan = [[7, 2, 12], [5, 1, 3], [1, 1, 1], [1, 0, 1], [1, 1, 1]]   # tokens per sequence per step
    total = [sum(p[i] for p in plan) for i in range(3)]
    gen = torch.Generator().manual_seed(4)
    hidden = [torch.randn(n, config.hidden_size, generator=gen).to(dtype) for n in total]
    got, pos = [[] for _ in range(3)], [0, 0, 0]
    with torch.no_grad():
        for step in plan:
            rows = [i for i in range(3) if step[i] or i == 1]      # a 0-token row is passed too
            x = torch.cat([hidden[i][pos[i]:pos[i] + step[i]] for i in rows])
            with ht.transaction(state):
                y = gdn_forward(module, state, 0, [seqs[i] for i in rows], x, cu_of([step[i] for i in rows]))
            for i, part in zip(rows, split(y, [step[i] for i in rows])):
                got[i].append(part)
                pos[i] += step[i]
        for i in range(3):
            cache = DynamicCache(config=config)
            want, p = [], 0
            for step in plan:
                if step[i]:
                    want.append(module(hidden[i][None, p:p + step[i]], cache_params=cache)[0])
                    p += step[i]
            torch.testing.assert_close(torch.cat(got[i]), torch.cat(want), atol=tol, rtol=tol)
            snap = state.snapshot(seqs[i])
            assert snap.conv_tails.dtype == dtype and snap.recurrent.dtype == torch.float32
            torch.testing.assert_close(snap.recurrent[0], cache.layers[0].recurrent_states[0][0].float(), atol=tol,
                                       rtol=tol)
            # (in_proj_qkv's rows differ in the last bits between the packed and the solo call: BLAS)
            torch.testing.assert_close(snap.conv_tails[0], cache.layers[0].conv_states[0][0, :, 1:].T,
                                       atol=tol, rtol=tol)


@pytest.mark.hf
def test_from_transformers_maps_layers_and_reads_the_config():
    hf = _hf()
    config = hf.tiny_indexer_config(layer_types=["linear_attention", "indexed_attention", "linear_attention"],
                                    num_hidden_layers=3, ple_layer_ids=[1])
    model = hf.modeling.Qwen4ExpForCausalLM(config).eval()
    state = GDNState.from_transformers(model, max_sequences=3)
    assert state.layer_ids == [0, 2] and state.num_layers == 2
    assert (state.layer_index(0), state.layer_index(2)) == (0, 1)
    with pytest.raises(HebrusError, match="decoder layer 1 is not a linear_attention"):
        state.layer_index(1)
    assert state.conv_state.shape == (2, 3, config.linear_conv_kernel_dim - 1, model.model.layers[0].linear_attn.conv_dim)
    assert state.recurrent_state.shape == (2, 3, config.linear_num_value_heads, config.linear_key_head_dim,
                                           config.linear_value_head_dim)
    assert state._conv_weights[1] is model.model.layers[2].linear_attn.conv1d.weight
    assert GDNState.from_transformers(model.model).layer_ids == [0, 2]
    with pytest.raises(HebrusError, match="no linear_attention"):
        GDNState.from_transformers(hf.modeling.Qwen4ExpForCausalLM(
            hf.tiny_indexer_config(layer_types=["indexed_attention", "indexed_attention"], ple_layer_ids=[])))


# ----------------------------------------------------------------------------- lifecycle and handles
def test_lifecycle_and_stale_handles():
    state = make_state(max_sequences=3)
    a = state.new_sequence()
    fresh = state.digest(a)
    advance(state, a, 5, 1)
    assert state.digest(a) != fresh
    b = state.fork(a)
    assert state.digest(b) == state.digest(a)
    c = state.new_sequence()
    state.copy(a, c)
    assert state.digest(c) == state.digest(a)
    state.clear(c)
    assert state.digest(c) == fresh
    a2 = state.reset(a)
    assert a2.slot == a.slot and a2.generation == a.generation + 1 and state.digest(a2) == fresh
    for call in (lambda: state.snapshot(a), lambda: state.save(a), lambda: state.free(a), lambda: state.clear(a),
                 lambda: state.copy(a, b), lambda: state.copy(b, a), lambda: state.fork(a), lambda: state.keep(a),
                 lambda: advance(state, a, 1, 2)):
        before = state.digest()
        with pytest.raises(StaleHandleError):
            call()
        assert state.digest() == before
    with pytest.raises(ht.CapacityError):
        state.new_sequence()
    state.keep(b)
    assert state.slots.live_handles() == [b]
    state.free(b)
    with pytest.raises(StaleHandleError):
        state.free(b)
    assert state.slots.live_handles() == []


def test_fork_and_copy_are_independent():
    state = make_state()
    a = state.new_sequence()
    advance(state, a, 6, 1)
    b, c = state.fork(a), state.new_sequence()
    state.copy(a, c)
    before_a = state.digest(a)
    advance(state, b, 3, 2)
    advance(state, c, 4, 3)
    assert state.digest(a) == before_a
    advance(state, a, 3, 2)
    assert state.digest(a) == state.digest(b)        # same history, same tokens: same state
    assert state.digest(c) != state.digest(a)


def test_snapshot_restore_for_rewind():
    state = make_state()
    a = state.new_sequence()
    advance(state, a, 6, 1)
    snap = state.snapshot(a, position=6)
    assert isinstance(snap, GDNSnapshot) and snap.position == 6
    at6 = state.digest(a)
    outs1 = run_step(state, [a], [seq_inputs(4, 9)])
    after = state.digest(a)
    state.restore(a, snap)
    assert state.digest(a) == at6
    outs2 = run_step(state, [a], [seq_inputs(4, 9)])
    assert state.digest(a) == after
    assert all(torch.equal(o1[1], o2[1]) for o1, o2 in zip(outs1, outs2))
    # a snapshot is a copy: later steps do not change it
    assert torch.equal(state.snapshot(a, 6).recurrent, state.snapshot(a).recurrent)
    bad = GDNSnapshot(a, 0, snap.conv_tails[:1], snap.recurrent)
    before = state.digest()
    with pytest.raises(HebrusError, match="conv tails must be"):
        state.restore(a, bad)
    with pytest.raises(HebrusError, match="recurrent states must be"):
        state.restore(a, GDNSnapshot(a, 0, snap.conv_tails, snap.recurrent.double()))
    with pytest.raises(HebrusError, match="expected a GDNSnapshot"):
        state.restore(a, "nope")
    assert state.digest() == before


def test_digest_covers_generations():
    state = make_state()
    a = state.new_sequence()
    d0 = state.digest()
    state.free(a)
    d1 = state.digest()
    b = state.new_sequence()
    assert b.generation == 1 and len({d0, d1, state.digest()}) == 3


# ----------------------------------------------------------------------------- transactions
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("target", ["conv", "delta_rule"])
@pytest.mark.parametrize("fail_at", range(4))
def test_faults_inside_a_transaction_roll_back_bitwise(monkeypatch, target, fail_at, when):
    """Two packed steps (every layer each) in one transaction; the k-th conv or delta-rule call raises,
    before its in-place op or after the op has written the pool (the undo entry is logged first)."""
    state = make_state()
    a, b, c = state.new_sequence(), state.new_sequence(), state.new_sequence()
    advance(state, a, 5, 1)
    before, before_a = state.digest(), state.snapshot(a)
    calls = {"n": 0}
    module, name = ((gdn_state_mod.ple_ops, "ple_conv_slots") if target == "conv"
                    else (gdn_state_mod, "gated_delta_rule_slots"))
    real = getattr(module, name)

    def faulty(*args, **kwargs):
        if calls["n"] == fail_at:
            if when == "after":
                real(*args, **kwargs)   # the pool is written in place ...
            raise RuntimeError("injected")   # ... and the call fails before returning
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, faulty)
    with pytest.raises(RuntimeError, match="injected"):
        with ht.transaction(state):
            run_step(state, [a, b], [seq_inputs(3, 2), seq_inputs(1, 3)], txn=False)
            state.fork(a)
            run_step(state, [b, a, c], [seq_inputs(2, 4), seq_inputs(1, 5), seq_inputs(0, 6)], txn=False)
    assert calls["n"] == fail_at
    assert state.digest() == before
    after_a = state.snapshot(a)
    assert torch.equal(after_a.conv_tails, before_a.conv_tails) and torch.equal(after_a.recurrent, before_a.recurrent)


def test_lifecycle_inside_a_failing_transaction_rolls_back():
    state = make_state()
    a = state.new_sequence()
    advance(state, a, 5, 1)
    b = state.fork(a)
    before = state.digest()
    with pytest.raises(RuntimeError):
        with ht.transaction(state):
            x, _, _ = seq_inputs(3, 4)
            state.conv(0, [a], x, cu_of([3]))
            c = state.new_sequence()
            state.copy(a, c)
            state.reset(b)
            state.free(a)
            state.fork(c)
            raise RuntimeError("abort")
    assert state.digest() == before
    assert state.slots.live_handles() == [a, b]


def test_state_is_updated_in_place_inside_the_transaction_and_kept_at_commit():
    state = make_state()
    a = state.new_sequence()
    fresh = state.recurrent_state.clone()
    x, _, _ = seq_inputs(4, 1)
    with ht.transaction(state):
        y1 = state.conv(0, [a], x[:2], cu_of([2]))
        y2 = state.conv(0, [a], x[2:], cu_of([2]))          # reads the tail the first call wrote in place
        assert torch.equal(state.conv_state[0, a.slot], x[1:4])   # the pool itself: no staging copy
        snap = state.snapshot(a)
        assert torch.equal(snap.conv_tails[0], x[1:4])
    assert torch.equal(state.snapshot(a).conv_tails[0], x[1:4])
    ref = make_state()
    r = ref.new_sequence()
    assert torch.equal(torch.cat([y1, y2]), ref.conv(0, [r], x, cu_of([4])))
    assert torch.equal(state.recurrent_state, fresh)
    before = state.conv_state.clone()
    with pytest.raises(RuntimeError, match="abort"):
        with ht.transaction(state):
            state.conv(0, [a], x[:3], cu_of([3]))
            assert not torch.equal(state.conv_state, before)
            raise RuntimeError("abort")
    assert torch.equal(state.conv_state, before)             # rolled back bitwise


def test_untouched_slots_are_bitwise_unchanged():
    """A step writes only its own sequences' rows of each pool, in place; every other slot (free or
    live, NaN payloads included) keeps its bytes, in and out of transactions."""
    state = make_state(max_sequences=8)
    seqs = [state.new_sequence() for _ in range(4)]
    for i, s in enumerate(seqs):
        advance(state, s, 3 + i, 10 + i)
    state.recurrent_state[:, 6] = float("nan")    # a free slot with odd bits
    state.conv_state[:, 7] = float("-inf")
    conv_before, rec_before = state.conv_state.clone(), state.recurrent_state.clone()
    run_step(state, [seqs[2], seqs[0]], [seq_inputs(2, 30), seq_inputs(1, 31)], txn=False)
    with ht.transaction(state):
        run_step(state, [seqs[0]], [seq_inputs(1, 32)], txn=False)
    touched = {seqs[0].slot, seqs[2].slot}
    for slot in range(state.slots.capacity):
        for now, then in ((state.conv_state, conv_before), (state.recurrent_state, rec_before)):
            now_b, then_b = (t[:, slot].contiguous().view(torch.uint8) for t in (now, then))
            same = torch.equal(now_b, then_b)
            assert same == (slot not in touched), slot


@pytest.mark.parametrize("target", ["conv", "delta_rule"])
def test_fault_after_the_in_place_write_outside_a_transaction_changes_nothing(monkeypatch, target):
    """Outside a transaction each call is its own: an exception after the kernel wrote the pool (and
    before the call returns) rolls the rows back; digest() is unchanged."""
    state = make_state()
    a, b = state.new_sequence(), state.new_sequence()
    advance(state, a, 4, 1)
    advance(state, b, 2, 2)
    before = state.digest()
    module, name = ((gdn_state_mod.ple_ops, "ple_conv_slots") if target == "conv"
                    else (gdn_state_mod, "gated_delta_rule_slots"))
    real = getattr(module, name)
    wrote = {}

    def faulty(*args, **kwargs):
        pool = args[3] if target == "conv" else args[6]
        old = pool.clone()
        real(*args, **kwargs)
        wrote["changed"] = not torch.equal(pool, old)
        raise RuntimeError("injected after the write")

    x = torch.cat([seq_inputs(3, 5)[0], seq_inputs(1, 6)[0]])
    cu = cu_of([3, 1])
    hk, hv, dk, dv = HK, HV, DK, DV
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    monkeypatch.setattr(module, name, faulty)
    with pytest.raises(RuntimeError, match="injected after the write"):
        if target == "conv":
            state.conv(1, [a, b], x, cu)
        else:
            state.delta_rule(1, [a, b], cu, q.reshape(4, hk, dk), k.reshape(4, hk, dk), v.reshape(4, hv, dv),
                             -torch.rand(4, hv), torch.rand(4, hv))
    assert wrote["changed"]            # the kernel did write in place ...
    assert state.digest() == before    # ... and the rollback put every row back


def test_a_later_holders_commit_failure_undoes_the_published_step(monkeypatch):
    s1, s2 = make_state(), make_state(seed=1)
    a1, a2 = s1.new_sequence(), s2.new_sequence()
    d1, d2 = s1.digest(), s2.digest()

    def boom():
        raise RuntimeError("commit failed")

    monkeypatch.setattr(s2, "_txn_commit", boom)
    with pytest.raises(RuntimeError, match="commit failed"):
        with ht.transaction(s1, s2):
            for s, h in ((s1, a1), (s2, a2)):
                x, _, _ = seq_inputs(3, 1)
                s.conv(0, [h], x, cu_of([3]))
                s.delta_rule(1, [h], cu_of([3]), *[torch.randn(3, HK, DK)] * 2, torch.randn(3, HV, DV),
                             -torch.rand(3, HV), torch.rand(3, HV))
    assert (s1.digest(), s2.digest()) == (d1, d2)


# ----------------------------------------------------------------------------- validation
def test_bad_inputs_are_refused_and_change_nothing():
    state = make_state()
    a, b = state.new_sequence(), state.new_sequence()
    advance(state, a, 3, 1)
    before = state.digest()
    T = 3
    x = torch.randn(T, CONV_DIM)
    q, k, v = torch.randn(T, HK, DK), torch.randn(T, HK, DK), torch.randn(T, HV, DV)
    g, beta = -torch.rand(T, HV), torch.rand(T, HV)
    cu = cu_of([T])
    bad_calls = {
        "x shape": (lambda: state.conv(0, [a], x[:, :-1], cu), "x must be"),
        "x dtype wider": (lambda: state.conv(0, [a], x.double(), cu), "cannot hold"),
        "x device": (lambda: state.conv(0, [a], x.to("meta"), cu), "is on meta"),
        "weight shape": (lambda: state.conv(0, [a], x, cu, torch.randn(CONV_DIM, K + 1)), "weight must be"),
        "activation": (lambda: state.conv(0, [a], x, cu, activation="gelu"), "activation"),
        "layer": (lambda: state.conv(2, [a], x, cu), "layer 2 outside"),
        "duplicate": (lambda: state.conv(0, [a, a], x, cu_of([1, 2])), "appears twice"),
        "cu count": (lambda: state.conv(0, [a, b], x, cu), "entries for 2 sequences"),
        "cu dtype": (lambda: state.conv(0, [a], x, cu.long()), "int32"),
        "cu total": (lambda: state.conv(0, [a], x, cu_of([T - 1])), "rise from 0"),
        "cu decreasing": (lambda: state.conv(0, [a, b], x, torch.tensor([0, 3, 2], dtype=torch.int32)), "rise"),
        "q shape": (lambda: state.delta_rule(0, [a], cu, q[:, :1], k, v, g, beta), "q must be"),
        "v heads": (lambda: state.delta_rule(0, [a], cu, q, k, v[:, :2], g, beta), "v must be"),
        "g shape": (lambda: state.delta_rule(0, [a], cu, q, k, v, g[:, :1], beta), "g must be"),
        "beta tokens": (lambda: state.delta_rule(0, [a], cu, q, k, v, g, beta[:2]), "beta must be"),
        "q dtype": (lambda: state.delta_rule(0, [a], cu, q.double(), k.double(), v, g, beta), "float32, float16"),
        "qk dtypes": (lambda: state.delta_rule(0, [a], cu, q, k.half(), v, g, beta), "share a dtype"),
        "device": (lambda: state.delta_rule(0, [a], cu, q, k, v.to("meta"), g, beta), "is on meta"),
        "not a tensor": (lambda: state.delta_rule(0, [a], cu, q, k, v, g, [0.5]), "must be a Tensor"),
        "dup rows": (lambda: state.delta_rule(0, [b, b], cu_of([1, 2]), q, k, v, g, beta), "appears twice"),
        "layer dr": (lambda: state.delta_rule(-1, [a], cu, q, k, v, g, beta), "outside"),
    }
    for name, (call, match) in bad_calls.items():
        with pytest.raises(HebrusError, match=match):
            call()
        assert state.digest() == before, name
        assert not state.in_transaction
    # inside a transaction a refused call leaves the rest of the step as it was
    with ht.transaction(state):
        state.conv(0, [b], x, cu)
        staged = state.digest()
        with pytest.raises(HebrusError):
            state.conv(0, [a, a], x, cu_of([1, 2]))
        assert state.digest() == staged


def test_constructor_arguments_are_checked():
    with pytest.raises(HebrusError, match="multiple"):
        GDNState(1, num_key_heads=3, num_value_heads=4, key_head_dim=8, value_head_dim=8)
    with pytest.raises(HebrusError, match="dtype"):
        GDNState(1, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, dtype=torch.float64)
    with pytest.raises(HebrusError, match="conv_kernel_size"):
        GDNState(1, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel_size=1)
    with pytest.raises(HebrusError, match="activation"):
        GDNState(1, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, activation="relu")


# ----------------------------------------------------------------------------- saved state
def _repack(blob, edit_header=None, version=None):
    """A blob with its header edited (and a valid checksum again)."""
    prefix = struct.Struct("<8sIQ")
    magic, ver, hlen = prefix.unpack_from(blob)
    header = json.loads(blob[prefix.size:prefix.size + hlen])
    payload = blob[prefix.size + hlen:-32]
    if edit_header:
        edit_header(header)
    h = json.dumps(header, sort_keys=True).encode()
    body = prefix.pack(magic, ver if version is None else version, len(h)) + h + payload
    return body + hashlib.sha256(body).digest()


def test_save_restore_roundtrip_and_corrupt_blobs():
    state = make_state()
    a, b = state.new_sequence(), state.new_sequence()
    advance(state, a, 7, 1)
    data = state.save(a)
    assert isinstance(data, bytes) and b"pickle" not in data
    state.restore(b, data)
    assert state.digest(b) == state.digest(a)
    other = make_state(max_sequences=2, seed=5)            # another slot count, other weights: same config
    h = other.new_sequence()
    other.restore(h, data)
    assert other.digest(h) == state.digest(a)
    before = state.digest()

    def bad_dtype(hd):
        hd["tensors"][1]["dtype"] = "float16"
    corrupt = {
        "truncated": data[:len(data) // 2],
        "empty": b"",
        "flipped payload": data[:-40] + bytes([data[-40] ^ 1]) + data[-39:],
        "flipped header": data[:30] + bytes([data[30] ^ 4]) + data[31:],
        "flipped checksum": data[:-1] + bytes([data[-1] ^ 1]),
        "wrong version": _repack(data, version=blob_mod.FORMAT_VERSION + 1),
        "wrong kind": _repack(data, lambda hd: hd.update(kind="hebrus_torch.PLEState")),
        "other config": _repack(data, lambda hd: hd["meta"].update(value_heads=8)),
        "tensor dtype": _repack(data, bad_dtype),
        "extra bytes": data + b"x",
        "ple blob": make_ple_blob(),
    }
    for name, bad in corrupt.items():
        with pytest.raises(CorruptStateError):
            state.restore(b, bad)
        assert state.digest() == before, name
    with pytest.raises(StaleHandleError):
        state.restore(ht.SeqHandle(5, 0), data)


def make_ple_blob():
    ple = ht.PLEState(1, 4, vocab_size=10, eos_token_id=2, max_sequences=1)
    return ple.save(ple.new_sequence())


def test_save_includes_staged_state_and_blob_round_trips_inside_a_transaction():
    state = make_state()
    a, b = state.new_sequence(), state.new_sequence()
    with ht.transaction(state):
        x, _, _ = seq_inputs(3, 1)
        state.conv(0, [a], x, cu_of([3]))
        data = state.save(a)
        state.restore(b, data)
        assert state.digest(b) == state.digest(a)
    assert state.digest(b) == state.digest(a)


def test_state_dict_roundtrip_and_validation():
    state = make_state()
    a, b = state.new_sequence(), state.new_sequence()
    advance(state, a, 5, 1)
    advance(state, b, 2, 2)
    state.free(b)
    sd = state.state_dict()
    assert set(sd) == {"conv_state", "recurrent_state", "generation", "live", "_extra_state"}
    fresh = make_state()
    fresh.load_state_dict(sd)
    assert fresh.digest() == state.digest()
    assert fresh.slots.live_handles() == [a]
    advance(state, a, 1, 3)
    advance(fresh, a, 1, 3)
    assert fresh.digest() == state.digest()
    target = make_state()
    target.new_sequence()
    before = target.digest()
    tampered = dict(sd, recurrent_state=sd["recurrent_state"].clone())
    tampered["recurrent_state"][0, 0, 0, 0, 0] += 1
    wrong_shape = dict(sd, conv_state=sd["conv_state"][:, :3])
    missing = {k: v for k, v in sd.items() if k != "live"}
    bad_meta = dict(sd, _extra_state=dict(sd["_extra_state"], version=99))
    other_cfg = make_state(hv=8, dv=4).state_dict()
    for bad in (tampered, wrong_shape, missing, bad_meta, other_cfg, dict(sd, extra=torch.zeros(1)), [1, 2]):
        with pytest.raises(CorruptStateError):
            target.load_state_dict(bad)
        assert target.digest() == before
    result = target.load_state_dict(dict(sd, extra=torch.zeros(1)), strict=False)
    assert result.unexpected_keys == ["extra"] and target.digest() == make_state_loaded(sd).digest()
    with ht.transaction(state):
        with pytest.raises(HebrusError):
            state.state_dict()
        with pytest.raises(HebrusError):
            state.load_state_dict(sd)


def make_state_loaded(sd):
    state = make_state()
    state.load_state_dict(sd)
    return state


def test_state_dict_through_a_parent_module():
    parent = torch.nn.Module()
    parent.gdn = make_state()
    a = parent.gdn.new_sequence()
    advance(parent.gdn, a, 4, 1)
    sd = parent.state_dict()
    other = torch.nn.Module()
    other.gdn = make_state()
    other.load_state_dict(sd)
    assert other.gdn.digest() == parent.gdn.digest()


def test_to_keeps_the_recurrent_state_float32_and_refuses_bad_casts():
    state = make_state()
    a = state.new_sequence()
    advance(state, a, 4, 1)
    rec = state.recurrent_state.clone()
    state.to(torch.bfloat16)
    assert state.conv_state.dtype == torch.bfloat16 and state.recurrent_state.dtype == torch.float32
    assert torch.equal(state.recurrent_state, rec)
    assert state.state_dict()["recurrent_state"].dtype == torch.float32
    before = state.digest()
    with pytest.raises(HebrusError):
        state.double()
    assert state.digest() == before
    state.to("cpu")
    assert state.digest() == before
    with ht.transaction(state):
        with pytest.raises(HebrusError, match="inside a transaction"):
            state.to(torch.float32)


def test_steps_leave_other_slots_bitwise_unchanged():
    state = make_state()
    a, b, c = state.new_sequence(), state.new_sequence(), state.new_sequence()
    advance(state, c, 4, 9)
    before_c = state.snapshot(c)
    run_step(state, [b, a], [seq_inputs(5, 1), seq_inputs(2, 2)])
    after_c = state.snapshot(c)
    assert torch.equal(after_c.conv_tails, before_c.conv_tails) and torch.equal(after_c.recurrent, before_c.recurrent)
    assert state.digest(a) != state.digest(b)


@pytest.mark.hf
def test_gdn_forward_outside_a_transaction_is_atomic(monkeypatch):
    """A delta rule that raises after the conv staged its tails publishes neither."""
    hf = _hf()
    config, module = _tiny_gdn_module(hf)
    state = GDNState(1, num_key_heads=module.num_k_heads, num_value_heads=module.num_v_heads,
                     key_head_dim=module.head_k_dim, value_head_dim=module.head_v_dim, max_sequences=2)
    a = state.new_sequence()
    x = torch.randn(3, config.hidden_size)
    with torch.no_grad():
        gdn_forward(module, state, 0, [a], x, cu_of([3]))
    before = state.digest()

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(gdn_state_mod, "gated_delta_rule_slots", boom)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        gdn_forward(module, state, 0, [a], x, cu_of([3]))
    assert state.digest() == before
    other = hf.modeling.Qwen4ExpTextGatedDeltaNet(hf.tiny_indexer_config(linear_num_value_heads=4), 0)
    with pytest.raises(HebrusError, match="num_v_heads"):
        gdn_forward(other, state, 0, [a], x, cu_of([3]))
    assert state.digest() == before


def test_one_transaction_over_a_ple_state_and_a_gdn_state_rolls_both_back():
    ple = ht.PLEState(1, 8, vocab_size=20, eos_token_id=2, max_sequences=2,
                      conv_weights=[torch.randn(8, 4)])
    gdn = make_state(max_sequences=2)
    h = gdn.new_sequence()
    ple.new_sequence(h)
    before = (ple.digest(), gdn.digest())
    with pytest.raises(HebrusError):
        with ht.transaction(ple, gdn):
            run_step(gdn, [h], [seq_inputs(3, 1)], txn=False)
            ple.conv(0, [h], torch.randn(3, 8), cu_of([3]))
            ple.conv(0, [h], torch.randn(3, 9), cu_of([3]))        # refused: wrong channel count
    assert (ple.digest(), gdn.digest()) == before


def test_undo_buffers_are_reused_and_still_restore_bitwise():
    """A finished transaction's undo rows are reused by the next (no fresh allocation per decode step);
    a rollback of that next transaction still restores every row it overwrote."""
    state = make_state()
    a, b = state.new_sequence(), state.new_sequence()
    run_step(state, [a, b], [seq_inputs(1, 1), seq_inputs(1, 2)])
    first = {t.data_ptr() for t in sum(state._undo_spare.values(), [])}
    assert first and not state._undo_used
    run_step(state, [a, b], [seq_inputs(1, 3), seq_inputs(1, 4)])
    assert {t.data_ptr() for t in sum(state._undo_spare.values(), [])} == first   # the same buffers again
    before = state.digest()
    with pytest.raises(RuntimeError, match="abort"):
        with ht.transaction(state):
            run_step(state, [a, b], [seq_inputs(1, 5), seq_inputs(1, 6)], txn=False)
            run_step(state, [b, a], [seq_inputs(2, 7), seq_inputs(1, 8)], txn=False)   # more buffers than spares
            raise RuntimeError("abort")
    assert state.digest() == before


def test_step_pools_log_every_layer_once_and_a_rollback_restores_them():
    """GDNState.step_pools (the state of a model step's in-place native layers): outside a transaction there is
    none; inside one its two undo entries cover every layer's rows at the step's slots, so a step that wrote two
    layers in place and then failed is rolled back bitwise."""
    state = make_state(seed=3)
    seqs = [state.new_sequence() for _ in range(3)]
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        state.conv_state.copy_(torch.randn(state.conv_state.shape, generator=g))
        state.recurrent_state.copy_(torch.randn(state.recurrent_state.shape, generator=g))
    used, cu = [seqs[2], seqs[0]], cu_of([1, 1])
    assert state.step_pools(used, cu, 2, torch.float32) is None                   # no transaction
    before = state.digest()
    with pytest.raises(RuntimeError, match="after the writes"):
        with ht.transaction(state):
            pools = state.step_pools(used, cu, 2, torch.float32)
            assert pools is not None and len(state._undo) == 2
            for layer in range(LAYERS):
                conv, rec, index, _ = pools.layer_args(layer)
                conv.index_fill_(0, index.long(), 7.0)
                rec.index_fill_(0, index.long(), -7.0)
            assert state.digest() != before
            raise RuntimeError("a fault after the writes")
    assert state.digest() == before
    with ht.transaction(state):
        assert state.step_pools(used, cu, 2, torch.float16) is None               # tails not in x's dtype

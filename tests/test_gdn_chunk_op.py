"""hebrus::gdn_chunk_delta_rule_slots: the CPU kernel (csrc/cpu/gdn_chunk_kernels.cpp) against the reference
(hebrus_torch.gdn.chunked.chunk_delta_rule_reference), its recurrent pieces against gdn_delta_rule's CPU
kernel bitwise, and its bits under aligned cuts, other rows and thread counts."""

from __future__ import annotations

import pytest
import torch

from hebrus_torch import HebrusError, _extension, reference
from hebrus_torch.gdn.chunked import CHUNK, chunk_delta_rule_reference, chunk_gated_delta_rule_slots
from hebrus_torch.gdn.delta_rule import gated_delta_rule

pytestmark = pytest.mark.skipif(not _extension.has_native_kernel("gdn_chunk_delta_rule_slots", "cpu"),
                                reason="no CPU kernel built")


def make(T, hk=2, hv=4, dk=32, dv=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, hk, dk, generator=gen), torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    g = -torch.rand(T, hv, generator=gen) * 0.2
    beta = torch.rand(T, hv, generator=gen)
    return tuple(t.to(dtype) for t in (q, k, v, g, beta))


def i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def i64(xs):
    return torch.tensor(xs, dtype=torch.int64)


def run(inputs, lengths, starts, pool, slots, l2=True, scale=None):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return chunk_gated_delta_rule_slots(*inputs, i32(cu), i64(starts), pool, i32(slots), use_qk_l2norm=l2,
                                        scale=scale)


def ref(inputs, lengths, starts, pool, slots, l2=True, scale=None):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    scale = inputs[0].shape[-1] ** -0.5 if scale is None else scale
    return chunk_delta_rule_reference(*inputs, cu, starts, pool, slots, l2, scale)


TOL = {torch.float32: (3e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("hk,hv,dk,dv", [(8, 8, 128, 128), (4, 8, 128, 128), (2, 8, 128, 128), (2, 4, 31, 33),
                                         (1, 2, 32, 31), (3, 3, 33, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_parity_with_the_reference(hk, hv, dk, dv, dtype):
    lengths, starts = [200, 0, 130, 64, 3], [0, 5, 63, 64, 65]
    if dk == 128 and dtype != torch.float32:
        lengths, starts = [130, 0, 70], [1, 7, 64]
    inputs = make(sum(lengths), hk, hv, dk, dv, dtype, seed=dk + dv + hv)
    pool = torch.randn(7, hv, dk, dv) * 0.05
    slots = [6, 0, 2, 5, 3][:len(lengths)]
    got_pool, want_pool = pool.clone(), pool.clone()
    got = run(inputs, lengths, starts, got_pool, slots)
    want = ref(inputs, lengths, starts, want_pool, slots)
    assert got.dtype == dtype and got.shape == want.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got_pool, want_pool, atol=3e-5, rtol=1e-4)
    untouched = [s for s in range(7) if s not in slots or lengths[slots.index(s)] == 0]
    assert torch.equal(got_pool[untouched], pool[untouched])


@pytest.mark.parametrize("start,length", [(0, 10), (1, 62), (63, 1), (65, 60), (10, 54), (100, 20)])
def test_partial_chunks_are_gdn_delta_rule_bitwise(start, length):
    inputs = make(length, 2, 4, 33, 31, seed=start)
    pool = torch.randn(3, 4, 33, 31) * 0.1
    got_pool = pool.clone()
    out = run(inputs, [length], [start], got_pool, [2])
    want, new_state = gated_delta_rule(*inputs, i32([0, length]), pool[2:3].clone())
    assert torch.equal(out, want) and torch.equal(got_pool[2], new_state[0])


def test_pieces_around_whole_chunks_are_recurrent_and_whole_ones_are_not():
    inputs = make(300, seed=4)            # positions 10..309: 54 recurrent, 4 whole chunks, 54 recurrent
    pool = torch.randn(1, 4, 32, 24) * 0.1
    got_pool = pool.clone()
    out = run(inputs, [300], [10], got_pool, [0])
    rec, rec_state = gated_delta_rule(*inputs, i32([0, 300]), pool.clone())
    assert torch.equal(out[:54], rec[:54])
    assert not torch.equal(out[54:118], rec[54:118])
    torch.testing.assert_close(out, rec, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(got_pool, rec_state, atol=3e-5, rtol=1e-4)
    # The trailing partial chunk is gdn_delta_rule from the state the whole chunks left.
    mid_pool = pool.clone()
    run(tuple(t[:246] for t in inputs), [246], [10], mid_pool, [0])
    tail, _ = gated_delta_rule(*(t[246:] for t in inputs), i32([0, 54]), mid_pool.clone())
    assert torch.equal(out[246:], tail)


def test_aligned_cuts_other_rows_and_threads_do_not_change_bits():
    inputs = make(400, 4, 8, 128, 128, seed=5)
    pool = torch.randn(4, 8, 128, 128) * 0.05
    whole_pool = pool.clone()
    whole = run(inputs, [400], [30], whole_pool, [1])
    cut_pool = pool.clone()
    cuts = [0, 34, 98, 226, 290, 400]       # absolute 64, 128, 256, 320
    parts = [run(tuple(t[a:b] for t in inputs), [b - a], [30 + a], cut_pool, [1]) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(parts), whole) and torch.equal(cut_pool, whole_pool)
    other = make(150, 4, 8, 128, 128, seed=6)
    mixed_pool = pool.clone()
    both = run(tuple(torch.cat([a, b]) for a, b in zip(other, inputs)), [150, 400], [64, 30], mixed_pool, [3, 1])
    assert torch.equal(both[150:], whole) and torch.equal(mixed_pool[1], whole_pool[1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_pool = pool.clone()
        one = run(inputs, [400], [30], one_pool, [1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole) and torch.equal(one_pool, whole_pool)


def test_no_l2norm_and_explicit_scale():
    inputs = make(128, 2, 2, 16, 16, seed=7)
    q, k = inputs[0] * 0.2, inputs[1] * 0.2
    inputs = (q, k) + inputs[2:]
    a, b = torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16)
    got = run(inputs, [128], [0], a, [0], l2=False, scale=0.5)
    want = ref(inputs, [128], [0], b, [0], l2=False, scale=0.5)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(a, b, atol=3e-5, rtol=1e-4)


def test_empty_batch_and_zero_tokens():
    inputs = make(0)
    pool = torch.randn(2, 4, 32, 24)
    before = pool.clone()
    assert run(inputs, [], [], pool, []).shape == (0, 4, 24)
    assert run(inputs, [0, 0], [3, 64], pool, [1, 0]).shape == (0, 4, 24)
    assert torch.equal(pool, before)


BAD = [
    (dict(slots=[1, 1]), "slot 1 appears twice in one batch (rows 0 and 1); each row updates its slot in place"),
    (dict(slots=[0, 5]), "slots[1] = 5 is outside [0, S=3)"),
    (dict(starts=[0, -1]), "start_pos[1] = -1 is negative"),
    (dict(start_dtype=torch.int32), "start_pos must have dtype torch.int64, got torch.int32"),
    (dict(starts=[0]), "start_pos must have one entry per row (B = 2), got 1"),
    (dict(cu=[0, 80, 99]), "cu_seqlens must start at 0 and end at T = 100, got 0 .. 99"),
    (dict(pool_shape=(3, 4, 32, 25)), "state_pool must have shape (S, Hv, Dk, Dv) = (S, 4, 32, 24), got (3, 4, 32, 25)"),
    (dict(pool_dtype=torch.float16), "state_pool must have dtype torch.float32, got torch.float16"),
]


@pytest.mark.parametrize("bad,message", BAD)
@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_bad_input_raises_and_writes_nothing(bad, message, impl):
    q, k, v, g, beta = make(100)
    pool = torch.randn(*bad.get("pool_shape", (3, 4, 32, 24))).to(bad.get("pool_dtype", torch.float32))
    before = pool.clone()
    args = (q, k, v, g, beta, i32(bad.get("cu", [0, 80, 100])),
            torch.tensor(bad.get("starts", [0, 64]), dtype=bad.get("start_dtype", torch.int64)), pool,
            i32(bad.get("slots", [0, 2])), 32 ** -0.5, True)
    fn = torch.ops.hebrus.gdn_chunk_delta_rule_slots.default if impl == "cpu" else reference.gdn_chunk_delta_rule_slots
    from hebrus_torch.errors import translated
    with pytest.raises(HebrusError) as err, translated():
        fn(*args)
    assert str(err.value) == f"hebrus::gdn_chunk_delta_rule_slots: {message}"
    assert torch.equal(pool, before)


def test_opcheck():
    q, k, v, g, beta = make(140, 2, 4, 16, 16, seed=8)
    pool = torch.randn(3, 4, 16, 16) * 0.1
    torch.library.opcheck(torch.ops.hebrus.gdn_chunk_delta_rule_slots.default,
                          (q, k, v, g, beta, i32([0, 70, 140]), i64([0, 60]), pool, i32([2, 0]), 0.25, True))


def test_gdn_state_runs_rows_with_a_start_chunked_and_the_others_recurrently():
    from hebrus_torch.gdn import GDNState

    state = GDNState(1, num_key_heads=2, num_value_heads=4, key_head_dim=32, value_head_dim=24, conv_kernel_size=4,
                     max_sequences=4)
    seqs = [state.new_sequence() for _ in range(3)]
    pool = state.recurrent_state[0]
    pool.copy_(torch.randn_like(pool) * 0.1)
    before = pool.clone()
    lengths, starts = [200, 130, 70], [64, None, 0]
    inputs = make(sum(lengths), seed=9)
    cu = i32([0, 200, 330, 400])
    out = state.delta_rule(0, seqs, cu, *inputs, start_pos=starts)
    slots = [s.slot for s in seqs]
    want_pool = before.clone()
    parts = [(0, 200, 64), (330, 400, 0)]
    for (a, b, p), slot in zip(parts, (slots[0], slots[2])):
        got = run(tuple(t[a:b] for t in inputs), [b - a], [p], want_pool, [slot])
        assert torch.equal(out[a:b], got)
    rec, new = gated_delta_rule(*(t[200:330] for t in inputs), i32([0, 130]), before[slots[1]][None].clone())
    assert torch.equal(out[200:330], rec) and torch.equal(pool[slots[1]], new[0])
    assert torch.equal(pool[[slots[0], slots[2]]], want_pool[[slots[0], slots[2]]])
    # All None: the recurrent op, as without start_pos.
    pool.copy_(before)
    none = state.delta_rule(0, seqs, cu, *inputs, start_pos=[None, None, None])
    pool.copy_(before)
    assert torch.equal(none, state.delta_rule(0, seqs, cu, *inputs))


# The AVX-512, AVX2 and portable tile products give the same bits. Each capability runs in a subprocess,
# because HEBRUS_CPU_CAPABILITY is read once per process.
_CAPABILITY_SCRIPT = """
import sys, torch, hebrus_torch
from hebrus_torch.gdn.chunked import chunk_gated_delta_rule_slots
gen = torch.Generator().manual_seed(3)
outs = {}
for hk, hv, dk, dv, lengths, starts in [(2, 4, 128, 128, [200, 64], [10, 64]), (1, 2, 33, 31, [130, 0, 66], [0, 5, 63]),
                                        (3, 3, 17, 40, [128], [64])]:
    T = sum(lengths)
    q, k = torch.randn(T, hk, dk, generator=gen), torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    g, beta = -torch.rand(T, hv, generator=gen) * 0.3, torch.rand(T, hv, generator=gen)
    pool = torch.randn(len(lengths) + 1, hv, dk, dv, generator=gen) * 0.1
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    slots = torch.arange(len(lengths), 0, -1, dtype=torch.int32)
    key = f"{hk} {hv} {dk} {dv}"
    outs[key + " out"] = chunk_gated_delta_rule_slots(q, k, v, g, beta, cu, torch.tensor(starts), pool, slots)
    outs[key + " pool"] = pool
torch.save(outs, sys.argv[1])
"""


def test_every_cpu_capability_gives_the_same_bits(tmp_path):
    import os
    import subprocess
    import sys

    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        pass
    capabilities = ["default"] + (["avx2"] if {"avx2", "fma", "f16c"} <= flags else []) + (
        ["avx512"] if "avx512f" in flags else [])
    results = {}
    for capability in capabilities:
        env = {k: v for k, v in os.environ.items() if k != "HEBRUS_CPU_CAPABILITY"}
        env["HEBRUS_CPU_CAPABILITY"] = capability
        out = tmp_path / f"{capability}.pt"
        done = subprocess.run([sys.executable, "-c", _CAPABILITY_SCRIPT, str(out)], env=env, capture_output=True,
                              text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert done.returncode == 0, done.stderr[-4000:]
        results[capability] = torch.load(out)
    for capability, outs in results.items():
        for key, got in outs.items():
            assert torch.equal(got.view(torch.int32), results["default"][key].view(torch.int32)), (capability, key)

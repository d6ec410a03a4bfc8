"""mps_kernels/gdn_delta_rule.metal run in the emulator with the glue's launches, against the CPU kernels.

Both ops (hebrus::gdn_delta_rule, its state updated in place; hebrus::gdn_delta_rule_slots, the pool
updated in place at the slots; the glue marks them ``in_place``: bound as the caller's tensor, not
poisoned, guard-paged like every buffer). Parity with the CPU kernel at Qwen's head sizes (Dk = Dv =
128, Hv/Hk = 2 and 4, several rows, fp32/fp16/bf16 with per-dtype tolerances: the sums over Dk run in
another order, simd_sum's tree drawn at random per call site) and at small odd sizes (31/32/33), with
and without the qk l2norm, mixed dtypes; bitwise batch invariance and chunk invariance (one shot vs
1/2/1 vs random cuts, rows longer than a token tile); rows of 0 tokens; the slot form bitwise the
plain form on the gathered states, untouched pool rows bitwise kept; the same bits under every fiber
schedule, guard side and FMA contraction; bad cu_seqlens and slots reported through the error buffer
with the CPU kernel's messages, nothing of the bad row written; B == 0 through the check kernels;
Dk > 256 refused on the host.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
import msl_emu  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402
from hebrus_torch.gdn import gated_delta_rule_slots  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Output tolerance per dtype (the output is rounded to it); the fp32 state differs by summation order only.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
STATE_TOL = 2e-5
SCALE = 0.125


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def make(lengths, hk, hv, dk, dv, dtype=torch.float32, pool_slots=None, seed=0):
    """Inputs of the slot form: q, k, v, g, beta, cu_seqlens, a random pool and distinct random slots
    that use the pool's first and last rows (an off-by-one row there reaches a guard page)."""
    gen = torch.Generator().manual_seed(seed)
    T, B = sum(lengths), len(lengths)
    pool_slots = pool_slots or B + 3
    inner = (torch.randperm(pool_slots - 2, generator=gen) + 1).tolist()
    slots = torch.tensor([0, pool_slots - 1, *inner][:B], dtype=torch.int32)
    return dict(
        q=torch.randn(T, hk, dk, generator=gen).to(dtype),
        k=torch.randn(T, hk, dk, generator=gen).to(dtype),
        v=torch.randn(T, hv, dv, generator=gen).to(dtype),
        g=(-torch.rand(T, hv, generator=gen) * 0.5).to(dtype),
        beta=torch.rand(T, hv, generator=gen).to(dtype),
        cu_seqlens=cu_of(lengths),
        state_pool=torch.randn(pool_slots, hv, dk, dv, generator=gen) * 0.3,
        slots=slots[torch.randperm(B, generator=gen)],
    )


def emu_slots(a, l2=True, **kw):
    pool = a["state_pool"].clone()
    out = hebrus_emu.gdn_delta_rule_slots(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], pool,
                                          a["slots"], SCALE, l2, **kw)
    return out, pool


def cpu_slots(a, l2=True):
    pool = a["state_pool"].clone()
    out = gated_delta_rule_slots(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], pool, a["slots"],
                                 use_qk_l2norm=l2, scale=SCALE)
    return out, pool


def emu_plain(a, state, l2=True, **kw):
    state = state.clone()
    out = hebrus_emu.gdn_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], state, SCALE, l2,
                                    **kw)
    return out, state


def assert_close(got, want, dtype):
    """Per-dtype tolerances, absolute ones scaled by the tensor's magnitude (without the l2norm the states
    grow to tens, and entries near 0 come out of cancelling sums)."""
    for a, b, tol in ((got[0].float(), want[0].float(), TOL[dtype]), (got[1], want[1], STATE_TOL)):
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        torch.testing.assert_close(a, b, atol=tol * scale, rtol=tol)


def assert_matches(a, l2=True, **kw):
    """The slot form against the CPU kernel (tolerance), untouched pool rows bitwise, and the plain form
    on the gathered states bitwise the slot form (one kernel body)."""
    got = emu_slots(a, l2, **kw)
    assert got[0].dtype == a["v"].dtype
    assert_close(got, cpu_slots(a, l2), a["v"].dtype)
    named = set(a["slots"].tolist())
    for s in range(a["state_pool"].shape[0]):
        if s not in named:
            assert torch.equal(got[1][s], a["state_pool"][s]), s
    idx = a["slots"].long()
    plain = emu_plain(a, a["state_pool"].index_select(0, idx), l2, **kw)
    assert torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[1].index_select(0, idx))
    return got


# ---- parity with the CPU kernel ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv", [(2, 4), (1, 4)])
def test_matches_cpu_at_qwen_head_sizes(dtype, hk, hv):
    # Dk = Dv = 128, GQA repeat 2 and 4, rows longer than a token tile, an empty row, a decode row.
    a = make([3, 0, 10, 1], hk, hv, 128, 128, dtype, seed=hk * 10 + hv)
    assert_matches(a)


@pytest.mark.parametrize("dk,dv", [(31, 33), (32, 32), (33, 31), (1, 1), (64, 17), (65, 5)])
@pytest.mark.parametrize("l2", [True, False])
def test_matches_cpu_at_odd_sizes(dk, dv, l2):
    a = make([2, 5, 0, 9], 3, 6, dk, dv, torch.float32, seed=dk + dv)
    assert_matches(a, l2)


def test_key_dim_256_runs_the_k256_variant():
    a = make([3, 1], 1, 2, 256, 20, torch.bfloat16, seed=4)
    (launch,) = hebrus_emu.launches("gdn_delta_rule_slots", *a.values(), SCALE, True)
    assert launch["kernel"] == "gdn_delta_rule_slots_k256_bfloat"
    assert_matches(a)


def test_mixed_dtypes_run_the_fp32_kernel():
    a = make([4, 2], 2, 4, 16, 8, torch.float16, seed=5)
    a["v"] = a["v"].float()
    a["beta"] = a["beta"].to(torch.bfloat16)
    (launch,) = hebrus_emu.launches("gdn_delta_rule_slots", *a.values(), SCALE, True)
    assert launch["kernel"] == "gdn_delta_rule_slots_k32_float"
    got = emu_slots(a)
    assert got[0].dtype == torch.float32
    assert_close(got, cpu_slots(a), torch.float32)
    a["v"] = a["v"].to(torch.bfloat16)  # fp32 kernel output narrowed once to v's dtype, as on CPU
    got = emu_slots(a)
    assert got[0].dtype == torch.bfloat16
    assert_close(got, cpu_slots(a), torch.bfloat16)


def test_plain_op_matches_cpu_and_updates_its_state_in_place():
    a = make([6, 0, 3], 2, 4, 40, 24, torch.float32, seed=6)
    state = a["state_pool"][:3].clone()
    (launch,) = hebrus_emu.launches("gdn_delta_rule", a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"],
                                    state, SCALE, True)
    assert launch["kernel"] == "gdn_delta_rule_k64_float"
    assert launch["in_place"] == [False] * 6 + [True, False]
    assert launch["tensors"][6].data_ptr() == state.data_ptr()
    got = emu_plain(a, state)
    want_state = state.clone()
    want = torch.ops.hebrus.gdn_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], want_state,
                                           SCALE, True)
    assert_close(got, (want, want_state), torch.float32)
    assert torch.equal(got[1][1], state[1])  # the row of 0 tokens passes its state through bitwise


def test_launch_of_the_slot_form():
    a = make([3, 2], 2, 4, 128, 40, torch.half)
    (launch,) = hebrus_emu.launches("gdn_delta_rule_slots", *a.values(), SCALE, True)
    assert (launch["stem"], launch["kernel"]) == ("gdn_delta_rule", "gdn_delta_rule_slots_k128_half")
    assert launch["written"] == [False] * 6 + [True, False, True]
    assert launch["in_place"] == [False] * 6 + [True, False, False]
    assert launch["tensors"][6].data_ptr() == a["state_pool"].data_ptr()  # the pool itself, never a copy
    assert (launch["error_index"], launch["params_index"]) == (9, 10)
    assert (launch["threads"], launch["group"]) == (2 * 4 * 3 * 128, 128)  # B * Hv * ceil(40 / 16) groups


# ---- invariances ------------------------------------------------------------------------------------

def run_chunks(rows, pool, slots, cuts, **kw):
    """Feed every row's token stream (dict of per-row tensors) in chunks cut at `cuts`, the pool carrying
    the states. Returns the per-row outputs and the pool."""
    pool = pool.clone()
    n_max = max(r["q"].shape[0] for r in rows)
    outs = [[] for _ in rows]
    bounds = [0, *cuts, n_max]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        parts = [{name: t[lo:hi] for name, t in r.items()} for r in rows]
        lengths = [p["q"].shape[0] for p in parts]
        cat = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
        out = hebrus_emu.gdn_delta_rule_slots(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], cu_of(lengths),
                                              pool, slots, SCALE, True, **kw)
        for i, chunk in enumerate(torch.split(out, lengths)):
            outs[i].append(chunk)
    return [torch.cat(o) for o in outs], pool


def streams(lengths, hk, hv, dk, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [dict(q=torch.randn(n, hk, dk, generator=gen).to(dtype), k=torch.randn(n, hk, dk, generator=gen).to(dtype),
                 v=torch.randn(n, hv, dv, generator=gen).to(dtype),
                 g=(-torch.rand(n, hv, generator=gen) * 0.5).to(dtype), beta=torch.rand(n, hv, generator=gen).to(dtype))
            for n in lengths]


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_invariance_bitwise(dtype):
    rows = streams([19, 4, 0, 11], 2, 4, 33, 20, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    pool = torch.randn(6, 4, 33, 20, generator=gen) * 0.3
    slots = torch.tensor([5, 0, 2, 3], dtype=torch.int32)
    one = run_chunks(rows, pool, slots, [])
    small = run_chunks(rows, pool, slots, [1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18])  # 1/2/1/2/... tokens
    cuts = sorted(torch.randperm(18, generator=gen)[:4].add(1).tolist())
    rand = run_chunks(rows, pool, slots, cuts, sched="random", seed=3)
    for other in (small, rand):
        assert all(torch.equal(x, y) for x, y in zip(one[0], other[0]))
        assert torch.equal(one[1], other[1])


def test_batch_invariance_bitwise():
    # A row's bits do not depend on the other rows of the launch, their order or their number.
    rows = streams([9, 3, 12, 1], 2, 4, 128, 128, torch.bfloat16, seed=9)
    gen = torch.Generator().manual_seed(10)
    pool = torch.randn(5, 4, 128, 128, generator=gen) * 0.3
    together = run_chunks(rows, pool, torch.tensor([1, 4, 0, 3], dtype=torch.int32), [])
    for i, slot in enumerate([1, 4, 0, 3]):
        alone = run_chunks([rows[i]], pool, torch.tensor([slot], dtype=torch.int32), [])
        assert torch.equal(alone[0][0], together[0][i])
        assert torch.equal(alone[1][slot], together[1][slot])
    swapped = run_chunks([rows[2], rows[0]], pool, torch.tensor([0, 1], dtype=torch.int32), [])
    assert torch.equal(swapped[0][0], together[0][2]) and torch.equal(swapped[0][1], together[0][0])


def test_rows_of_zero_tokens_keep_their_state_bitwise():
    a = make([0, 4, 0], 1, 2, 32, 16, torch.float32, seed=11)
    a["state_pool"][int(a["slots"][0])] = float("nan")  # odd bits: compared as bytes
    got = emu_slots(a)[1]
    for r in (0, 2):
        s = int(a["slots"][r])
        assert torch.equal(got[s].view(torch.int32), a["state_pool"][s].view(torch.int32))
    a = make([0, 0], 2, 4, 16, 16, torch.float32, seed=12)  # T == 0, B == 2: the kernel runs, writes nothing
    out, got = emu_slots(a)
    assert out.shape == (0, 4, 16) and torch.equal(got, a["state_pool"])


@pytest.mark.parametrize("sched,guard", [("reverse", "end"), ("random", "start"), ("random", "end")])
def test_schedules_guards_and_contraction_agree(sched, guard):
    a = make([9, 0, 3, 1], 2, 4, 33, 31, torch.float16, seed=13)
    base = emu_slots(a)
    other = emu_slots(a, sched=sched, seed=17, guard=guard)
    assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])
    if sched == "reverse":  # contraction pinned off: a -ffp-contract=fast build gives the same bits
        b = {k: (v.float() if v.is_floating_point() else v) for k, v in a.items()}
        x = emu_slots(b)
        y = emu_slots(b, contract="fast")
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_simd_reduction_order_changes_bits_but_not_parity():
    # The emulator's simd_sum tree is drawn per call site from simd_seed: another seed (another GPU's
    # fixed order) gives other fp32 bits within the tolerance, while every run with one seed agrees.
    a = make([12, 5], 2, 4, 128, 32, torch.float32, seed=14)
    runs = {seed: emu_slots(a, simd_seed=seed) for seed in (0, 1, 2)}
    assert torch.equal(emu_slots(a, simd_seed=2)[1], runs[2][1])
    assert not all(torch.equal(runs[0][1], runs[s][1]) for s in (1, 2))
    for r in runs.values():
        assert_close(r, cpu_slots(a), torch.float32)


# ---- value errors through the error buffer ------------------------------------------------------------

def both_raise(a):
    """The emulator's error (at synchronization) and the CPU kernel's; returns the emulated pool."""
    got = a["state_pool"].clone()
    with pytest.raises(hebrus_emu.ASYNC_ERROR) as emu_err:
        hebrus_emu.gdn_delta_rule_slots(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], got, a["slots"],
                                        SCALE, True)
    with pytest.raises(HebrusError) as cpu_err:
        cpu_slots(a)
    assert str(cpu_err.value) in hebrus_emu.reported(), (str(cpu_err.value), hebrus_emu.reported())
    return str(emu_err.value), str(cpu_err.value), got


@pytest.mark.parametrize("bad,value", [(2, -1), (0, 6), (3, 1 << 30)])
def test_slot_out_of_range_is_reported_and_its_row_writes_nothing(bad, value):
    a = make([2, 1, 0, 3], 1, 2, 16, 8, pool_slots=6)
    a["slots"][bad] = value
    emu_msg, cpu_msg, got = both_raise(a)
    assert emu_msg == cpu_msg == f"hebrus::gdn_delta_rule_slots: slots[{bad}] = {value} is outside [0, S=6)"
    for r, s in enumerate(a["slots"].tolist()):  # the other rows still ran
        if r != bad and a["cu_seqlens"][r + 1] > a["cu_seqlens"][r]:
            assert not torch.equal(got[s], a["state_pool"][s])


@pytest.mark.parametrize("rows", [(0, 2), (1, 3), (0, 1, 3)])
def test_duplicate_slot_is_reported_and_no_row_of_it_writes(rows):
    a = make([2, 1, 4, 3], 1, 2, 16, 8, pool_slots=7, seed=2)
    a["slots"][list(rows)] = int(a["slots"][rows[0]])
    emu_msg, cpu_msg, got = both_raise(a)
    shared = int(a["slots"][rows[0]])
    assert cpu_msg == (f"hebrus::gdn_delta_rule_slots: slot {shared} appears twice in one batch "
                       f"(rows {rows[0]} and {rows[1]}); each row updates its slot in place")
    assert emu_msg == cpu_msg or len(rows) > 2  # three rows: which report comes first is the GPU's timing
    assert torch.equal(got[shared], a["state_pool"][shared])


@pytest.mark.parametrize("bad", [[0, 3, 2, 6], [1, 3, 4, 6], [0, 2, 4, 5]])
def test_bad_cu_seqlens_are_reported(bad):
    a = make([2, 2, 2], 1, 2, 16, 8)
    a["cu_seqlens"] = torch.tensor(bad, dtype=torch.int32)
    emu_msg, cpu_msg, got = both_raise(a)
    assert emu_msg == cpu_msg
    for r in range(3):  # a row whose own entries are bad writes nothing
        lo, hi = bad[r], bad[r + 1]
        if (r == 0 and lo != 0) or lo > hi or (r == 2 and hi != 6):
            s = int(a["slots"][r])
            assert torch.equal(got[s], a["state_pool"][s])


def test_bad_cu_seqlens_of_the_plain_op_are_reported_and_nothing_written():
    a = make([2, 2, 2], 1, 2, 16, 8)
    a["cu_seqlens"] = torch.tensor([0, 3, 2, 6], dtype=torch.int32)
    state = a["state_pool"][:3].clone()
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=r"hebrus::gdn_delta_rule: cu_seqlens must be non-decreasing; "
                                                     r"row 1 has cu_seqlens\[1\] = 3 > cu_seqlens\[2\] = 2"):
        hebrus_emu.gdn_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], state, SCALE, True)
    assert torch.equal(state[1], a["state_pool"][1])


def test_empty_batches_launch_the_check_kernels():
    a = make([], 1, 2, 16, 8, pool_slots=3)
    (launch,) = hebrus_emu.launches("gdn_delta_rule_slots", *a.values(), SCALE, True)
    assert (launch["stem"], launch["kernel"], launch["threads"]) == ("gdn_delta_rule", "gdn_delta_rule_slots_check", 1)
    assert emu_slots(a)[0].shape == (0, 2, 8)
    state = torch.zeros(0, 2, 16, 8)
    (launch,) = hebrus_emu.launches("gdn_delta_rule", *list(a.values())[:6], state, SCALE, True)
    assert (launch["stem"], launch["kernel"], launch["threads"]) == ("gdn_delta_rule", "gdn_delta_rule_check_cu", 1)
    a["cu_seqlens"] = torch.tensor([4], dtype=torch.int32)
    emu_msg, cpu_msg, _ = both_raise(a)
    assert emu_msg == cpu_msg


def test_key_dims_over_256_are_refused_on_the_host():
    a = make([2], 1, 1, 257, 4)
    with pytest.raises(HebrusError, match=r"hebrus::gdn_delta_rule_slots on MPS: the Metal kernel takes key head "
                                          r"dims up to 256 \(Dk <= 256\)"):
        hebrus_emu.launches("gdn_delta_rule_slots", *a.values(), SCALE, True)
    assert hebrus_emu.launches("gdn_delta_rule_slots", *make([2], 1, 1, 4, 300).values(), SCALE, True)


def test_metadata_errors_come_from_the_glue():
    a = make([2], 1, 2, 16, 8)
    a["slots"] = a["slots"].long()
    with pytest.raises(HebrusError, match=r"hebrus::gdn_delta_rule_slots: slots must have dtype torch.int32"):
        hebrus_emu.launches("gdn_delta_rule_slots", *a.values(), SCALE, True)


def test_kernels_present():
    types, variants = ("float", "half", "bfloat"), ("k32", "k64", "k128", "k256")
    want = {f"{op}_{v}_{t}" for op in ("gdn_delta_rule", "gdn_delta_rule_slots") for v in variants for t in types}
    assert set(hebrus_emu.module("gdn_delta_rule").kernels) == want | {"gdn_delta_rule_check_cu",
                                                                       "gdn_delta_rule_slots_check"}
    no_bf16 = msl_emu.translate(os.path.join(msl_emu.KERNEL_DIR, "gdn_delta_rule.metal"), defines={})[1]
    assert not any(name.endswith("_bfloat") for name in no_bf16) and len(no_bf16) == len(want) // 3 * 2 + 2
    assert hebrus_emu.module("gdn_delta_rule").limits["gdn_delta_rule_slots_k128_float"] == 128

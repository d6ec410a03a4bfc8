"""mps_kernels/gdn_chunk_delta_rule.metal run in the emulator with the glue's launches, against the spec.

hebrus::gdn_chunk_delta_rule_slots against ``hebrus_torch.gdn.chunked.chunk_delta_rule_reference``:
Dk = Dv = 128 with Hv / Hk = 2 (float32), small odd sizes (Dk, Dv not multiples of 8, a partial
block of value columns) in every dtype, g and beta in float32 with 16-bit q, k, v, mixed dtypes as
the CPU op takes them (run in fp32), start positions
0 / 1 / 63 / 64 / 65 and rows of 0 tokens; the pool's rows not named by the slots bitwise
untouched; the same bits under every fiber schedule and both guard sides, with FMA contraction and
with clang, and within tolerance under other orders of the tile products (simd_seed); bitwise
invariance under cuts at multiples of 64 and under other rows in the batch; bad cu_seqlens, start_pos and slots raised at synchronization with
nothing written for the faulty rows; metadata errors before any launch. The emulator's runtime
grows with Dk * Dv * chunks: the shapes are kept to a few chunks.
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
from hebrus_torch.gdn.chunked import chunk_delta_rule_reference  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

# Output tolerance per dtype (relative to the largest output, absolute on each element); the state is fp32.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make(lengths, starts, hk=1, hv=2, dk=16, dv=8, dtype=torch.float32, gdtype=None, pool_slots=None, seed=0):
    """Inputs of one call: random q, k, v, gates g <= 0, beta in (0, 1), a random pool and distinct
    slots using the pool's first and last rows (an off-by-one row there reaches a guard page)."""
    gen = torch.Generator().manual_seed(seed)
    T, B = sum(lengths), len(lengths)
    gdtype = gdtype or dtype
    q = torch.randn(T, hk, dk, generator=gen).to(dtype)
    k = torch.randn(T, hk, dk, generator=gen).to(dtype)
    v = torch.randn(T, hv, dv, generator=gen).to(dtype)
    g = (-torch.rand(T, hv, generator=gen) * 0.3).to(gdtype)
    beta = torch.rand(T, hv, generator=gen).to(gdtype)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    S = pool_slots or B + 2
    pool = torch.randn(S, hv, dk, dv, generator=gen) * 0.2
    inner = (torch.randperm(S - 2, generator=gen) + 1).tolist() if S > 2 else []
    slots = torch.tensor([0, S - 1, *inner][:B], dtype=torch.int32)
    slots = slots[torch.randperm(B, generator=gen)]
    return q, k, v, g, beta, cu, torch.tensor(starts, dtype=torch.int64), pool, slots


def emu(q, k, v, g, beta, cu, start_pos, pool, slots, l2norm=True, **kw):
    pool = pool.clone()
    out = hebrus_emu.gdn_chunk_delta_rule_slots(q, k, v, g, beta, cu, start_pos, pool, slots, q.shape[2] ** -0.5,
                                                l2norm, **kw)
    return out, pool


def ref(q, k, v, g, beta, cu, start_pos, pool, slots, l2norm=True):
    pool = pool.clone()
    out = chunk_delta_rule_reference(q, k, v, g, beta, cu.tolist(), start_pos.tolist(), pool, slots.tolist(), l2norm,
                                     q.shape[2] ** -0.5)
    return out, pool


def assert_matches(args, l2norm=True, **kw):
    out, pool = emu(*args, l2norm=l2norm, **kw)
    want, want_pool = ref(*args, l2norm=l2norm)
    dtype = args[2].dtype
    tol = TOL[dtype] * max(1.0, float(want.float().abs().max()))
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=tol)
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=1e-5 * max(1.0, float(want_pool.abs().max())))
    named = set(args[8].tolist())
    for s in range(pool.shape[0]):
        if s not in named:
            assert torch.equal(pool[s], args[7][s])  # rows not named: bitwise untouched
    return out, pool


def test_matches_reference_dk128_dv128_gqa():
    # Hv / Hk = 2; one row of two whole chunks and a partial tail, one starting mid-chunk (a recurrent
    # head piece, then a whole chunk).
    args = make([130, 70], [0, 57], hk=1, hv=2, dk=128, dv=128, seed=1)
    assert_matches(args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference_small_odd_sizes(dtype):
    # starts 0 / 1 / 63 / 64 / 65, rows of 0 tokens, Dk = 20 and Dv = 37 (two blocks, the second partial)
    args = make([70, 0, 64, 66, 5, 130, 0], [1, 9, 64, 63, 65, 0, 0], hk=2, hv=4, dk=20, dv=37, dtype=dtype, seed=2)
    assert_matches(args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_gates_with_16_bit_inputs(dtype):
    args = make([64, 3], [128, 5], dk=12, dv=8, dtype=dtype, gdtype=torch.float32, seed=3)
    (launch,) = hebrus_emu.launches("gdn_chunk_delta_rule_slots", *args, 0.5, True)
    assert launch["kernel"].startswith("gdn_chunk_delta_rule_slots_gf32_")
    assert_matches(args)


@pytest.mark.parametrize("qdtype,vdtype,gdtype,bdtype", [
    (torch.float32, torch.bfloat16, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float16, torch.float32),
    (torch.float16, torch.float32, torch.bfloat16, torch.bfloat16),
])
def test_mixed_dtypes_run_in_fp32(qdtype, vdtype, gdtype, bdtype):
    # What the CPU op accepts: v's dtype apart from q's (the kernel then runs in fp32 and the output is
    # narrowed to v's dtype), g and beta of any float dtypes (widened to fp32, variant gf32).
    q, k, v, g, beta, cu, sp, pool, slots = make([66, 4], [0, 62], dk=12, dv=8, seed=13)
    args = (q.to(qdtype), k.to(qdtype), v.to(vdtype), g.to(gdtype), beta.to(bdtype), cu, sp, pool, slots)
    (launch,) = hebrus_emu.launches("gdn_chunk_delta_rule_slots", *args, 0.5, True)
    kt = qdtype if qdtype == vdtype else torch.float32
    assert launch["kernel"] == hebrus_emu.kernel_name("gdn_chunk_delta_rule_slots",
                                                      "" if gdtype == bdtype == kt or kt == torch.float32 else "gf32",
                                                      kt)
    out, new_pool = emu(*args)
    want, want_pool = ref(*args)
    assert out.dtype == vdtype
    tol = TOL[vdtype if kt == torch.float32 else qdtype] * max(1.0, float(want.float().abs().max()))
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=tol)
    torch.testing.assert_close(new_pool, want_pool, rtol=0, atol=1e-5 * max(1.0, float(want_pool.abs().max())))


def test_without_l2norm():
    q, k, v, g, beta, cu, sp, pool, slots = make([64, 10], [0, 3], dk=8, dv=8, seed=4)
    assert_matches((q * 0.3, k * 0.3, v, g, beta, cu, sp, pool, slots), l2norm=False)


@pytest.mark.parametrize("gate,beta", [(5.0, 1.0), (0.0, 1.0), (0.01, 0.0)], ids=["strong_decay", "no_decay", "beta0"])
def test_gate_and_beta_extremes(gate, beta):
    # e^G underflowing across a chunk, no decay with beta = 1 (I + L farthest from I), beta = 0
    q, k, v, g, b, cu, sp, pool, slots = make([140, 64], [0, 64], dk=32, dv=16, seed=12)
    g = -torch.rand(g.shape, generator=torch.Generator().manual_seed(1)) * gate
    assert_matches((q, k, v, g, torch.full_like(b, beta), cu, sp, pool, slots))


def test_decode_rows():
    # one token per row: only the recurrent form; positions in every part of a chunk
    args = make([1] * 5, [0, 63, 64, 100, 7], hv=2, dk=24, dv=16, seed=5)
    assert_matches(args)


SMALL = dict(lengths=[70, 64, 3, 0], starts=[60, 0, 64, 2], hk=1, hv=2, dk=12, dv=9, seed=6)


@pytest.mark.parametrize("sched,guard", [("reverse", "end"), ("random", "start"), ("forward", "start")])
def test_same_bits_under_every_schedule_and_guard_side(sched, guard):
    args = make(**SMALL)
    a = emu(*args)
    b = emu(*args, sched=sched, seed=3, guard=guard)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_same_bits_with_fp_contraction_and_with_clang():
    # The kernel pins contraction off; built with -ffp-contract=fast -mfma -O2 it gives the same bits,
    # and so does a clang build (a second compiler's view: no undefined behaviour either hides).
    args = make(**SMALL)
    a = emu(*args)
    b = emu(*args, contract="fast")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    if msl_emu.have_clang():
        c = emu(*args, cxx=msl_emu.CLANG)
        assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


@pytest.mark.parametrize("simd_seed", [0, 5])
def test_within_tolerance_for_any_tile_product_order(simd_seed):
    # The 8 products of a tile element are summed in a random tree per call site (shim): the results
    # move by rounding only, and stay bitwise equal for one order.
    args = make(**SMALL)
    out, _ = assert_matches(args, simd_seed=simd_seed)
    assert torch.equal(out, emu(*args, simd_seed=simd_seed, sched="random", seed=9)[0])


def test_chunk_invariance_under_aligned_cuts():
    # One row of 200 tokens from position 5, one shot vs cut at the absolute positions 64 and 192
    # (multiples of 64): the same pieces, hence the same bits, whatever else shares the call.
    q, k, v, g, beta, _, _, pool, _ = make([200], [5], dk=16, dv=12, pool_slots=3, seed=7)
    slot = torch.tensor([1], dtype=torch.int32)
    whole = pool.clone()
    out = hebrus_emu.gdn_chunk_delta_rule_slots(q, k, v, g, beta, torch.tensor([0, 200], dtype=torch.int32),
                                                torch.tensor([5]), whole, slot, 0.25, True)
    cut = pool.clone()
    parts = []
    for lo, hi in ((0, 59), (59, 187), (187, 200)):  # positions [5, 64), [64, 192), [192, 205)
        # each part shares its call with an unrelated row in another slot
        oq, ok_, ov, og, ob, *_ = make([9], [3], dk=16, dv=12, seed=lo)
        cat = lambda a, b: torch.cat([a, b])  # noqa: E731
        o = hebrus_emu.gdn_chunk_delta_rule_slots(
            cat(oq, q[lo:hi]), cat(ok_, k[lo:hi]), cat(ov, v[lo:hi]), cat(og, g[lo:hi]), cat(ob, beta[lo:hi]),
            torch.tensor([0, 9, 9 + hi - lo], dtype=torch.int32), torch.tensor([3, 5 + lo]), cut,
            torch.tensor([0, 1], dtype=torch.int32), 0.25, True)
        parts.append(o[9:])
    assert torch.equal(torch.cat(parts), out)
    assert torch.equal(cut[1], whole[1])


def test_rows_do_not_depend_on_the_other_rows():
    args = make(**SMALL)
    out, pool = emu(*args)
    q, k, v, g, beta, cu, sp, p0, slots = args
    for b in range(len(SMALL["lengths"])):
        lo, hi = int(cu[b]), int(cu[b + 1])
        alone = p0.clone()
        o = hebrus_emu.gdn_chunk_delta_rule_slots(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                                  torch.tensor([0, hi - lo], dtype=torch.int32), sp[b:b + 1], alone,
                                                  slots[b:b + 1], q.shape[2] ** -0.5, True)
        assert torch.equal(o, out[lo:hi])
        assert torch.equal(alone[int(slots[b])], pool[int(slots[b])])


# ---- bad inputs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("what,edit,message", [
    ("slot out of range", lambda a: a[8].__setitem__(1, 7),
     r"hebrus::gdn_chunk_delta_rule_slots: slots\[1\] = 7 is outside \[0, S=5\)"),
    ("slot twice", lambda a: a[8].__setitem__(2, int(a[8][0])),
     r"hebrus::gdn_chunk_delta_rule_slots: slot \d+ appears twice in one batch \(rows 0 and 2\)"),
    ("negative start", lambda a: a[6].__setitem__(0, -3),
     r"hebrus::gdn_chunk_delta_rule_slots: start_pos\[0\] = -3 is negative"),
    ("cu decreasing", lambda a: a[5].__setitem__(1, 80),
     r"hebrus::gdn_chunk_delta_rule_slots: cu_seqlens must be non-decreasing; row 1 has cu_seqlens\[1\] = 80"),
])
def test_bad_values_are_reported_and_write_nothing_for_their_rows(what, edit, message):
    args = make([70, 2, 3], [0, 0, 64], dk=8, dv=8, pool_slots=5, seed=8)
    edit(args)
    pool = args[7].clone()
    with pytest.raises(torch.AcceleratorError, match=message):
        hebrus_emu.gdn_chunk_delta_rule_slots(*args[:7], pool, args[8], 0.3, True)
    slots = args[8].tolist()
    bad_rows = {"slot out of range": [1], "slot twice": [0, 2], "negative start": [0], "cu decreasing": [0, 1]}[what]
    for b in bad_rows:
        if 0 <= slots[b] < pool.shape[0]:
            assert torch.equal(pool[slots[b]], args[7][slots[b]])  # the faulty row's state: untouched


def test_only_empty_rows_leave_the_pool_alone():
    args = make([0, 0], [3, 64], dk=8, dv=8, seed=10)
    out, pool = emu(*args)
    assert out.shape == (0, 2, 8) and torch.equal(pool, args[7])
    bad = list(args)
    bad[6] = torch.tensor([3, -1])
    with pytest.raises(torch.AcceleratorError, match=r"start_pos\[1\] = -1 is negative"):
        emu(*bad)


def test_no_rows_runs_the_check_kernel():
    q = torch.zeros(0, 1, 8)
    v = torch.zeros(0, 2, 8)
    g = torch.zeros(0, 2)
    empty = (q, q, v, g, g, torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
             torch.zeros(2, 2, 8, 8), torch.zeros(0, dtype=torch.int32))
    (launch,) = hebrus_emu.launches("gdn_chunk_delta_rule_slots", *empty, 0.3, True)
    assert launch["kernel"] == "gdn_chunk_delta_rule_slots_check"
    assert hebrus_emu.gdn_chunk_delta_rule_slots(*empty, 0.3, True).shape == (0, 2, 8)
    bad = list(empty)
    bad[5] = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(torch.AcceleratorError, match=r"cu_seqlens must start at 0 and end at T = 0, got 4 \.\. 4"):
        hebrus_emu.gdn_chunk_delta_rule_slots(*bad, 0.3, True)


@pytest.mark.parametrize("edit,message", [
    (lambda a: a.__setitem__(0, torch.zeros(3, 1, 136)), r"k must have q's shape"),
    (lambda a: (a.__setitem__(0, torch.zeros(3, 1, 136)), a.__setitem__(1, torch.zeros(3, 1, 136)),
                a.__setitem__(7, torch.zeros(2, 2, 136, 8))), r"on MPS: the Metal kernel takes key dims up to 128"),
    (lambda a: a.__setitem__(3, a[3].int()), r"g must have dtype torch.float32 or torch.float16 or torch.bfloat16"),
    (lambda a: a.__setitem__(6, a[6].int()), r"start_pos must have dtype torch.int64"),
    (lambda a: a.__setitem__(7, a[7].double()), r"state_pool must have dtype torch.float32"),
    (lambda a: a.__setitem__(7, a[7][:, :1]), r"state_pool must have shape \(S, Hv, Dk, Dv\)"),
])
def test_metadata_errors_raise_before_any_launch(edit, message):
    args = list(make([3], [0], dk=8, dv=8, seed=9))
    edit(args)
    with pytest.raises(HebrusError, match=message):
        hebrus_emu.launches("gdn_chunk_delta_rule_slots", *args, 0.3, True)

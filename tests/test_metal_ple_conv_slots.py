"""mps_kernels/ple_conv_slots.metal run in the emulator with the glue's launches, against the CPU kernel.

The state pool is updated in place (the glue marks it ``in_place``: bound as the caller's tensor, not
poisoned, guard-paged like every buffer). Against the CPU kernel (hebrus::ple_conv_slots on CPU) and
the emulated ple_conv on the gathered tails: random ragged batches with empty rows, rows shorter and
longer than the tail (n < L, n >= L), decode, every dtype, both activations, K = 1; pool rows not
named by the slots bitwise untouched; bitwise chunk invariance (one shot vs 1/2/1 vs random cuts);
the same bits under every fiber schedule, guard side and FMA contraction; slots out of range or
named twice and bad cu_seqlens raised at synchronization with the CPU kernel's message, and the pool
row of a bad slot left as it was.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
import msl_emu  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402
from hebrus_torch.ple import ops  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def make(lengths, channels, width, dilation, dtype, pool_slots=None, seed=0):
    """x, weight, cu_seqlens, a random pool and distinct random slots that use the pool's first and
    last rows (an off-by-one row there reaches a guard page)."""
    g = torch.Generator().manual_seed(seed)
    batch, state_len = len(lengths), (width - 1) * dilation
    pool_slots = pool_slots or batch + 3
    x = torch.randn(sum(lengths), channels, generator=g).to(dtype)
    w = (torch.randn(channels, width, generator=g) / width).to(dtype)
    pool = torch.randn(pool_slots, state_len, channels, generator=g).to(dtype)
    inner = (torch.randperm(pool_slots - 2, generator=g) + 1).tolist()
    slots = torch.tensor([0, pool_slots - 1, *inner][:batch], dtype=torch.int32)
    return x, w, cu_of(lengths), pool, slots[torch.randperm(batch, generator=g)]


def emu(x, w, cu, pool, slots, dilation, activation, **kw):
    pool = pool.clone()
    return hebrus_emu.ple_conv_slots(x, w, cu, pool, slots, dilation, activation, **kw), pool


def cpu(x, w, cu, pool, slots, dilation, activation):
    pool = pool.clone()
    return ops.ple_conv_slots(x, w, cu, pool, slots, dilation, activation), pool


def assert_matches(x, w, cu, pool, slots, dilation, activation, **kw):
    y, got_pool = emu(x, w, cu, pool, slots, dilation, activation, **kw)
    y_cpu, cpu_pool = cpu(x, w, cu, pool, slots, dilation, activation)
    assert torch.equal(got_pool, cpu_pool)  # the named tails updated, every other row bitwise kept
    if x.dtype == torch.float32 and activation == "none":
        assert torch.equal(y, y_cpu)  # same products and sums in the same order: bitwise
    else:  # SiLU's exp (and the 16-bit rounding after it) is the platform's
        torch.testing.assert_close(y.float(), y_cpu.float(), atol=TOL[x.dtype], rtol=TOL[x.dtype])
    # The emulated ple_conv on the gathered tails: the same expression, so bitwise in every case.
    y_plain, new_state = hebrus_emu.ple_conv(x, w, cu, pool.index_select(0, slots.long()), dilation, activation)
    assert torch.equal(y, y_plain)
    assert torch.equal(got_pool.index_select(0, slots.long()), new_state)
    return y, got_pool


@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_cpu_kernel(dtype, activation):
    x, w, cu, pool, slots = make([0, 5, 1, 13, 0, 7, 2, 9, 10], 6, 4, 3, dtype, seed=1)
    assert_matches(x, w, cu, pool, slots, 3, activation)
    y_ref_pool = pool.clone()  # and the reference (gather, ple_conv, index_copy_) moves the same bits
    reference.ple_conv_slots(x, w, cu, y_ref_pool, slots, 3, activation)
    assert torch.equal(emu(x, w, cu, pool, slots, 3, activation)[1], y_ref_pool)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    width = int(torch.randint(1, 5, (1,), generator=g))
    dilation = int(torch.randint(1, 4, (1,), generator=g))
    channels = int(torch.randint(1, 40, (1,), generator=g))
    batch = int(torch.randint(1, 7, (1,), generator=g))
    lengths = torch.randint(0, 2 * (width - 1) * dilation + 3, (batch,), generator=g).tolist()
    lengths[int(torch.randint(0, batch, (1,), generator=g))] = 0 if seed % 2 else 1  # an empty row / a decode row
    dtype = DTYPES[seed % 3]
    activation = ("silu", "none")[seed % 2]
    x, w, cu, pool, slots = make(lengths, channels, width, dilation, dtype, pool_slots=batch + 2 + seed, seed=seed)
    assert_matches(x, w, cu, pool, slots, dilation, activation, sched="random", seed=seed)


def test_decode_batch():
    # Qwen4Exp's decode shape in small: one token per row, K = 4, d = 3 (L = 9), channels not a multiple of 4.
    x, w, cu, pool, slots = make([1] * 8, 30, 4, 3, torch.bfloat16, pool_slots=20, seed=4)
    assert_matches(x, w, cu, pool, slots, 3, "silu")


def test_rows_not_named_are_untouched():
    x, w, cu, pool, slots = make([4, 0, 12, 1], 9, 4, 3, torch.float16, pool_slots=11, seed=5)
    pool[5:7] = float("nan")  # NaN bits too: compared as bytes
    _, got = emu(x, w, cu, pool, slots, 3, "silu")
    named = set(slots.tolist())
    for s in range(pool.shape[0]):
        if s not in named or s == int(slots[1]):  # row 1 has no tokens: its tail passes through
            assert torch.equal(got[s].view(torch.int16), pool[s].view(torch.int16)), s
        else:
            assert not torch.equal(got[s], pool[s]), s


def test_launch_marks_the_pool_in_place():
    x, w, cu, pool, slots = make([3, 2], 8, 4, 3, torch.float32)
    (launch,) = hebrus_emu.launches("ple_conv_slots", x, w, cu, pool, slots, 3, "silu")
    assert launch["kernel"] == "ple_conv_slots_float"
    assert launch["written"] == [False, False, False, True, False, True]
    assert launch["in_place"] == [False, False, False, True, False, False]
    assert launch["tensors"][3].data_ptr() == pool.data_ptr()  # the caller's pool itself, never a copy
    assert (launch["error_index"], launch["params_index"]) == (6, 7)
    assert (launch["threads"], launch["group"]) == ((5 + 2) * 2, 256)


def run_chunks(x_rows, w, pool, slots, dilation, activation, cuts):
    """Feed every row's stream in chunks cut at `cuts` (shared positions), the pool carrying the tails."""
    pool = pool.clone()
    ys, bounds = [[] for _ in x_rows], [0, *cuts, max(len(r) for r in x_rows)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        parts = [r[a:b] for r in x_rows]
        y = hebrus_emu.ple_conv_slots(torch.cat(parts), w, cu_of([len(p) for p in parts]), pool, slots, dilation,
                                      activation)
        for i, chunk in enumerate(torch.split(y, [len(p) for p in parts])):
            ys[i].append(chunk)
    return [torch.cat(c) for c in ys], pool


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_invariance(dtype):
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(n, 10, generator=g).to(dtype) for n in (11, 4, 0)]
    w = torch.randn(10, 4, generator=g).to(dtype)
    pool = torch.randn(5, 9, 10, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    one_shot = run_chunks(rows, w, pool, slots, 3, "silu", [])
    small = run_chunks(rows, w, pool, slots, 3, "silu", [1, 3, 4, 6, 7, 9, 10])  # 1/2/1/2/1/2/1/1 tokens
    cuts = sorted(torch.randperm(10, generator=g)[:3].add(1).tolist())
    random = run_chunks(rows, w, pool, slots, 3, "silu", cuts)
    for other in (small, random):
        assert all(torch.equal(a, b) for a, b in zip(one_shot[0], other[0]))
        assert torch.equal(one_shot[1], other[1])


@pytest.mark.parametrize("sched,guard", [("reverse", "end"), ("random", "start"), ("random", "end")])
def test_schedules_guards_and_contraction_agree(sched, guard):
    x, w, cu, pool, slots = make([4, 0, 9, 3, 1], 9, 4, 3, torch.float16, seed=7)
    base = emu(x, w, cu, pool, slots, 3, "silu")
    other = emu(x, w, cu, pool, slots, 3, "silu", sched=sched, seed=11, guard=guard)
    assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])
    if sched == "reverse":  # contraction pinned off: a -ffp-contract=fast build gives the same bits
        x32, w32, pool32 = x.float(), w.float(), pool.float()
        a = emu(x32, w32, cu, pool32, slots, 3, "silu")
        b = emu(x32, w32, cu, pool32, slots, 3, "silu", contract="fast")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def both_raise(x, w, cu, pool, slots, dilation=3, activation="silu"):
    """The emulator's error (at synchronization) and the CPU kernel's; returns the emulated pool."""
    got = pool.clone()
    with pytest.raises(hebrus_emu.ASYNC_ERROR) as emu_err:
        hebrus_emu.ple_conv_slots(x, w, cu, got, slots, dilation, activation)
    with pytest.raises(HebrusError) as cpu_err:
        cpu(x, w, cu, pool, slots, dilation, activation)
    assert str(cpu_err.value) in hebrus_emu.reported(), (str(cpu_err.value), hebrus_emu.reported())
    return str(emu_err.value), str(cpu_err.value), got


@pytest.mark.parametrize("bad,value", [(2, -1), (0, 6), (3, 1 << 30)])
def test_slot_out_of_range_raises(bad, value):
    x, w, cu, pool, slots = make([2, 1, 0, 3], 5, 4, 3, torch.float32, pool_slots=6)
    slots[bad] = value
    emu_msg, cpu_msg, got = both_raise(x, w, cu, pool, slots)
    assert emu_msg == cpu_msg == f"hebrus::ple_conv_slots: slots[{bad}] = {value} is outside [0, S=6)"
    for r, s in enumerate(slots.tolist()):  # the other rows still ran; nothing was written out of the pool
        if r != bad and cu[r + 1] > cu[r]:
            assert not torch.equal(got[s], pool[s])


@pytest.mark.parametrize("rows", [(0, 2), (1, 3), (0, 1, 3)])
def test_duplicate_slot_raises_and_leaves_its_row(rows):
    x, w, cu, pool, slots = make([2, 1, 4, 3], 5, 4, 3, torch.float32, pool_slots=7, seed=2)
    slots[list(rows)] = int(slots[rows[0]])
    emu_msg, cpu_msg, got = both_raise(x, w, cu, pool, slots)
    assert cpu_msg == (f"hebrus::ple_conv_slots: slot {int(slots[rows[0]])} appears twice in one batch "
                       f"(rows {rows[0]} and {rows[1]}); each row updates its slot in place")
    assert emu_msg == cpu_msg or len(rows) > 2  # three rows: which report comes first is the GPU's timing
    assert torch.equal(got[int(slots[rows[0]])], pool[int(slots[rows[0]])])  # no row of the shared slot wrote


@pytest.mark.parametrize("bad", [[0, 3, 2, 6], [1, 3, 4, 6], [0, 2, 4, 5]])
def test_bad_cu_seqlens_raise(bad):
    x, w, _, pool, slots = make([2, 2, 2], 4, 4, 3, torch.float32)
    emu_msg, cpu_msg, _ = both_raise(x, w, torch.tensor(bad, dtype=torch.int32), pool, slots)
    assert emu_msg == cpu_msg


def test_empty_shapes_launch_the_check_kernel():
    # B == 0: one check thread; C == 0: one per row, which still checks cu_seqlens and the slots.
    x, w, cu, pool, slots = make([], 4, 4, 3, torch.float32, pool_slots=3)
    (launch,) = hebrus_emu.launches("ple_conv_slots", x, w, cu, pool, slots, 3, "silu")
    assert (launch["kernel"], launch["threads"]) == ("ple_conv_slots_check", 1)
    assert hebrus_emu.ple_conv_slots(x, w, cu, pool, slots, 3, "silu").shape == (0, 4)
    x, w, cu, pool, slots = make([2, 0, 1], 0, 4, 3, torch.float32, pool_slots=4)
    (launch,) = hebrus_emu.launches("ple_conv_slots", x, w, cu, pool, slots, 3, "silu")
    assert (launch["kernel"], launch["threads"]) == ("ple_conv_slots_check", 3)
    assert hebrus_emu.ple_conv_slots(x, w, cu, pool, slots, 3, "silu").shape == (3, 0)
    slots[2] = slots[0]
    emu_msg, cpu_msg, _ = both_raise(x, w, cu, pool, slots)
    assert emu_msg == cpu_msg
    emu_msg, cpu_msg, _ = both_raise(x, w, torch.tensor([0, 2, 1, 3], dtype=torch.int32), pool,
                                     torch.tensor([0, 1, 2], dtype=torch.int32))
    assert emu_msg == cpu_msg
    x, w, _, pool, slots = make([], 4, 4, 3, torch.float32, pool_slots=3)
    emu_msg, cpu_msg, _ = both_raise(x, w, torch.tensor([5], dtype=torch.int32), pool, slots)
    assert emu_msg == cpu_msg


def test_kernels_present():
    assert set(hebrus_emu.module("ple_conv_slots").kernels) == {
        "ple_conv_slots_float", "ple_conv_slots_half", "ple_conv_slots_bfloat", "ple_conv_slots_check"}
    no_bf16 = msl_emu.translate(os.path.join(msl_emu.KERNEL_DIR, "ple_conv_slots.metal"), defines={})[1]
    assert set(no_bf16) == {"ple_conv_slots_float", "ple_conv_slots_half", "ple_conv_slots_check"}

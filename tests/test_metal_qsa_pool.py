"""mps_kernels/qsa_pool.metal run in the emulator with the glue's grid, against the reference.

Every dtype; head dims with and without a tail past the rotary part, no RoPE at all, r = 1 and
r > 32 (members spread over lanes); cells in any physical order; large positions; groups across a
hole raising HoleError (the in-kernel check, reported through the error slot) and out-of-range
cells raising HebrusError with the reference's messages; pooled keys independent of which other
groups share the launch (bitwise); every schedule.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError, HoleError  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(groups, r, dim, rot, dtype, p0=100, seed=0, spare=5):
    """Groups of r consecutive positions from p0 stored in shuffled physical cells."""
    g = torch.Generator().manual_seed(seed)
    cells = groups * r + spare
    keys = (torch.randn(cells, dim, generator=g) * 2).to(dtype)
    perm = torch.randperm(cells, generator=g)
    cell_pos = torch.empty(cells, dtype=torch.int64)
    cell_pos[perm] = torch.arange(cells) + p0
    group_pos = torch.arange(groups) * r + p0
    group_cells = perm[(group_pos - p0)[:, None] + torch.arange(r)].to(torch.int32)
    weight = (torch.randn(dim, generator=g) * 0.2).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / max(rot, 1)))
    return keys, cell_pos, group_cells, group_pos, weight, 1e-6, inv_freq


def close(got, want, dtype):
    if dtype == torch.float32:  # the squares are summed in another order, rsqrt is the platform's
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:  # rounded to the key dtype after every step, as torch does: equal except rare 1-ulp ties
        diff = (got.float() - want.float()).abs()
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(1e-3)
        assert bool((diff <= ulp * 1.01).all()) and float((got != want).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,r,dim,rot", [(9, 4, 128, 64), (5, 4, 72, 48), (3, 1, 40, 0), (2, 37, 33, 32),
                                              (17, 3, 64, 64)])
def test_matches_reference(dtype, groups, r, dim, rot):
    args = make(groups, r, dim, rot, dtype, seed=dim + r)
    close(hebrus_emu.qsa_pool(*args), reference.qsa_pool(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_positions(dtype):
    args = make(6, 4, 64, 64, dtype, p0=70001, seed=3)
    close(hebrus_emu.qsa_pool(*args), reference.qsa_pool(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_groups_are_independent_of_the_batch(dtype):
    args = make(11, 4, 64, 32, dtype, seed=4)
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = args
    whole = hebrus_emu.qsa_pool(*args)
    parts, start = [], 0
    for n in (1, 2, 1, 4, 3):
        parts.append(hebrus_emu.qsa_pool(keys, cell_pos, group_cells[start:start + n], group_pos[start:start + n],
                                         weight, eps, inv_freq))
        start += n
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize("sched,guard", [("reverse", "start"), ("random", "end")])
def test_schedules_agree(sched, guard):
    args = make(10, 4, 48, 32, torch.bfloat16, seed=8)
    assert torch.equal(hebrus_emu.qsa_pool(*args), hebrus_emu.qsa_pool(*args, sched=sched, seed=9, guard=guard))


def _both_raise(kind, args):
    # On MPS a value error is reported through the stream's error buffer and raised at the next
    # synchronization; the reference's message (the first bad entry) is among those the kernel reported.
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=r"^hebrus::qsa_pool: ") as emu_err:
        hebrus_emu.qsa_pool(*args)
    with pytest.raises(kind) as ref_err:
        reference.qsa_pool(*args)
    assert str(ref_err.value) in hebrus_emu.reported() and str(emu_err.value) in hebrus_emu.reported()
    return str(ref_err.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_across_a_hole_raises(dtype):
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = make(8, 4, 64, 64, dtype, seed=5)
    cell_pos[group_cells[5, 2]] += 1000  # position p0 + 22 is missing: group 5 crosses a hole
    cell_pos[group_cells[6, 0]] += 1000  # and group 6 starts with one
    msg = _both_raise(HoleError, (keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq))
    assert "group 5 " in msg and "member 2 " in msg


def test_hole_in_a_wide_group_is_found_by_any_lane():
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = make(3, 40, 32, 32, torch.float32, seed=6)
    cell_pos[group_cells[1, 35]] = -5  # member 35: checked by lane 3 on its second pass
    msg = _both_raise(HoleError, (keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq))
    assert "member 35 " in msg


def test_shifted_group_start_is_a_hole():
    args = list(make(4, 4, 32, 16, torch.float16, seed=7))
    args[3] = args[3].clone()
    args[3][2] += 1  # the group's cells start one position before group_pos says
    _both_raise(HoleError, args)


def test_cell_out_of_range_raises():
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = make(4, 4, 32, 16, torch.float32, seed=8)
    group_cells[3, 1] = keys.shape[0]
    group_cells[2, 0] = 0  # a hole too: the range error wins, as in the reference
    msg = _both_raise(HebrusError, (keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq))
    assert "outside" in msg


def test_no_groups():
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = make(0, 4, 32, 16, torch.float32)
    assert hebrus_emu.qsa_pool(keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq).shape == (0, 32)


def test_kernel_reports_to_the_error_buffer_and_leaves_broken_groups_unwritten():
    # Below the glue: the raw launch, with an error buffer of c10::metal::ErrorMessages' layout.
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = make(10, 4, 64, 32, torch.float16, seed=11)
    cell_pos[group_cells[7, 3]] += 50
    cell_pos[group_cells[2, 1]] += 50
    p = hebrus_emu.plan("qsa_pool", keys.shape[0], 64, 10, 4, inv_freq.shape[0], eps)
    assert (p.threads, p.group) == (10 * 32, 256)
    pooled = hebrus_emu.poisoned((10, 64), keys.dtype)
    err = torch.zeros(hebrus_emu.glue().error_buffer_bytes(), dtype=torch.uint8)
    hebrus_emu.module("qsa_pool").dispatch(
        hebrus_emu.kernel_name("qsa_pool", "", keys.dtype),
        [keys, cell_pos, group_cells, group_pos, weight.float(), inv_freq, pooled, err, p.params_bytes],
        grid=(p.threads,), tg=(p.group,), sched="random", seed=1)
    stream = hebrus_emu.Stream()
    stream.buffer = err
    assert sorted(stream.messages()) == [  # one message per broken member, nothing read back by the glue
        "hebrus::qsa_pool: group 2 starting at position 108 has position 159 in member 1 where 109 is required "
        "(a hole inside the run is not padding)",
        "hebrus::qsa_pool: group 7 starting at position 128 has position 181 in member 3 where 131 is required "
        "(a hole inside the run is not padding)"]
    assert bool(torch.isnan(pooled[[2, 7]]).all())  # broken groups write nothing
    good = [g for g in range(10) if g not in (2, 7)]
    want = reference.qsa_pool(keys, cell_pos, group_cells[good], group_pos[good], weight, eps, inv_freq)
    close(pooled[good], want, torch.float16)

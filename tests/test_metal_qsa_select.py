"""mps_kernels/qsa_select.metal run in the emulator with the glue's grid, against the reference.

Integer-valued inputs make every score exact in any summation order, so selections must equal the
reference bitwise, ties included (many equal scores: the lower group must win). Random real inputs
are checked against fp64 scores. Covered: every dtype and mixed q/pooled dtypes, both variants
(k512 and k2048), several tiles of groups, queries of different sequences interleaved in one block,
queries that see 0 or fewer than top_k groups, -1 padding, results independent of which queries
share a launch (chunk invariance), every schedule, and bad q_row / q_groups / seq_groups raising
the reference's errors.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(tq, hq, dim, batch, max_groups, dtype, seed=0, integer=True, rows=None):
    g = torch.Generator().manual_seed(seed)
    rows = rows or batch * max_groups
    if integer:  # small integers: products and sums exact in fp32, lots of tied scores
        pooled = torch.randint(-2, 3, (rows, dim), generator=g).to(dtype)
        q = torch.randint(-1, 2, (tq, hq, dim), generator=g).to(dtype)
    else:
        pooled = torch.randn(rows, dim, generator=g).to(dtype)
        q = torch.randn(tq, hq, dim, generator=g).to(dtype)
    seq_groups = torch.randperm(rows, generator=g)[: batch * max_groups].view(batch, max_groups).to(torch.int32)
    q_row = torch.randint(0, batch, (tq,), generator=g).to(torch.int32)
    q_groups = torch.randint(0, max_groups + 1, (tq,), generator=g).to(torch.int32)
    for b in range(batch):  # past the longest visible run of a sequence: -1, as the cache lays it out
        vis = int(q_groups[q_row == b].max()) if bool((q_row == b).any()) else 0
        seq_groups[b, vis:] = -1
    return q, pooled, seq_groups, q_row, q_groups


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 7, 64, 300])
def test_matches_reference_exactly(dtype, top_k):
    args = make(13, 4, 16, 3, 300, dtype, seed=top_k)
    got = hebrus_emu.qsa_select(*args, top_k)
    assert torch.equal(got, reference.qsa_select(*args, top_k))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_top_k_variant(dtype):
    args = make(3, 2, 8, 2, 700, dtype, seed=1)
    assert hebrus_emu.plan("qsa_select", 3, 2, 8, 1400, 2, 700, 600).variant == b"k2048"
    assert torch.equal(hebrus_emu.qsa_select(*args, 600), reference.qsa_select(*args, 600))


def test_all_scores_tied_picks_the_lowest_groups():
    q, pooled, seq_groups, q_row, q_groups = make(6, 4, 8, 2, 40, torch.float32, seed=2)
    pooled.zero_()
    got = hebrus_emu.qsa_select(q, pooled, seq_groups, q_row, q_groups, 5)
    want = torch.where(torch.arange(5)[None, :] < q_groups[:, None].clamp(max=5), torch.arange(5)[None, :], -1)
    assert torch.equal(got, want.int()) and torch.equal(got, reference.qsa_select(q, pooled, seq_groups, q_row,
                                                                                   q_groups, 5))


def test_mixed_dtypes():
    q, pooled, seq_groups, q_row, q_groups = make(9, 4, 16, 2, 100, torch.float32, seed=3)
    args = (q.half(), pooled, seq_groups, q_row, q_groups, 10)
    assert torch.equal(hebrus_emu.qsa_select(*args), reference.qsa_select(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_inputs_select_the_best_groups(dtype):
    q, pooled, seq_groups, q_row, q_groups = make(10, 4, 32, 2, 280, dtype, seed=4, integer=False)
    k = 20
    got = hebrus_emu.qsa_select(q, pooled, seq_groups, q_row, q_groups, k)
    want = reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, k)
    for t in range(q.shape[0]):
        n = int(q_groups[t])
        keys = pooled.double()[seq_groups[int(q_row[t]), :n].long()]
        scores = torch.relu(torch.einsum("hd,gd->hg", q[t].double(), keys)).sum(0) / math.sqrt(q.shape[2])
        sel = got[t][got[t] >= 0].long()
        assert sel.numel() == min(k, n) and bool((sel[1:] > sel[:-1]).all())
        if n > k:  # every kept group scores at least as well as every dropped one (up to fp32 rounding)
            dropped = torch.ones(n, dtype=torch.bool)
            dropped[sel] = False
            assert float(scores[sel].min()) >= float(scores[dropped].max()) - 1e-4 * float(scores.abs().max())
    assert float((got == want).float().mean()) > 0.95


def test_independent_of_the_other_queries():
    args = make(14, 4, 16, 3, 270, torch.bfloat16, seed=5)
    q, pooled, seq_groups, q_row, q_groups = args
    whole = hebrus_emu.qsa_select(*args, 9)
    parts, start = [], 0
    for n in (1, 2, 1, 5, 2, 3):
        sl = slice(start, start + n)
        parts.append(hebrus_emu.qsa_select(q[sl], pooled, seq_groups, q_row[sl], q_groups[sl], 9))
        start += n
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize("sched,guard", [("reverse", "start"), ("random", "end")])
def test_schedules_agree(sched, guard):
    args = make(9, 2, 8, 2, 300, torch.float16, seed=6)
    a = hebrus_emu.qsa_select(*args, 12)
    b = hebrus_emu.qsa_select(*args, 12, sched=sched, seed=3, guard=guard)
    assert torch.equal(a, b)


def test_no_visible_groups_and_no_queries():
    q, pooled, seq_groups, q_row, q_groups = make(5, 2, 8, 2, 10, torch.float32, seed=7)
    q_groups.zero_()
    assert torch.equal(hebrus_emu.qsa_select(q, pooled, seq_groups, q_row, q_groups, 4),
                       torch.full((5, 4), -1, dtype=torch.int32))
    assert hebrus_emu.qsa_select(q[:0], pooled, seq_groups, q_row[:0], q_groups[:0], 4).shape == (0, 4)


@pytest.mark.parametrize("where", ["row", "groups", "seq_groups"])
def test_bad_input_raises_like_the_reference(where):
    q, pooled, seq_groups, q_row, q_groups = make(8, 2, 8, 3, 20, torch.float32, seed=8)
    q_groups[:] = 20
    seq_groups = torch.randperm(pooled.shape[0])[:60].view(3, 20).to(torch.int32)
    if where == "row":
        q_row[5] = 3
    elif where == "groups":
        q_groups[2] = 21
    else:
        seq_groups[int(q_row[0]), 4] = pooled.shape[0]
    with pytest.raises(hebrus_emu.ASYNC_ERROR) as emu_err:  # from the stream's error buffer, at synchronization
        hebrus_emu.qsa_select(q, pooled, seq_groups, q_row, q_groups, 5)
    with pytest.raises(HebrusError) as ref_err:
        reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, 5)
    assert str(emu_err.value) == str(ref_err.value)


def test_top_k_beyond_the_kernel_limit_is_refused():
    q, pooled, seq_groups, q_row, q_groups = make(2, 1, 4, 1, 2100, torch.float32, seed=9)
    with pytest.raises(HebrusError, match="at most 2048 groups per query"):
        hebrus_emu.qsa_select(q, pooled, seq_groups, q_row, q_groups, 2049)


@pytest.mark.parametrize("sched,seed", [("forward", 0), ("reverse", 0)] + [("random", s) for s in range(4)])
@pytest.mark.parametrize("hot", [300, 512, 612, 736])
def test_a_tile_without_candidates(sched, seed, hot):
    # Decode with a full top-k: a tile where nothing can enter is skipped, and the next tile's scores
    # are written while SIMD-groups that ran ahead meet those that did not (the shim lets SIMD-groups
    # progress independently, as a GPU does; a missing barrier there shows as a race).
    dim, groups = 4, 768
    pooled = torch.zeros(groups, dim)
    pooled[:, 0] = 1.0
    pooled[0, 0], pooled[hot, 0] = 5.0, 10.0
    q = torch.zeros(1, 1, dim)
    q[0, 0, 0] = 1.0
    args = (q, pooled, torch.arange(groups, dtype=torch.int32)[None], torch.zeros(1, dtype=torch.int32),
            torch.full((1,), groups, dtype=torch.int32), 1)
    assert hebrus_emu.qsa_select(*args, sched=sched, seed=seed).tolist() == reference.qsa_select(*args).tolist()


def test_nan_scores_rank_first_like_the_reference():
    # Every NaN ranks first (then by group), whatever its sign bit: a NaN key with the sign bit set,
    # and inf - inf (the x86 default NaN is negative).
    dim = 4
    q = torch.zeros(1, 1, dim)
    q[0, 0, 0] = 1.0
    pooled = torch.ones(3, dim)
    pooled[1].view(torch.int32)[0] = -1                  # 0xFFFFFFFF: a NaN with the sign bit set
    q2 = torch.tensor([[[1.0, 1.0, 0.0, 0.0]]])
    pooled2 = torch.ones(3, dim)
    pooled2[1, 0], pooled2[1, 1] = float("inf"), -float("inf")
    rest = (torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32))
    for qq, pp in ((q, pooled), (q2, pooled2)):
        for top_k in (1, 2):
            want = reference.qsa_select(qq, pp, *rest, top_k)
            assert hebrus_emu.qsa_select(qq, pp, *rest, top_k).tolist() == want.tolist()
            assert want[0, 0] == (1 if top_k == 1 else 0) and 1 in want[0].tolist()

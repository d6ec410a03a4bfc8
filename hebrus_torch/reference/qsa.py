"""The QSA indexer ops' references (SPEC §3): pooled, normed and roped group keys (``qsa_pool``) and the
top-k group selection (``qsa_select``) with its fixed-order scores (:func:`qsa_scores`, the CPU kernel's
bits)."""

from __future__ import annotations

import math

import torch

from .. import _validate
from ..errors import HebrusError, HoleError
from ..qsa.runs import first_hole, group_and_tail_offsets
from .checks import assert_values, checks_async

__all__ = ["rotate_half", "check_groups_contiguous", "qsa_pool", "qsa_scores", "qsa_select", "qsa_token_cells"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def check_groups_contiguous(cell_pos: torch.Tensor, group_cells: torch.Tensor, group_pos: torch.Tensor,
                            op: str = "qsa_pool") -> None:
    """Raise HoleError unless every group's cells hold positions group_pos, group_pos+1, ... (on devices
    with device-side checks, SPEC §4, a device assert instead: a hole inside a group is a value check)."""
    cells = cell_pos.shape[0]
    out_of_range = (group_cells < 0) | (group_cells >= cells)
    if checks_async(cell_pos.device):
        r = group_cells.shape[1]
        got = cell_pos[group_cells.long().clamp(0, max(cells - 1, 0))]
        expected = group_pos[:, None] + torch.arange(r, device=group_pos.device)
        assert_values(~out_of_range & (got == expected), op,
                      f"group cells must lie in [0, {cells}) and hold consecutive positions from group_pos "
                      f"(a hole inside the run is not padding)")
        return
    if bool(out_of_range.any()):
        g, i = (int(v) for v in torch.nonzero(out_of_range)[0])
        raise HebrusError(f"hebrus::{op}: group {g} cell {i} = {int(group_cells[g, i])} is outside [0, {cells})")
    r = group_cells.shape[1]
    got = cell_pos[group_cells.long()]
    # Each group is a run of r positions from group_pos (the run rule: hebrus_torch.qsa.runs).
    hole = first_hole(got.reshape(-1), group_pos, torch.full_like(group_pos, r)) if r else None
    if hole is not None:
        g, i = divmod(hole, r)
        expected = group_pos[:, None] + torch.arange(r, device=group_pos.device)[None, :]
        raise HoleError(f"hebrus::{op}: group {g} starting at position {int(group_pos[g])} has position "
                        f"{int(got[g, i])} in member {i} where {int(expected[g, i])} is required "
                        f"(a hole inside the run is not padding)")


def qsa_pool(keys: torch.Tensor, cell_pos: torch.Tensor, group_cells: torch.Tensor, group_pos: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pooled, normed and roped key of every group (SPEC §3), as transformers' indexer computes it.

    Args:
        keys: Tensor[cells, D] float32/float16/bfloat16, raw indexer keys (no norm, no RoPE).
        cell_pos: Tensor[cells] int64, logical position held by each cell.
        group_cells: Tensor[G, r] int32, the r cells of each group in position order.
        group_pos: Tensor[G] int64, position of each group's first token.
        norm_weight: Tensor[D], ``k_layernorm.weight`` (applied as ``1 + w``).
        eps: RMSNorm epsilon.
        inv_freq: Tensor[R/2] float32, rotary inverse frequencies (rotate-half on the first R dims).

    Returns:
        Tensor[G, D] in keys' dtype. Raises HoleError when a group's cells are not consecutive positions.
    """
    _validate.qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq)
    check_groups_contiguous(cell_pos, group_cells, group_pos)
    dtype = keys.dtype
    pooled = keys[group_cells.long()].float().mean(dim=1).to(dtype)
    xf = pooled.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed * (1.0 + norm_weight.float())).to(dtype)
    rot = 2 * inv_freq.shape[0]
    if rot == 0:                         # no rotary dims (a caller that ropes the pooled keys itself)
        return normed
    freqs = group_pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    head = normed[:, :rot]
    head = head * cos + rotate_half(head) * sin
    return torch.cat((head, normed[:, rot:]), dim=-1)


_SCORE_LANES = 16                 # lanes of the CPU kernel's dot products (csrc/cpu/hebrus_simd.h, kLanes)
_SELECT_BLOCK_BYTES = 64 << 20    # fp32 working set of one block of (queries x groups) scores


def qsa_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``sum_h relu(q_h . k_g) / sqrt(D)`` in fp32, in the CPU kernel's fixed order (SPEC §3, §5.1).

    Every score is a function of its own query and key only, computed with the arithmetic of
    csrc/cpu/qsa_kernels.cpp's score_rows and hebrus_simd.h's lane reduction, so it is bitwise
    independent of the other queries and groups (no matmul, whose blocking changes the summation
    order with the batch) and bitwise equal to the CPU kernel's score:

    * D is zero padded to a multiple of 16; lane j (0..15) sums the products ``q[d] * k[d]`` (each
      rounded to fp32, never fused) of the dims ``d = j mod 16`` in ascending d;
    * the 16 lanes combine pairwise: lane j + lane j+8, then + 4, + 2, + 1;
    * the heads add in order from 0 onto 0: ``((0 + relu(dot_0)) + relu(dot_1)) + ...``;
    * the sum is divided (a true fp32 division) by ``float(sqrt(D))``.

    The lane sums start at their first product instead of 0: that changes only the sign of a zero lane
    sum, which the head sum (starting from +0) absorbs, so the bits are those of the order above. All
    products of a block are one multiplication (elementwise: the same rounding), so a block launches a
    fixed, small number of kernels whatever D and Hq are (issue 19: the CUDA fallback is launch-bound).

    Args:
        q: Tensor[n, Hq, D] any float dtype (widened to fp32).
        keys: Tensor[G, D] (the same keys for every query) or Tensor[n, G, D] (each query its own G keys),
            any float dtype (widened to fp32).

    Returns:
        Tensor[n, G] float32, not differentiable (the inputs are detached: a selection has no
        gradient, and the in-place and out= operations below refuse inputs that require one).
    """
    q, keys = q.detach(), keys.detach()
    n, hq, dim = q.shape
    shared = keys.dim() == 2
    groups = keys.shape[-2]
    lanes = _SCORE_LANES
    chunks = max(1, -(-dim // lanes))
    pad = chunks * lanes - dim
    qf = q.float()
    kf = keys.float()
    if pad:
        qf = torch.nn.functional.pad(qf, (0, pad))
        kf = torch.nn.functional.pad(kf, (0, pad))
    qf = qf.view(n, hq, 1, chunks, lanes)
    kf = kf.view(1, 1, groups, chunks, lanes) if shared else kf.view(n, 1, groups, chunks, lanes)
    # A true division by a tensor on q's device: CUDA turns a division by a host scalar into a
    # multiplication by its reciprocal, which is not the kernel's rounding.
    sqrt_d = torch.full((), math.sqrt(dim), dtype=torch.float32, device=q.device)
    out = torch.empty((n, groups), dtype=torch.float32, device=q.device)
    if n == 0 or groups == 0:
        return out
    # Blocks of queries and groups bound the [n, Hq, G, chunks, 16] products; every score is computed
    # independently of the block it falls in.
    per_pair = max(hq, 1) * (chunks + 1) * lanes * 4
    g_block = max(1, min(groups, _SELECT_BLOCK_BYTES // per_pair))
    q_block = max(1, min(n, _SELECT_BLOCK_BYTES // (per_pair * g_block)))
    for q0 in range(0, n, q_block):
        qs = qf[q0:q0 + q_block]                                         # [nb, Hq, 1, chunks, 16]
        nb = qs.shape[0]
        for g0 in range(0, groups, g_block):
            ks = kf[:, :, g0:g0 + g_block] if shared else kf[q0:q0 + nb, :, g0:g0 + g_block]
            prod = qs * ks                                               # [nb, Hq, gb, chunks, 16]
            acc = prod[:, :, :, 0]
            for c in range(1, chunks):                                   # ascending d in every lane
                acc = acc + prod[:, :, :, c]
            half = acc[..., :8] + acc[..., 8:]                           # lanes j and j + 8
            half = half[..., :4] + half[..., 4:]                         # then + 4
            half = half[..., :2] + half[..., 2:]                         # then + 2
            dots = torch.relu(half[..., 0] + half[..., 1])               # then + 1: [nb, Hq, gb]
            total = dots[:, 0] + 0.0 if hq else torch.zeros_like(out[q0:q0 + nb, g0:g0 + dots.shape[2]])
            for h in range(1, hq):                                       # heads in order from 0
                total = total + dots[:, h]
            torch.div(total, sqrt_d, out=out[q0:q0 + nb, g0:g0 + dots.shape[2]])
    return out


def qsa_select(q: torch.Tensor, pooled: torch.Tensor, seq_groups: torch.Tensor, q_row: torch.Tensor,
               q_groups: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k groups per query by ``sum_h relu(q_h . k_g) / sqrt(D)`` in fp32 (SPEC §3).

    Args:
        q: Tensor[Tq, Hq, D], indexer queries (normed and roped by the model).
        pooled: Tensor[rows, D], pooled group keys.
        seq_groups: Tensor[B, maxG] int32, pooled row of each sequence's groups in order, -1 past the end.
        q_row: Tensor[Tq] int32, the seq_groups row of each query.
        q_groups: Tensor[Tq] int32, number of complete groups visible to each query.
        top_k: number of groups to keep.

    Returns:
        Tensor[Tq, top_k] int32: selected group indices within the sequence, ascending, -1 padded.
        Ties are broken by the lower group index.
    """
    _validate.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k)
    op = "qsa_select"
    tq, max_g = q.shape[0], seq_groups.shape[1]
    out = torch.full((tq, top_k), -1, dtype=torch.int32, device=q.device)
    if tq == 0:
        return out
    rows = q_row.long()
    ng = q_groups.long()
    if checks_async(q.device):
        assert_values(((rows >= 0) & (rows < seq_groups.shape[0])).all() & ((ng >= 0) & (ng <= max_g)).all(), op,
                      f"q_row must lie in [0, B={seq_groups.shape[0]}) and q_groups in [0, maxG={max_g}]")
        # No host loop over sequences (it would read the rows on the host): every query at once.
        return _qsa_select_all(q, pooled, seq_groups, rows, ng, top_k, out)
    bad = (rows < 0) | (rows >= seq_groups.shape[0])
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0])
        raise HebrusError(f"hebrus::{op}: q_row[{t}] = {int(rows[t])} is outside [0, B={seq_groups.shape[0]})")
    bad = (ng < 0) | (ng > max_g)
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0])
        raise HebrusError(f"hebrus::{op}: q_groups[{t}] = {int(ng[t])} is outside [0, maxG={max_g}]")
    # One pass per sequence: the pooled keys of a sequence are gathered once. A query that sees at
    # most top_k groups selects all of them, whatever the scores; the others rank their scores.
    for row in torch.unique(rows).tolist():
        members = torch.nonzero(rows == row).flatten()
        groups_needed = int(ng[members].max())
        if groups_needed == 0:
            continue
        group_rows = seq_groups[row, :groups_needed].long()
        bad = (group_rows < 0) | (group_rows >= pooled.shape[0])
        if bool(bad.any()):
            g = int(torch.nonzero(bad)[0])
            raise HebrusError(f"hebrus::{op}: seq_groups[{row}, {g}] = {int(group_rows[g])} is outside "
                              f"[0, rows={pooled.shape[0]}); the first {groups_needed} groups of row {row} "
                              f"are visible to its queries")
        light = members[ng[members] <= top_k]
        if light.numel():
            k_all = min(top_k, groups_needed)
            g_idx = torch.arange(k_all, device=q.device)
            out[light, :k_all] = torch.where(g_idx[None, :] < ng[light][:, None], g_idx[None, :],
                                             torch.full_like(g_idx[None, :], -1)).to(torch.int32)
        heavy = members[ng[members] > top_k]
        if heavy.numel() == 0:
            continue
        need = int(ng[heavy].max())
        keys = pooled[group_rows[:need]]                                    # [need, D]
        g_idx = torch.arange(need, device=q.device)
        # Blocks of queries bound the scores and the sort (fp32 values, int64 indices, copies).
        block = max(1, _SELECT_BLOCK_BYTES // (32 * need))
        for start in range(0, heavy.numel(), block):
            sel = heavy[start:start + block]
            scores = qsa_scores(q[sel], keys)                               # [n, need] fp32
            scores = torch.where(g_idx[None, :] < ng[sel][:, None], scores, torch.full_like(scores, -math.inf))
            # Stable descending sort: NaN first (as torch ranks it), then higher score, then lower
            # group. Every query here sees more than top_k groups, so the first top_k are visible.
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_k]
            out[sel] = torch.sort(order, dim=1).values.to(torch.int32)
    return out


def _qsa_select_all(q, pooled, seq_groups, rows, ng, top_k, out):
    """qsa_select of every query at once, with no host read (the device-side-check devices' form, SPEC §4):
    the same scores (:func:`qsa_scores`, elementwise) and the same stable ranking as the loop over
    sequences, so the same selections. One sequence's keys are scored once for all queries
    (``seq_groups`` with one row: prefill); several are gathered per query (decode: one query each)."""
    op = "qsa_select"
    tq, max_g = q.shape[0], seq_groups.shape[1]
    rows_n = seq_groups.shape[0]
    k_all = min(top_k, max_g)
    if max_g == 0:
        return out
    g_idx = torch.arange(max_g, device=q.device)
    visible = g_idx < ng[:, None]                                           # [Tq, maxG]
    group_rows = seq_groups.index_select(0, rows.clamp(0, max(rows_n - 1, 0))).long()   # [Tq, maxG]
    assert_values(((group_rows >= 0) & (group_rows < pooled.shape[0])) | ~visible, op,
                  f"seq_groups entries visible to a query must lie in [0, rows={pooled.shape[0]})")
    # A query that sees at most top_k groups selects all of them, whatever the scores.
    light = torch.where(visible[:, :k_all], g_idx[:k_all], -1)
    if max_g <= top_k or pooled.shape[0] == 0:
        out[:, :k_all] = light
        return out
    safe = group_rows.clamp(0, pooled.shape[0] - 1)
    if rows_n == 1:
        scores = qsa_scores(q, pooled.index_select(0, safe[0]))             # [Tq, maxG]
    else:
        # Blocks of queries bound the gathered keys.
        block = max(1, _SELECT_BLOCK_BYTES // (4 * max_g * max(pooled.shape[1], 1)))
        scores = torch.cat([qsa_scores(q[s:s + block], pooled[safe[s:s + block]])
                            for s in range(0, tq, block)])
    scores = torch.where(visible, scores, -math.inf)
    # Stable descending sort: NaN first (as torch ranks it), then higher score, then lower group.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_k]
    heavy = torch.sort(order, dim=1).values
    return torch.where(ng[:, None] > top_k, heavy, light).to(torch.int32)


def qsa_token_cells(selected: torch.Tensor, nvis: torch.Tensor, first: torch.Tensor, cells: torch.Tensor,
                    r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cells each query attends, from its selected groups (issue 37; what ``QSACache.plan`` derives
    from ``qsa_select``'s output).

    Args:
        selected: Tensor[Tq, top_k] int32, group indices within each query's run, -1 entries skipped
            (anywhere), the others kept in their order; each in ``[-1, nvis // r)``.
        nvis: Tensor[Tq] int64, positions in each query's run (its ``nvis // r`` complete groups, then a
            raw tail of ``nvis % r``).
        first: Tensor[Tq] int64, where each query's run starts in ``cells``.
        cells: Tensor[N] int32, the runs' physical cells; query t's run is ``cells[first[t]:first[t] + nvis[t]]``.
        r: tokens per group.

    Returns:
        (token_cells Tensor[Tq, W] int32, token_offsets Tensor[Tq, W] int64), W = top_k * r + r - 1: the
        offsets within the run of the selected groups' r tokens each, then of the tail, then -1, and the
        cells at them (-1 at padding).
    """
    _validate.qsa_token_cells(selected, nvis, first, cells, r)
    op = "qsa_token_cells"
    tq, n = selected.shape[0], cells.shape[0]
    nvis64, first64 = nvis.long(), first.long()
    q_groups = torch.div(nvis64, r, rounding_mode="floor")
    run_ok = (nvis64 >= 0) & (first64 >= 0) & (first64 <= n - nvis64)
    sel_ok = (selected >= -1) & (selected < q_groups[:, None])
    if checks_async(selected.device):
        assert_values(run_ok, op, f"each query's run [first, first + nvis) must lie in cells [0, {n})")
        assert_values(sel_ok, op, "each selected group must be -1 or one of the query's complete groups")
    else:
        if not bool(run_ok.all()):
            t = int(torch.nonzero(~run_ok)[0])
            raise HebrusError(f"hebrus::{op}: query {t} sees nvis = {int(nvis64[t])} cells from first = "
                              f"{int(first64[t])}, outside cells [0, {n})")
        for t in range(tq):
            bad = torch.nonzero(~sel_ok[t])
            if bad.numel():
                j = int(bad[0])
                raise HebrusError(f"hebrus::{op}: selected[{t}, {j}] = {int(selected[t, j])} is outside [-1, "
                                  f"{int(q_groups[t])}) (the query's complete groups)")
    offs = group_and_tail_offsets(selected.long(), q_groups, nvis64, r)
    at = torch.where(offs >= 0, first64[:, None] + offs, 0).clamp(0, max(n - 1, 0))
    picked = cells[at] if n else torch.zeros_like(offs, dtype=torch.int32)
    return torch.where(offs >= 0, picked, -1).to(torch.int32), offs


def qsa_plan_one_row(cell_pos: torch.Tensor, run_cells: torch.Tensor, run_groups: torch.Tensor, cells: torch.Tensor,
                     p0: int, start: int, r: int) -> list[torch.Tensor]:
    """The selection rows of a chunk of one row (issue 37: what ``QSACache.plan`` derives on the host for one
    person's decode or a speculative verify, no window), with its checks.

    Args:
        cell_pos: Tensor[C] int64, each cell's position (-1 when free).
        run_cells: Tensor[>= nvis] int64, the row's run: its cells in position order from ``p0``.
        run_groups: Tensor[>= nvis // r] int64, the run's complete groups' pooled rows, in order.
        cells: Tensor[T] int64, T >= 1, the chunk's cells (positions ``start .. start + T - 1``).
        p0, start: the run's first position and the chunk's; r: tokens per group.

    Returns:
        [sel_groups Tensor[1, max(G, 1)] int32 (the run's G = nvis // r groups, or -1), sel_row Tensor[T] int32
        (0), q_groups Tensor[T] int32 (each query's complete groups), cells32 Tensor[nvis + 1] int32 (the visible
        cells, then -1), nvis_q Tensor[T] int64 (each query's visible positions ``start - p0 + 1 + j``), first
        Tensor[T] int64 (0), q_p0 Tensor[T] int64 (p0), q_rows Tensor[T] int64 (0)], with nvis = start - p0 + T.

    Raises:
        HoleError where a visible cell does not hold its position (``cell_pos[run_cells[j]] != p0 + j``) or the
        run's cells at the chunk's positions are not ``cells``; HebrusError for a run cell outside the table or a
        group row outside int32.
    """
    nvis, n_groups = _validate.qsa_plan_one_row(cell_pos, run_cells, run_groups, cells, p0, start, r)
    op = "qsa_plan_one_row"
    t = cells.shape[0]
    vis = run_cells[:nvis]
    outside = (vis < 0) | (vis >= cell_pos.shape[0])
    if bool(outside.any()):
        j = int(torch.nonzero(outside)[0])
        raise HebrusError(f"hebrus::{op}: run_cells[{j}] = {int(vis[j])} is outside the table's cells "
                          f"[0, {cell_pos.shape[0]})")
    got = cell_pos[vis]
    want = torch.arange(p0, p0 + nvis, dtype=torch.int64, device=cell_pos.device)
    if not torch.equal(got, want):
        j = int(torch.nonzero(got != want)[0])
        raise HoleError(f"hebrus::{op}: the run starting at {p0} has cell {int(vis[j])} at position {int(got[j])} "
                        f"where {p0 + j} is required (a hole inside the run is not padding)")
    skip = start - p0
    mine = vis[skip:skip + t]
    if not torch.equal(mine, cells):
        j = int(torch.nonzero(mine != cells)[0])
        raise HoleError(f"hebrus::{op}: the chunk's cell {j} is {int(cells[j])} but the run holds cell "
                        f"{int(mine[j])} at position {start + j}")
    groups = run_groups[:n_groups]
    bad = (groups < 0) | (groups > 2**31 - 1)
    if bool(bad.any()):
        g = int(torch.nonzero(bad)[0])
        raise HebrusError(f"hebrus::{op}: run_groups[{g}] = {int(groups[g])} is outside [0, 2^31)")
    seen = torch.arange(skip + 1, skip + 1 + t, dtype=torch.int64, device=cells.device)
    zeros = torch.zeros(t, dtype=torch.int64, device=cells.device)
    sel_groups = (groups if n_groups else torch.full((1,), -1, dtype=torch.int64, device=cells.device)).view(1, -1)
    minus_one = torch.full((1,), -1, dtype=torch.int32, device=cells.device)
    return [sel_groups.to(torch.int32), zeros.to(torch.int32), torch.div(seen, r, rounding_mode="floor").to(torch.int32),
            torch.cat((vis.to(torch.int32), minus_one)), seen, zeros.clone(), torch.full_like(zeros, p0),
            zeros.clone()]


def qsa_claim_cells(cell_ref: torch.Tensor, cell_pos: torch.Tensor, unwritten: torch.Tensor, freed: torch.Tensor,
                    start: int, starts: list[int], counts: list[int]) -> tuple[torch.Tensor, ...]:
    """A chunk's cells taken at the QSA allocator's head (issue 37: what ``QSACache.reserve`` writes for a chunk whose
    cells are the range ``[start, start + T)``, T = sum(counts)), in place.

    Args:
        cell_ref: Tensor[C] int32, written: each taken cell's reference count becomes 1.
        cell_pos: Tensor[C] int64, written: the taken cells get the rows' positions in order (row i: ``starts[i]``,
            ``starts[i] + 1``, ... for ``counts[i]`` tokens).
        unwritten: Tensor[L, C] bool, written: the taken cells flagged in every layer.
        freed: Tensor[C] bool, the cells freed in the open transaction (read: none of the taken may be).
        start: the first cell taken; starts, counts: per row of the chunk.

    Returns:
        (cells Tensor[T] int64, positions Tensor[T] int64, cu_seqlens Tensor[B + 1] int32, and the old values for the
        undo log: cell_ref Tensor[T] int32, cell_pos Tensor[T] int64, unwritten Tensor[L, T] bool).

    Raises:
        HebrusError (nothing written) where a cell of the range is referenced or freed in this block.
    """
    total, _ = _validate.qsa_claim_cells(cell_ref, cell_pos, unwritten, freed, start, starts, counts)
    op = "qsa_claim_cells"
    at = slice(start, start + total)
    taken = (cell_ref[at] != 0) | freed[at]
    if bool(taken.any()):
        j = int(torch.nonzero(taken)[0])
        why = "referenced" if int(cell_ref[start + j]) != 0 else "freed in this block"
        raise HebrusError(f"hebrus::{op}: cell {start + j} is not free for the taking ({why})")
    dev = cell_pos.device
    positions = torch.tensor([first + j for first, count in zip(starts, counts) for j in range(count)],
                             dtype=torch.int64, device=dev)
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    old = [cell_ref[at].clone(), cell_pos[at].clone(), unwritten[:, at].clone()]
    cell_ref[at] = 1
    cell_pos[at] = positions
    unwritten[:, at] = True
    return (torch.arange(start, start + total, dtype=torch.int64, device=dev), positions,
            torch.tensor(bounds, dtype=torch.int32, device=dev), *old)

"""Typed wrappers and fake impls for the QSA ops (SPEC §3)."""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import translated


def qsa_pool(keys: torch.Tensor, cell_pos: torch.Tensor, group_cells: torch.Tensor, group_pos: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pooled key of each group; see :func:`hebrus_torch.reference.qsa_pool`.

    Shapes: keys [cells, D], cell_pos [cells] i64, group_cells [G, r] i32, group_pos [G] i64,
    norm_weight [D], inv_freq [R/2] f32 -> pooled [G, D] in keys' dtype. Raises HoleError.
    """
    with translated():
        return torch.ops.hebrus.qsa_pool.default(keys, cell_pos, group_cells, group_pos, norm_weight,
                                                 float(eps), inv_freq)


def qsa_select(q: torch.Tensor, pooled: torch.Tensor, seq_groups: torch.Tensor, q_row: torch.Tensor,
               q_groups: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k groups per query; see :func:`hebrus_torch.reference.qsa_select`.

    Shapes: q [Tq, Hq, D], pooled [rows, D], seq_groups [B, maxG] i32, q_row [Tq] i32,
    q_groups [Tq] i32 -> selected [Tq, top_k] i32 (ascending group indices, -1 padded).
    """
    with translated():
        return torch.ops.hebrus.qsa_select.default(q, pooled, seq_groups, q_row, q_groups, top_k)


def qsa_token_cells(selected: torch.Tensor, nvis: torch.Tensor, first: torch.Tensor, cells: torch.Tensor,
                    r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cells each query attends, from its selected groups, in one dispatch (issue 37); see
    :func:`hebrus_torch.reference.qsa_token_cells`.

    Shapes: selected [Tq, top_k] i32, nvis [Tq] i64, first [Tq] i64, cells [N] i32 -> (token_cells
    [Tq, W] i32, token_offsets [Tq, W] i64), W = top_k * r + r - 1. Raises HebrusError for a selected
    group outside the query's complete groups or a run outside ``cells``.
    """
    with translated():
        return torch.ops.hebrus.qsa_token_cells.default(selected, nvis, first, cells, int(r))


def qsa_plan_one_row(cell_pos: torch.Tensor, run_cells: torch.Tensor, run_groups: torch.Tensor,
                     cells: torch.Tensor, p0: int, start: int, r: int) -> list[torch.Tensor]:
    """The host's selection rows of a one-row chunk in one call (issue 37); see
    :func:`hebrus_torch.reference.qsa_plan_one_row`.

    Shapes: cell_pos [C] i64, run_cells [>= nvis] i64, run_groups [>= nvis // r] i64, cells [T] i64 ->
    [sel_groups [1, max(G, 1)] i32, sel_row [T] i32, q_groups [T] i32, cells32 [nvis + 1] i32, nvis_q [T] i64,
    first [T] i64, q_p0 [T] i64, q_rows [T] i64], nvis = start - p0 + T, G = nvis // r. Raises HoleError.
    """
    with translated():
        return torch.ops.hebrus.qsa_plan_one_row.default(cell_pos, run_cells, run_groups, cells, int(p0), int(start),
                                                         int(r))


def qsa_claim_cells(cell_ref: torch.Tensor, cell_pos: torch.Tensor, unwritten: torch.Tensor, freed: torch.Tensor,
                    start: int, starts: list[int], counts: list[int]) -> tuple[torch.Tensor, ...]:
    """A chunk's cells taken at the QSA allocator's head in one call, in place (issue 37); see
    :func:`hebrus_torch.reference.qsa_claim_cells`.

    Shapes: cell_ref [C] i32, cell_pos [C] i64, unwritten [L, C] bool (written), freed [C] bool -> (cells [T] i64,
    positions [T] i64, cu_seqlens [B + 1] i32, old cell_ref [T] i32, old cell_pos [T] i64, old unwritten [L, T] bool)
    (a tuple), T = sum(counts).
    """
    with translated():
        return torch.ops.hebrus.qsa_claim_cells.default(cell_ref, cell_pos, unwritten, freed, int(start), starts,
                                                        counts)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Qwen4Exp's RMSNorm of every head then transformers' RoPE of its first R dims, in one dispatch (issue 37);
    see :func:`hebrus_torch.reference.rms_norm_rope`.

    Shapes: x [T, H, D] float (any strides), weight [D] float, cos/sin [T, R] in x's dtype -> [T, H, D].
    """
    with translated():
        return torch.ops.hebrus.rms_norm_rope.default(x, weight, float(eps), cos, sin)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention's output gate ``x * sigmoid(gate)`` in one dispatch (issue 37); see
    :func:`hebrus_torch.reference.sigmoid_gate`. Shapes: x, gate [T, H, D] (gate any strides) -> [T, H, D]."""
    with translated():
        return torch.ops.hebrus.sigmoid_gate.default(x, gate)


@torch.library.register_fake("hebrus::qsa_pool")
def _qsa_pool_fake(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq):
    _validate.qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq)
    return keys.new_empty((group_cells.shape[0], keys.shape[1]))


@torch.library.register_fake("hebrus::qsa_select")
def _qsa_select_fake(q, pooled, seq_groups, q_row, q_groups, top_k):
    _validate.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k)
    return q.new_empty((q.shape[0], top_k), dtype=torch.int32)


@torch.library.register_fake("hebrus::qsa_token_cells")
def _qsa_token_cells_fake(selected, nvis, first, cells, r):
    width = _validate.qsa_token_cells(selected, nvis, first, cells, r)
    tq = selected.shape[0]
    return cells.new_empty((tq, width)), nvis.new_empty((tq, width))


@torch.library.register_fake("hebrus::qsa_plan_one_row")
def _qsa_plan_one_row_fake(cell_pos, run_cells, run_groups, cells, p0, start, r):
    nvis, groups = _validate.qsa_plan_one_row(cell_pos, run_cells, run_groups, cells, p0, start, r)
    t = cells.shape[0]
    i32 = dict(dtype=torch.int32)
    return [cells.new_empty((1, max(groups, 1)), **i32), cells.new_empty(t, **i32), cells.new_empty(t, **i32),
            cells.new_empty(nvis + 1, **i32), cells.new_empty(t), cells.new_empty(t), cells.new_empty(t),
            cells.new_empty(t)]


@torch.library.register_fake("hebrus::qsa_claim_cells")
def _qsa_claim_cells_fake(cell_ref, cell_pos, unwritten, freed, start, starts, counts):
    total, layers = _validate.qsa_claim_cells(cell_ref, cell_pos, unwritten, freed, start, starts, counts)
    return (cell_pos.new_empty(total), cell_pos.new_empty(total), cell_ref.new_empty(len(counts) + 1),
            cell_ref.new_empty(total), cell_pos.new_empty(total), unwritten.new_empty((layers, total)))


@torch.library.register_fake("hebrus::rms_norm_rope")
def _rms_norm_rope_fake(x, weight, eps, cos, sin):
    _validate.rms_norm_rope(x, weight, eps, cos, sin)
    return x.new_empty(x.shape)


@torch.library.register_fake("hebrus::sigmoid_gate")
def _sigmoid_gate_fake(x, gate):
    _validate.sigmoid_gate(x, gate)
    return x.new_empty(x.shape)

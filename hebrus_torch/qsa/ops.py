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


@torch.library.register_fake("hebrus::rms_norm_rope")
def _rms_norm_rope_fake(x, weight, eps, cos, sin):
    _validate.rms_norm_rope(x, weight, eps, cos, sin)
    return x.new_empty(x.shape)


@torch.library.register_fake("hebrus::sigmoid_gate")
def _sigmoid_gate_fake(x, gate):
    _validate.sigmoid_gate(x, gate)
    return x.new_empty(x.shape)

"""The reference of ``qsa_attention`` (issue 6): attention of every query over exactly its selected
cells, in blocks of queries."""

from __future__ import annotations

import math

import torch

from .. import _validate
from ..errors import HebrusError
from .checks import assert_values, checks_async
from .hc import hc_rms_norm

__all__ = ["check_token_cells_values", "qsa_attention", "rms_norm_rope", "sigmoid_gate"]


_ATTENTION_BLOCK_BYTES = 64 << 20  # fp32 working set of one block of queries (gathered K/V, scores)


def check_token_cells_values(token_cells: torch.Tensor, cells: int, op: str = "qsa_attention") -> None:
    """Every entry is padding (< 0) or a cell in [0, cells); every query selects at least one cell."""
    idx = token_cells.long()
    valid = idx >= 0
    out_of_range = valid & (idx >= cells)
    if checks_async(token_cells.device):
        assert_values(~out_of_range & valid.any(dim=1, keepdim=True), op,
                      f"every query selects at least one cell and none outside [0, cells={cells})")
        return
    if bool(out_of_range.any()):
        t, i = (int(x) for x in torch.nonzero(out_of_range)[0])
        raise HebrusError(f"hebrus::{op}: query {t} selects cell {int(idx[t, i])} (token_cells[{t}, {i}]), "
                          f"outside [0, cells={cells}); negative entries are padding")
    empty = ~valid.any(dim=1)
    if bool(empty.any()):
        t = int(torch.nonzero(empty)[0])
        raise HebrusError(f"hebrus::{op}: query {t} selects no cell (every entry of token_cells[{t}] is "
                          f"negative padding); attention over an empty selection is undefined")


def qsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_cells: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention of every query over exactly its selected cells (issue 6).

    ``out[t, h] = sum_j softmax_j(scale * q[t, h] . k[c_j, g]) * v[c_j, g]`` over the cells
    ``c_j = token_cells[t, j] >= 0``, with ``g = h // (Hq // Hkv)`` (grouped-query attention), in fp32,
    cast to q's dtype. This equals dense attention over a key layout of all cells with the boolean
    mask "cell is selected by the query" (what transformers computes with the QSA selection mask).

    Args:
        q: Tensor[Tq, Hq, Dh] float32/float16/bfloat16, queries.
        k: Tensor[cells, Hkv, Dh], same dtype, keys of every cell (Hq a multiple of Hkv).
        v: Tensor[cells, Hkv, Dv], same dtype, values of every cell.
        token_cells: Tensor[Tq, W] int32, the selected cells of each query. Every negative entry is
            padding, wherever it appears in the row; the non-negative entries are summed in row
            order. A cell listed twice counts twice (callers list each selected cell once).
        scale: softmax scale, usually ``Dh ** -0.5``.

    Returns:
        Tensor[Tq, Hq, Dv] in q's dtype. Raises HebrusError when an entry is ``>= cells`` or a
        query selects no cell, before anything is computed.
    """
    rep = _validate.qsa_attention(q, k, v, token_cells, scale)
    tq, hq, dh = q.shape
    cells, hkv, dv = v.shape
    out = q.new_empty((tq, hq, dv))
    if tq == 0:
        return out
    check_token_cells_values(token_cells, cells)
    idx = token_cells.long()
    valid = idx >= 0
    width = idx.shape[1]
    per_query = width * hkv * (dh + dv + rep) * 4 + 1
    block = max(1, min(tq, _ATTENTION_BLOCK_BYTES // per_query))
    for start in range(0, tq, block):
        sl = slice(start, min(tq, start + block))
        n = sl.stop - sl.start
        ids = idx[sl].clamp(min=0)
        kk = k[ids].float()                                                  # [n, W, Hkv, Dh]
        # Padding reads cell 0 (clamped); its value rows are zeroed so that an inf or NaN there reaches
        # no query that did not select it (its score is masked to -inf below).
        vv = v[ids].float().masked_fill(~valid[sl][:, :, None, None], 0.0)   # [n, W, Hkv, Dv]
        qq = q[sl].float().reshape(n, hkv, rep, dh)
        scores = torch.einsum("bgrd,bwgd->bgrw", qq, kk) * scale
        scores = scores.masked_fill(~valid[sl][:, None, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out[sl] = torch.einsum("bgrw,bwgd->bgrd", probs, vv).reshape(n, hq, dv).to(q.dtype)
    return out


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Qwen4Exp's RMSNorm of every head, then transformers' RoPE of its first R dims (issue 37): attention's
    ``rope(q_norm(q))``, ``rope(k_norm(k))`` and the indexer's ``rope(q_layernorm(q))`` on packed rows.

    Per token t and head h: ``n = hc_rms_norm(x[t, h], weight, D, eps)`` (rounded to x's dtype), then, as
    transformers' ``apply_rotary_pos_emb`` with cos/sin [T, R] in x's dtype::

        out[t, h, :R] = n[:R] * cos[t] + rotate_half(n[:R]) * sin[t]   (each product and the sum rounded)
        out[t, h, R:] = n[R:]

    Args:
        x: Tensor[T, H, D] float32/float16/bfloat16 (any strides); weight: Tensor[D] (the norm's
            zero-centred weight, any float dtype); eps >= 0; cos, sin: Tensor[T, R] in x's dtype, R even, <= D.

    Returns:
        Tensor[T, H, D] in x's dtype; each (token, head) row depends only on its own inputs.
    """
    _validate.rms_norm_rope(x, weight, eps, cos, sin)
    if x.shape[2] == 0:
        return x.new_empty(x.shape)
    normed = hc_rms_norm(x, weight, x.shape[2], eps)
    r = cos.shape[1]
    rot = normed[..., :r]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((rot, normed[..., r:]), dim=-1)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The indexed attention's output gate (issue 37): ``x * sigmoid(gate)`` as transformers'
    ``Qwen4ExpTextAttention`` computes it (the sigmoid rounded to x's dtype, then the product).

    Args:
        x: Tensor[T, H, D] float32/float16/bfloat16 (the attention's output, token-major);
        gate: Tensor[T, H, D] in x's dtype, any strides (q_proj's gate half).

    Returns:
        Tensor[T, H, D] in x's dtype, contiguous.
    """
    _validate.sigmoid_gate(x, gate)
    return x.contiguous() * torch.sigmoid(gate.contiguous())

"""Typed wrapper and fake impl of hebrus::qsa_attention (issue 6): attention over the QSA selection."""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import translated


def qsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_cells: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """Attention of each query over exactly its selected cells; see :func:`hebrus_torch.reference.qsa_attention`.

    Shapes: q [Tq, Hq, Dh], k [cells, Hkv, Dh], v [cells, Hkv, Dv] (one dtype: float32, float16 or
    bfloat16; Hq a multiple of Hkv), token_cells [Tq, W] int32 (the selected cells of each query;
    every negative entry is padding, wherever it is) -> out [Tq, Hq, Dv] in q's dtype.
    ``scale`` defaults to ``Dh ** -0.5``. Raises HebrusError for a cell ``>= cells`` or a query
    with no selected cell.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5 if q.dim() == 3 and q.shape[-1] > 0 else 1.0
    with translated():
        return torch.ops.hebrus.qsa_attention.default(q, k, v, token_cells, float(scale))


@torch.library.register_fake("hebrus::qsa_attention")
def _qsa_attention_fake(q, k, v, token_cells, scale):
    _validate.qsa_attention(q, k, v, token_cells, scale)
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))

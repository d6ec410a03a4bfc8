"""Typed wrapper and fake impl of ``hebrus::hc_rms_norm``."""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import translated

__all__ = ["hc_rms_norm"]


def hc_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """Qwen4Exp's RMSNorm of every row in one dispatch; see :func:`hebrus_torch.reference.hc_rms_norm`.

    Shapes: x [..., D] float, weight [D] float, ``group_size`` dividing D -> out of x's shape and dtype.
    """
    with translated():
        return torch.ops.hebrus.hc_rms_norm.default(x, weight, group_size, eps)


@torch.library.register_fake("hebrus::hc_rms_norm")
def _hc_rms_norm_fake(x, weight, group_size, eps):
    _validate.hc_rms_norm(x, weight, group_size, eps)
    return x.new_empty(x.shape)

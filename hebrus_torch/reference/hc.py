"""Reference of the fused hyper-connection ops (issue 37): what transformers' Qwen4Exp modules compute,
op for op, so the CPU kernel (the same ATen sequence in C++) gives the modules' bits."""

from __future__ import annotations

import torch

from .. import _validate


def hc_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """Qwen4Exp's RMSNorm (``Qwen4ExpTextRMSNorm``: zero-centred weight, optional groups) of every row.

    Per row of x (every index of its leading dims) and per group of ``group_size`` consecutive features, in fp32::

        out = (x * rsqrt(mean(x ** 2) + eps)) * (1 + weight), rounded to x's dtype

    with ``mean`` and ``rsqrt`` torch's (the module's ``x.pow(2).mean(-1, keepdim=True)``). The
    hyper-connections' ``hc_norm`` has ``group_size`` = hidden size over ``hc * hidden`` features; an
    ungrouped norm has ``group_size`` = D. A row's output depends only on that row.

    Args:
        x: Tensor[..., D] float32/float16/bfloat16 (any strides).
        weight: Tensor[D] float32/float16/bfloat16 (the module's zero-centred weight).
        group_size: a divisor of D, >= 1.
        eps: >= 0.

    Returns:
        Tensor of x's shape in x's dtype. Raises HebrusError on bad metadata.
    """
    rows, dim = _validate.hc_rms_norm(x, weight, group_size, eps)
    xf = x.float().reshape(rows, dim // group_size, group_size)
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (out * (1.0 + weight.float())).to(x.dtype).view(x.shape)

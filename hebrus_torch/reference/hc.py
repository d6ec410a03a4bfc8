"""Reference of the fused hyper-connection ops (issue 37): what transformers' Qwen4Exp modules compute,
op for op (the CPU kernels compute the same formulas in hebrus's own row arithmetic, within a tolerance of these:
docs/engine.md, "The CPU fused ops' arithmetic")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _validate
from .moe import quantized_linear


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


def hc_premix(h: torch.Tensor, norm_weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
              inject: torch.Tensor | None, hc_count: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The hyper-connection pre-mix of a decoder layer (transformers' ``Qwen4ExpTextGatedResidual``) over
    packed rows, op for op in h's dtype (each op rounds to it, as the module's)::

        normed = hc_rms_norm(h, norm_weight, hidden, eps)                 # [T, hc * hidden]
        s      = silu((normed @ down.T) / hc_count)                       # [T, R]
        w      = sigmoid(s @ up.T)                                        # [T, hc * hidden]
        mixed  = mean over the hc streams of w * normed                   # [T, hidden]
        inj    = 2 * sigmoid((normed @ inject.T) / hc_count)              # [T, hc]; [T, 0] without inject

    A row's outputs depend only on that row.

    Args:
        h: Tensor[T, hc_count * hidden] float32/float16/bfloat16 (the streams).
        norm_weight: Tensor[hc_count * hidden] float (``hc_norm``'s zero-centred weight).
        down: Tensor[R, hc_count * hidden] of h's dtype (``input_mix_weight_down.weight``).
        up: Tensor[hc_count * hidden, R] of h's dtype (``input_mix_weight_up.weight``).
        inject: Tensor[hc_count, hc_count * hidden] of h's dtype (``block_inject_weight.weight``) or None.
        hc_count: the number of streams, dividing h's features.
        eps: ``hc_norm``'s eps, >= 0.

    Returns:
        (mixed Tensor[T, hidden], injection weights Tensor[T, hc_count] or Tensor[T, 0]), h's dtype.
        Raises HebrusError on bad metadata.
    """
    rows, hidden, _ = _validate.hc_premix(h, norm_weight, down, up, inject, hc_count, eps)
    normed = hc_rms_norm(h, norm_weight, hidden, eps)
    weight = torch.sigmoid(F.linear(F.silu(F.linear(normed, down) / hc_count), up))
    mixed = (weight.unflatten(-1, (hc_count, hidden)) * normed.unflatten(-1, (hc_count, hidden))).mean(dim=-2)
    if inject is None:
        return mixed, h.new_empty(rows, 0)
    return mixed, 2 * torch.sigmoid(F.linear(normed, inject) / hc_count)


def hc_premix_quantized(h: torch.Tensor, norm_weight: torch.Tensor, down_q: torch.Tensor, down_scales: torch.Tensor,
                        down_biases: torch.Tensor, up_q: torch.Tensor, up_scales: torch.Tensor, up_biases: torch.Tensor,
                        inject_q: torch.Tensor | None, inject_scales: torch.Tensor | None,
                        inject_biases: torch.Tensor | None, hc_count: int, eps: float, group_size: int,
                        bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hc_premix` with its three projections affine-quantized (:mod:`hebrus_torch.moe.quantize`; one
    ``group_size`` and ``bits`` for all): each ``F.linear`` of :func:`hc_premix` becomes
    :func:`hebrus_torch.reference.quantized_linear` (the group-folded product ``s * sum(q x) + b * sum(x)`` in
    fp32, rounded to h's dtype), every other op as in :func:`hc_premix`. The module path of a
    ``Qwen4ExpTextGatedResidual`` whose projections are ``QuantizedLinear`` (the CPU kernel matches it within a
    tolerance). A row's outputs depend only on that row.

    Args:
        h, norm_weight, hc_count, eps: as :func:`hc_premix`.
        down_q / down_scales / down_biases: ``input_mix_weight_down`` quantized, W [R, D]: Tensor[R, D * bits / 32]
            int32 and Tensor[R, D / group_size] of h's dtype (twice).
        up_q / up_scales / up_biases: ``input_mix_weight_up`` quantized, W [D, R] (R a multiple of group_size).
        inject_q / inject_scales / inject_biases: ``block_inject_weight`` quantized, W [hc_count, D], or all None.
        group_size: 32, 64 or 128. bits: 4 or 8.

    Returns:
        (mixed Tensor[T, hidden], injection weights Tensor[T, hc_count] or Tensor[T, 0]), h's dtype.
        Raises HebrusError on bad metadata.
    """
    rows, hidden, _ = _validate.hc_premix_quantized(h, norm_weight, down_q, down_scales, down_biases, up_q, up_scales,
                                                    up_biases, inject_q, inject_scales, inject_biases, hc_count, eps,
                                                    group_size, bits)
    normed = hc_rms_norm(h, norm_weight, hidden, eps)
    low = F.silu(quantized_linear(normed, down_q, down_scales, down_biases, group_size, bits) / hc_count)
    weight = torch.sigmoid(quantized_linear(low, up_q, up_scales, up_biases, group_size, bits))
    mixed = (weight.unflatten(-1, (hc_count, hidden)) * normed.unflatten(-1, (hc_count, hidden))).mean(dim=-2)
    if inject_q is None:
        return mixed, h.new_empty(rows, 0)
    inject = quantized_linear(normed, inject_q, inject_scales, inject_biases, group_size, bits)
    return mixed, 2 * torch.sigmoid(inject / hc_count)


def hc_post_combine(hyper: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """A sublayer's output added back into every hyper-connection stream (the decoder layer's
    ``hyper_input + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)``)::

        result[t, c * hidden + j] = hyper[t, c * hidden + j] + (out[t, j] * inject[t, c])

    with the product rounded to the dtype before the sum, as the module's two ops.

    Args:
        hyper: Tensor[T, hc * hidden] float32/float16/bfloat16.
        out: Tensor[T, hidden] of hyper's dtype.
        inject: Tensor[T, hc] of hyper's dtype.

    Returns:
        Tensor[T, hc * hidden] of hyper's dtype. Raises HebrusError on bad metadata.
    """
    _validate.hc_post_combine(hyper, out, inject)
    return hyper + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)

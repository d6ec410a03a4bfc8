"""Typed wrappers and fake impls of ``hebrus::hc_rms_norm``, ``hebrus::hc_premix``, ``hebrus::hc_premix_quantized``
and ``hebrus::hc_post_combine``."""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import translated

__all__ = ["hc_rms_norm", "hc_premix", "hc_premix_quantized", "hc_post_combine"]


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


def hc_premix(h: torch.Tensor, norm_weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
              inject: torch.Tensor | None, hc_count: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The hyper-connection pre-mix of packed rows in one dispatch; see :func:`hebrus_torch.reference.hc_premix`.

    Shapes: h [T, hc_count * hidden] float, norm_weight [hc_count * hidden] float, down [R, hc_count * hidden]
    and up [hc_count * hidden, R] of h's dtype, inject [hc_count, hc_count * hidden] of h's dtype or None
    -> (mixed [T, hidden], injection weights [T, hc_count], or [T, 0] without inject), h's dtype.
    """
    with translated():
        return torch.ops.hebrus.hc_premix.default(h, norm_weight, down, up, inject, hc_count, eps)


def hc_premix_quantized(h: torch.Tensor, norm_weight: torch.Tensor, down_q: torch.Tensor, down_scales: torch.Tensor,
                        down_biases: torch.Tensor, up_q: torch.Tensor, up_scales: torch.Tensor, up_biases: torch.Tensor,
                        inject_q: torch.Tensor | None, inject_scales: torch.Tensor | None,
                        inject_biases: torch.Tensor | None, hc_count: int, eps: float, group_size: int,
                        bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The hyper-connection pre-mix with affine-quantized projections in one dispatch; see
    :func:`hebrus_torch.reference.hc_premix_quantized`.

    Shapes: h [T, D = hc_count * hidden] float, norm_weight [D] float; down W [R, D], up W [D, R] and inject
    W [hc_count, D] (or all three None) each as codes Tensor[out, in * bits / 32] int32 and scales / biases
    Tensor[out, in / group_size] of h's dtype; group_size 32, 64 or 128 dividing D and R; bits 4 or 8
    -> (mixed [T, hidden], injection weights [T, hc_count], or [T, 0] without inject), h's dtype.
    """
    with translated():
        return torch.ops.hebrus.hc_premix_quantized.default(h, norm_weight, down_q, down_scales, down_biases, up_q,
                                                            up_scales, up_biases, inject_q, inject_scales,
                                                            inject_biases, hc_count, eps, group_size, bits)


def hc_post_combine(hyper: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """``hyper + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)`` in one dispatch; see
    :func:`hebrus_torch.reference.hc_post_combine`.

    Shapes: hyper [T, hc * hidden], out [T, hidden], inject [T, hc], one float dtype -> [T, hc * hidden].
    """
    with translated():
        return torch.ops.hebrus.hc_post_combine.default(hyper, out, inject)


@torch.library.register_fake("hebrus::hc_premix")
def _hc_premix_fake(h, norm_weight, down, up, inject, hc_count, eps):
    rows, hidden, _ = _validate.hc_premix(h, norm_weight, down, up, inject, hc_count, eps)
    return h.new_empty(rows, hidden), h.new_empty(rows, hc_count if inject is not None else 0)


@torch.library.register_fake("hebrus::hc_premix_quantized")
def _hc_premix_quantized_fake(h, norm_weight, down_q, down_scales, down_biases, up_q, up_scales, up_biases, inject_q,
                              inject_scales, inject_biases, hc_count, eps, group_size, bits):
    rows, hidden, _ = _validate.hc_premix_quantized(h, norm_weight, down_q, down_scales, down_biases, up_q, up_scales,
                                                    up_biases, inject_q, inject_scales, inject_biases, hc_count, eps,
                                                    group_size, bits)
    return h.new_empty(rows, hidden), h.new_empty(rows, hc_count if inject_q is not None else 0)


@torch.library.register_fake("hebrus::hc_post_combine")
def _hc_post_combine_fake(hyper, out, inject):
    _validate.hc_post_combine(hyper, out, inject)
    return hyper.new_empty(hyper.shape)

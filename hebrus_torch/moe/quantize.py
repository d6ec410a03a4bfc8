"""Affine group quantization of weight matrices, with MLX's semantics (``mlx.core.quantize`` mode "affine").

A matrix ``w [..., out, in]`` is cut along its input dimension into groups of ``group_size`` (32, 64 or 128)
consecutive values; each group gets a scale ``s`` and a bias ``b`` and each value a ``bits``-bit code
``q`` in ``[0, 2**bits - 1]`` (4 or 8 bits), with ``w ~ s * q + b``. How a group is rounded (MLX's
``affine_quantize``), in fp32 from ``w``'s values:

- ``n = 2**bits - 1``; ``lo, hi`` the group's minimum and maximum;
- ``delta = max((hi - lo) / n, 1e-7)``; the edge is the endpoint of larger magnitude: ``lo`` (scale
  ``+delta``) when ``|lo| > |hi|``, else ``hi`` (scale ``-delta``);
- ``q0 = rint(edge / scale)``; where ``q0 != 0`` the scale becomes ``edge / q0`` and the bias ``edge``
  (so the edge is represented exactly), else the bias is 0;
- each code is ``q = clamp(rint((w - b) / s), 0, n)`` with the fp32 scale and bias (``rint``: to nearest, ties
  to even); only then are scale and bias rounded to the storage dtype (the weight's). For bf16 / fp16 weights
  this is what makes the codes MLX's bit for bit (checked against ``mx.quantize``).

Codes are packed little-end first into 32-bit words (``32 / bits`` per word: code ``k`` of a word in bits
``[k * bits, (k + 1) * bits)``), stored as int32 (torch has no general uint32 support); a row of ``in``
values is ``in * bits / 32`` words. Dequantized, a weight is ``q * s + b`` in fp32; the quantized kernels never
dequantize: they fold each group's scale and bias into its dot product, ``s * sum(q x) + b * sum(x)``
(docs/quantization.md says in which order).
"""

from __future__ import annotations

import torch

from ..errors import HebrusError

__all__ = ["BITS", "GROUP_SIZES", "quantize", "dequantize", "check_quant_options"]

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def check_quant_options(bits: int, group_size: int, in_dim: int | None = None, op: str = "quantize") -> None:
    """``bits`` in (4, 8), ``group_size`` in (32, 64, 128) and dividing ``in_dim``; else HebrusError."""
    if bits not in BITS:
        raise HebrusError(f"hebrus::{op}: bits must be 4 or 8, got {bits}")
    if group_size not in GROUP_SIZES:
        raise HebrusError(f"hebrus::{op}: group_size must be 32, 64 or 128, got {group_size}")
    if in_dim is not None and in_dim % group_size != 0:
        raise HebrusError(f"hebrus::{op}: the input dimension {in_dim} is not a multiple of group_size {group_size}")


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine group quantization of ``w`` along its last dimension (module docstring).

    Args:
        w: Tensor[..., in] float32/float16/bfloat16, ``in`` a multiple of ``group_size``.
        bits: 4 or 8. group_size: 32, 64 or 128.

    Returns:
        ``(wq, scales, biases)``: wq Tensor[..., in * bits / 32] int32 (packed codes), scales and biases
        Tensor[..., in / group_size] in w's dtype.
    """
    check_quant_options(bits, group_size, w.shape[-1])
    if not w.is_floating_point() or w.dtype == torch.float64:
        raise HebrusError(f"hebrus::quantize: w must be float32, float16 or bfloat16, got {w.dtype}")
    n_bins = float((1 << bits) - 1)
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    delta = torch.clamp((hi - lo) / n_bins, min=1e-7)
    use_lo = lo.abs() > hi.abs()
    scale = torch.where(use_lo, delta, -delta)
    edge = torch.where(use_lo, lo, hi)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, 1.0), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    scales, biases = scale.to(w.dtype), bias.to(w.dtype)
    q = torch.round((groups - bias[..., None]) / scale[..., None]).clamp_(0, n_bins)
    codes = q.to(torch.int64).reshape(*w.shape[:-1], -1, 32 // bits)
    shifts = torch.arange(32 // bits, dtype=torch.int64) * bits
    words = (codes << shifts).sum(-1)                                    # < 2**32: fits int64
    wq = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return wq, scales, biases


def unpack(wq: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of packed words: Tensor[..., words] int32 -> Tensor[..., words * 32 / bits] int64."""
    shifts = torch.arange(32 // bits, dtype=torch.int64, device=wq.device) * bits
    words = wq.to(torch.int64) & 0xFFFFFFFF
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def dequantize(wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """``q * s + b`` in fp32 for every value: Tensor[..., in] float32 (in = words * 32 / bits)."""
    check_quant_options(bits, group_size, op="dequantize")
    q = unpack(wq, bits).float()
    q = q.reshape(*q.shape[:-1], -1, group_size)
    return (q * scales.float()[..., None] + biases.float()[..., None]).flatten(-2)

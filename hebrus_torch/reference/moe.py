"""The references of ``moe_experts`` and ``moe_experts_quantized`` (issue 36): the routed experts of a MoE
block over packed rows."""

from __future__ import annotations

from typing import Callable

import torch

from ..moe.checks import (MoeSizes, check_moe_experts, check_moe_experts_quantized, check_moe_ids,
                          check_quantized_linear)
from ..moe.quantize import dequantize
from .ple import _silu

__all__ = ["moe_experts", "moe_experts_quantized", "quantized_linear"]


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values rounded to ``dtype`` (nearest even) and widened back."""
    return t.to(dtype).float()


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """The SiLU-gated expert MLPs of every (row, slot) pair, weighted and summed per row.

    For row ``t`` and slot ``j`` with ``e = topk_ids[t, j]``, ``w = topk_weights[t, j]`` and ``D`` x's dtype,
    in fp32 with the results rounded to ``D`` where transformers' grouped_mm experts round them::

        g, u = round_D(gate_up[e, :I] x_t), round_D(gate_up[e, I:] x_t)
        a    = round_D(round_D(silu(g)) * u)
        y    = round_D(down[e] a)
        p_j  = y * w, rounded to D where topk_weights has dtype D (else kept in fp32)
        out[t] = round_D(((0 + p_0) + p_1) + ... + p_{k-1})      (fp32, slot order)

    ``silu`` is the CPU kernels' (``reference._silu``). A row's output depends only on its own inputs.
    The matrix products here are torch's (their summation order is not the kernel's), so this reference
    matches the kernels to rounding, not bitwise.

    Args:
        x: Tensor[T, H] float32/float16/bfloat16, the packed rows.
        topk_ids: Tensor[T, k] int64/int32, each row's experts, every id in ``[0, E)``.
        topk_weights: Tensor[T, k] float32/float16/bfloat16, their router weights.
        gate_up: Tensor[E, 2I, H] in x's dtype: each expert's gate rows, then its up rows
            (transformers' fused ``gate_up_proj``).
        down: Tensor[E, H, I] in x's dtype (``down_proj``).

    Returns:
        Tensor[T, H] in x's dtype. Raises HebrusError on bad metadata or an expert id outside ``[0, E)``.
    """
    sizes = check_moe_experts(x, topk_ids, topk_weights, gate_up, down)
    return _routed(x, topk_ids, topk_weights, sizes, lambda e: gate_up[e].float(), lambda e: down[e].float())


def moe_experts_quantized(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          gate_up_q: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_biases: torch.Tensor,
                          down_q: torch.Tensor, down_scales: torch.Tensor, down_biases: torch.Tensor, group_size: int,
                          bits: int) -> torch.Tensor:
    """:func:`moe_experts` with the experts' weights affine-quantized (:mod:`hebrus_torch.moe.quantize`):
    every weight is its dequantized fp32 value ``q * s + b``, everything else as :func:`moe_experts`.

    Args:
        x, topk_ids, topk_weights: as :func:`moe_experts`; H and I multiples of ``group_size``.
        gate_up_q: Tensor[E, 2I, H * bits / 32] int32, packed codes; gate_up_scales, gate_up_biases:
            Tensor[E, 2I, H / group_size] in x's dtype.
        down_q: Tensor[E, H, I * bits / 32] int32; down_scales, down_biases: Tensor[E, H, I / group_size].
        group_size: 32, 64 or 128. bits: 4 or 8.

    Returns:
        Tensor[T, H] in x's dtype.
    """
    sizes = check_moe_experts_quantized(x, topk_ids, topk_weights, gate_up_q, gate_up_scales, gate_up_biases, down_q,
                                        down_scales, down_biases, group_size, bits)
    return _routed(x, topk_ids, topk_weights, sizes,
                   lambda e: dequantize(gate_up_q[e], gate_up_scales[e], gate_up_biases[e], bits, group_size),
                   lambda e: dequantize(down_q[e], down_scales[e], down_biases[e], bits, group_size))


def quantized_linear(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
                     bits: int) -> torch.Tensor:
    """``x @ W.T`` with ``W`` affine-quantized (:mod:`hebrus_torch.moe.quantize`): every weight its dequantized
    fp32 value ``q * s + b``, the products summed in fp32 and the result rounded to x's dtype. The matrix
    product is torch's, so this matches the kernels to rounding, not bitwise.

    Args:
        x: Tensor[T, in] float32/float16/bfloat16; ``in`` a multiple of ``group_size``.
        wq: Tensor[out, in * bits / 32] int32, packed codes; scales, biases: Tensor[out, in / group_size] in
            x's dtype.
        group_size: 32, 64 or 128. bits: 4 or 8.

    Returns:
        Tensor[T, out] in x's dtype.
    """
    check_quantized_linear(x, wq, scales, biases, group_size, bits)
    return (x.float() @ dequantize(wq, scales, biases, bits, group_size).T).to(x.dtype)


def _routed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, sizes: MoeSizes,
            gate_up_of: Callable[[int], torch.Tensor], down_of: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The experts' sum of :func:`moe_experts`, with expert e's weights as fp32 ``gate_up_of(e)`` [2I, H] and
    ``down_of(e)`` [H, I]."""
    rows, hidden, top_k, experts, inter = sizes
    out = x.new_empty((rows, hidden))
    if rows == 0 or hidden == 0:
        return out
    if top_k == 0:
        return out.zero_()
    check_moe_ids(topk_ids, experts)
    dtype = x.dtype
    round_product = topk_weights.dtype == dtype
    ids = topk_ids.long().reshape(-1)
    weights = topk_weights.float().reshape(-1)
    weighted = torch.zeros(rows * top_k, hidden, dtype=torch.float32, device=x.device)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts).tolist()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        xs = x[pairs // top_k].float()
        gu = _round(xs @ gate_up_of(expert).T, dtype)
        act = _round(_round(_silu(gu[:, :inter]), dtype) * gu[:, inter:], dtype)
        y = _round(act @ down_of(expert).T, dtype)
        prod = y * weights[pairs, None]
        weighted[pairs] = _round(prod, dtype) if round_product else prod
    weighted = weighted.view(rows, top_k, hidden)
    acc = torch.zeros(rows, hidden, dtype=torch.float32, device=x.device)
    for j in range(top_k):
        acc = acc + weighted[:, j]
    return out.copy_(acc)

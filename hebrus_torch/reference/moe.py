"""The references of ``moe_experts`` and ``moe_experts_quantized`` (issue 36): the routed experts of a MoE
block over packed rows."""

from __future__ import annotations

from typing import Callable

import torch

from ..moe.checks import (MoeSizes, check_moe_experts, check_moe_experts_quantized, check_moe_ids,
                          check_moe_route, check_moe_shared_expert, check_moe_shared_expert_quantized,
                          check_quantized_linear)
from ..moe.quantize import unpack
from .ple import _silu

__all__ = ["moe_experts", "moe_experts_quantized", "quantized_linear", "moe_route", "moe_shared_expert",
           "moe_shared_expert_quantized"]


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
    return _routed(x, topk_ids, topk_weights, sizes, lambda e, xs: xs @ gate_up[e].float().T,
                   lambda e, xs: xs @ down[e].float().T)


def moe_experts_quantized(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          gate_up_q: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_biases: torch.Tensor,
                          down_q: torch.Tensor, down_scales: torch.Tensor, down_biases: torch.Tensor, group_size: int,
                          bits: int) -> torch.Tensor:
    """:func:`moe_experts` with the experts' weights affine-quantized (:mod:`hebrus_torch.moe.quantize`), each
    matrix product folded per group (:func:`folded_matmul`), everything else as :func:`moe_experts`.

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
                   lambda e, xs: folded_matmul(xs, gate_up_q[e], gate_up_scales[e], gate_up_biases[e], bits,
                                               group_size),
                   lambda e, xs: folded_matmul(xs, down_q[e], down_scales[e], down_biases[e], bits, group_size))


def folded_matmul(xs: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
                  group_size: int) -> torch.Tensor:
    """``xs @ W.T`` for a quantized ``W [out, in]`` without dequantizing it, as MLX's qmv and the kernels do:
    per group ``g``, ``s_g * sum(q * x) + b_g * sum(x)``, summed over the groups (fp32).

    xs: Tensor[n, in] float32 -> Tensor[n, out] float32. The sums are torch's, not the kernels' order.
    """
    out_dim = wq.shape[0]
    q = unpack(wq, bits).float().reshape(out_dim, -1, group_size)              # [out, G, group]
    xg = xs.reshape(xs.shape[0], -1, group_size)                              # [n, G, group]
    qx = torch.einsum("ngk,ogk->nog", xg, q)                                  # [n, out, G]
    return (qx * scales.float() + xg.sum(-1)[:, None, :] * biases.float()).sum(-1)


def quantized_linear(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
                     bits: int) -> torch.Tensor:
    """``x @ W.T`` with ``W`` affine-quantized (:mod:`hebrus_torch.moe.quantize`), folded per group
    (:func:`folded_matmul`: ``s * sum(q x) + b * sum(x)``) in fp32 and rounded to x's dtype. The sums are
    torch's, so this matches the kernels to rounding, not bitwise.

    Args:
        x: Tensor[T, in] float32/float16/bfloat16; ``in`` a multiple of ``group_size``.
        wq: Tensor[out, in * bits / 32] int32, packed codes; scales, biases: Tensor[out, in / group_size] in
            x's dtype.
        group_size: 32, 64 or 128. bits: 4 or 8.

    Returns:
        Tensor[T, out] in x's dtype.
    """
    check_quantized_linear(x, wq, scales, biases, group_size, bits)
    if x.shape[0] == 0 or wq.shape[0] == 0:
        return x.new_zeros((x.shape[0], wq.shape[0]))
    return folded_matmul(x.float(), wq, scales, biases, bits, group_size).to(x.dtype)


def _routed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, sizes: MoeSizes,
            gate_up_mm: Callable[[int, torch.Tensor], torch.Tensor],
            down_mm: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The experts' sum of :func:`moe_experts`, with ``gate_up_mm(e, xs)`` = xs [n, H] times expert e's gate_up
    [2I, H] transposed and ``down_mm(e, a)`` = a [n, I] times its down [H, I] transposed (fp32)."""
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
        gu = _round(gate_up_mm(expert, xs), dtype)
        act = _round(_round(_silu(gu[:, :inter]), dtype) * gu[:, inter:], dtype)
        y = _round(down_mm(expert, act), dtype)
        prod = y * weights[pairs, None]
        weighted[pairs] = _round(prod, dtype) if round_product else prod
    weighted = weighted.view(rows, top_k, hidden)
    acc = torch.zeros(rows, hidden, dtype=torch.float32, device=x.device)
    for j in range(top_k):
        acc = acc + weighted[:, j]
    return out.copy_(acc)


def moe_route(router_logits: torch.Tensor, shared_gate_logits: torch.Tensor | None, top_k: int,
              norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE block's router after its linear, and the shared expert's sigmoid gate (issue 37): transformers'
    ``Qwen4ExpTextTopKRouter.forward`` from ``router_logits`` on, op for op::

        p          = softmax(router_logits.float(), dim=-1)            (fp32)
        v, ids     = topk(p, top_k)                                     (descending)
        v          = v / v.sum(-1)          where norm_topk_prob
        weights    = cat(v.to(D), sigmoid(shared_gate_logits))          (D: the logits' dtype)

    Among equal probabilities the order is torch.topk's here and in the CPU kernel (which runs these ops up to
    the cast: the module's bits; the shared gate's sigmoid is hebrus's own row arithmetic there); the Metal
    kernel takes the lower expert id first. A row's outputs depend only on that row.

    Args:
        router_logits: Tensor[T, E] float32/float16/bfloat16 (the router's linear of the rows).
        shared_gate_logits: Tensor[T, S] in the logits' dtype (``shared_expert_gate``'s output), or None.
        top_k: 1 <= top_k <= E.
        norm_topk_prob: renormalise the top-k probabilities to sum to 1 (the config's ``norm_topk_prob``).

    Returns:
        (ids Tensor[T, k] int64, weights Tensor[T, k + S] in the logits' dtype: the routed experts' weights,
        then the S shared-expert gates). Raises HebrusError on bad metadata.
    """
    check_moe_route(router_logits, shared_gate_logits, top_k)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    values, ids = torch.topk(probs, top_k, dim=-1)
    return ids, route_weights(values, router_logits.dtype, shared_gate_logits, norm_topk_prob)


def route_weights(values: torch.Tensor, dtype: torch.dtype, shared_gate_logits: torch.Tensor | None,
                  norm_topk_prob: bool) -> torch.Tensor:
    """:func:`moe_route`'s weights [T, k + S] from the selected probabilities ``values`` [T, k] (fp32): renormalised
    where ``norm_topk_prob``, cast to ``dtype``, then the sigmoid of the shared gate logits (if any)."""
    if norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    weights = values.to(dtype)
    if shared_gate_logits is not None:
        weights = torch.cat([weights, torch.sigmoid(shared_gate_logits)], dim=1)
    return weights


def moe_shared_expert(x: torch.Tensor, routed: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                      down_proj: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A MoE block's shared expert times its gate, added to the routed experts' output (issue 37): the tail of
    transformers' ``Qwen4ExpTextSparseMoeBlock.forward``, op for op (D: x's dtype, every op rounding to D)::

        shared = linear(silu(linear(x, gate_proj)) * linear(x, up_proj), down_proj)   (Qwen4ExpTextMLP)
        out    = routed + gate * shared

    The CPU kernel runs the products as ATen's mm and the rest in hebrus's own row arithmetic (fp32, rounded where
    these ops round: within a tolerance of them); the Metal kernel rounds at the same places as these ops with its
    own summation order inside each dot product (moe_experts.metal's) and the CPU kernels' silu. A row's output
    depends only on that row.

    Args:
        x: Tensor[T, H] float32/float16/bfloat16, the packed rows.
        routed: Tensor[T, H] in x's dtype (``moe_experts``' output).
        gate_proj, up_proj: Tensor[I, H] in x's dtype; down_proj: Tensor[H, I] (the shared expert's
            ``nn.Linear`` weights), I >= 1.
        gate: Tensor[T, 1] in x's dtype, ``sigmoid(shared_expert_gate(x))`` (``moe_route``'s last column).

    Returns:
        Tensor[T, H] in x's dtype. Raises HebrusError on bad metadata.
    """
    check_moe_shared_expert(x, routed, gate_proj, up_proj, down_proj, gate)
    F = torch.nn.functional
    shared = F.linear(F.silu(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj)
    return routed + gate * shared


def moe_shared_expert_quantized(x: torch.Tensor, routed: torch.Tensor, gate_proj_q: torch.Tensor,
                                gate_proj_scales: torch.Tensor, gate_proj_biases: torch.Tensor, up_proj_q: torch.Tensor,
                                up_proj_scales: torch.Tensor, up_proj_biases: torch.Tensor, down_proj_q: torch.Tensor,
                                down_proj_scales: torch.Tensor, down_proj_biases: torch.Tensor, gate: torch.Tensor,
                                group_size: int, bits: int) -> torch.Tensor:
    """:func:`moe_shared_expert` with its three projections affine-quantized (issue 37): the shared expert of a
    converted model, whose ``gate_proj`` / ``up_proj`` / ``down_proj`` are ``QuantizedLinear`` modules
    (:mod:`hebrus_torch.moe.quantize`'s format, one ``group_size`` / ``bits`` for all three), op for op::

        shared = ql(silu(ql(x, gate_proj)) * ql(x, up_proj), down_proj)    (ql: :func:`quantized_linear`)
        out    = routed + gate * shared

    The CPU kernel runs ``hebrus::quantized_linear``'s CPU kernel for each ``ql`` and the rest in hebrus's own row
    arithmetic (within a tolerance of these ops); the Metal kernel rounds at the same places, its dot products folded
    as quantized_linear's Metal kernel folds them, with the CPU kernels' silu. A row's output depends only on that row.

    Args:
        x: Tensor[T, H] float32/float16/bfloat16; routed: Tensor[T, H] in x's dtype.
        gate_proj_q, up_proj_q: Tensor[I, H * bits / 32] int32; their scales / biases Tensor[I, H / group_size].
        down_proj_q: Tensor[H, I * bits / 32] int32; its scales / biases Tensor[H, I / group_size]. Scales and
            biases in x's dtype; H and I >= 1 multiples of ``group_size``.
        gate: Tensor[T, 1] in x's dtype. group_size: 32, 64 or 128. bits: 4 or 8.

    Returns:
        Tensor[T, H] in x's dtype. Raises HebrusError on bad metadata.
    """
    check_moe_shared_expert_quantized(x, routed, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q,
                                      up_proj_scales, up_proj_biases, down_proj_q, down_proj_scales, down_proj_biases,
                                      gate, group_size, bits)

    def ql(v, q, scales, biases):
        return quantized_linear(v, q, scales, biases, group_size, bits)

    act = torch.nn.functional.silu(ql(x, gate_proj_q, gate_proj_scales, gate_proj_biases))
    act = act * ql(x, up_proj_q, up_proj_scales, up_proj_biases)
    return routed + gate * ql(act, down_proj_q, down_proj_scales, down_proj_biases)

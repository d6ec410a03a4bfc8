"""Typed wrappers and fake impls of ``hebrus::moe_experts``, ``moe_experts_quantized``, ``quantized_linear``,
``moe_route``, ``moe_shared_expert`` and ``moe_shared_expert_quantized``."""

from __future__ import annotations

import torch

from ..errors import translated
from .checks import (check_moe_experts, check_moe_experts_quantized, check_moe_route, check_moe_shared_expert,
                     check_moe_shared_expert_quantized, check_quantized_linear)

__all__ = ["moe_experts", "moe_experts_quantized", "quantized_linear", "moe_route", "moe_shared_expert",
           "moe_shared_expert_quantized"]


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """The routed experts of a MoE block over packed rows; see :func:`hebrus_torch.reference.moe_experts`.

    Shapes: x [T, H], topk_ids [T, k] i64/i32, topk_weights [T, k] float, gate_up [E, 2I, H] and
    down [E, H, I] in x's dtype -> out [T, H] in x's dtype. Raises HebrusError on an expert id outside [0, E).
    """
    with translated():
        return torch.ops.hebrus.moe_experts.default(x, topk_ids, topk_weights, gate_up, down)


@torch.library.register_fake("hebrus::moe_experts")
def _moe_experts_fake(x, topk_ids, topk_weights, gate_up, down):
    check_moe_experts(x, topk_ids, topk_weights, gate_up, down)
    return x.new_empty(x.shape)


def moe_experts_quantized(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          gate_up_q: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_biases: torch.Tensor,
                          down_q: torch.Tensor, down_scales: torch.Tensor, down_biases: torch.Tensor, group_size: int,
                          bits: int) -> torch.Tensor:
    """:func:`moe_experts` over affine-quantized experts (:mod:`hebrus_torch.moe.quantize`); see
    :func:`hebrus_torch.reference.moe_experts_quantized`.

    Shapes: gate_up_q [E, 2I, H * bits / 32] i32, gate_up_scales / _biases [E, 2I, H / group_size], down_q
    [E, H, I * bits / 32] i32, down_scales / _biases [E, H, I / group_size] (scales and biases in x's dtype).
    """
    with translated():
        return torch.ops.hebrus.moe_experts_quantized.default(x, topk_ids, topk_weights, gate_up_q, gate_up_scales,
                                                              gate_up_biases, down_q, down_scales, down_biases,
                                                              int(group_size), int(bits))


@torch.library.register_fake("hebrus::moe_experts_quantized")
def _moe_experts_quantized_fake(x, topk_ids, topk_weights, gate_up_q, gate_up_scales, gate_up_biases, down_q,
                                down_scales, down_biases, group_size, bits):
    check_moe_experts_quantized(x, topk_ids, topk_weights, gate_up_q, gate_up_scales, gate_up_biases, down_q,
                                down_scales, down_biases, group_size, bits)
    return x.new_empty(x.shape)


def quantized_linear(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
                     bits: int) -> torch.Tensor:
    """``x @ dequantize(W).T``; see :func:`hebrus_torch.reference.quantized_linear`.

    Shapes: x [T, in] float, wq [out, in * bits / 32] int32, scales / biases [out, in / group_size] in x's dtype
    -> [T, out] in x's dtype. Each output row depends only on its own row of x (bitwise).
    """
    with translated():
        return torch.ops.hebrus.quantized_linear.default(x, wq, scales, biases, int(group_size), int(bits))


@torch.library.register_fake("hebrus::quantized_linear")
def _quantized_linear_fake(x, wq, scales, biases, group_size, bits):
    rows, _, out = check_quantized_linear(x, wq, scales, biases, group_size, bits)
    return x.new_empty((rows, out))


def moe_route(router_logits: torch.Tensor, shared_gate_logits: torch.Tensor | None, top_k: int,
              norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE block's router after its linear (softmax in fp32, top-k, renormalisation, cast) and the shared
    expert's sigmoid gate in one dispatch; see :func:`hebrus_torch.reference.moe_route`.

    Shapes: router_logits [T, E] float, shared_gate_logits [T, S] in its dtype or None -> (ids [T, k] int64,
    weights [T, k + S] in the logits' dtype: the routed weights, then the S shared gates).
    """
    with translated():
        return torch.ops.hebrus.moe_route.default(router_logits, shared_gate_logits, int(top_k), bool(norm_topk_prob))


@torch.library.register_fake("hebrus::moe_route")
def _moe_route_fake(router_logits, shared_gate_logits, top_k, norm_topk_prob):
    rows, _, k, shared = check_moe_route(router_logits, shared_gate_logits, top_k)
    return (router_logits.new_empty((rows, k), dtype=torch.int64), router_logits.new_empty((rows, k + shared)))


def moe_shared_expert(x: torch.Tensor, routed: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                      down_proj: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``routed + gate * down_proj(silu(gate_proj(x)) * up_proj(x))`` in one dispatch; see
    :func:`hebrus_torch.reference.moe_shared_expert`.

    Shapes: x, routed [T, H]; gate_proj, up_proj [I, H]; down_proj [H, I]; gate [T, 1]; all in x's dtype -> [T, H].
    """
    with translated():
        return torch.ops.hebrus.moe_shared_expert.default(x, routed, gate_proj, up_proj, down_proj, gate)


@torch.library.register_fake("hebrus::moe_shared_expert")
def _moe_shared_expert_fake(x, routed, gate_proj, up_proj, down_proj, gate):
    rows, hidden, _ = check_moe_shared_expert(x, routed, gate_proj, up_proj, down_proj, gate)
    return x.new_empty((rows, hidden))


def moe_shared_expert_quantized(x: torch.Tensor, routed: torch.Tensor, gate_proj_q: torch.Tensor,
                                gate_proj_scales: torch.Tensor, gate_proj_biases: torch.Tensor, up_proj_q: torch.Tensor,
                                up_proj_scales: torch.Tensor, up_proj_biases: torch.Tensor, down_proj_q: torch.Tensor,
                                down_proj_scales: torch.Tensor, down_proj_biases: torch.Tensor, gate: torch.Tensor,
                                group_size: int, bits: int) -> torch.Tensor:
    """``moe_shared_expert`` over affine-quantized projections (each a ``QuantizedLinear``'s codes, scales and
    biases, one ``group_size`` / ``bits`` for all three); see :func:`hebrus_torch.reference.moe_shared_expert_quantized`.

    Shapes: x, routed [T, H]; gate_proj_q, up_proj_q [I, H * bits / 32] int32 and their scales / biases
    [I, H / group_size]; down_proj_q [H, I * bits / 32] int32 and its scales / biases [H, I / group_size]; gate
    [T, 1]; floats in x's dtype -> [T, H].
    """
    with translated():
        return torch.ops.hebrus.moe_shared_expert_quantized.default(
            x, routed, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q, up_proj_scales, up_proj_biases,
            down_proj_q, down_proj_scales, down_proj_biases, gate, int(group_size), int(bits))


@torch.library.register_fake("hebrus::moe_shared_expert_quantized")
def _moe_shared_expert_quantized_fake(x, routed, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q,
                                      up_proj_scales, up_proj_biases, down_proj_q, down_proj_scales, down_proj_biases,
                                      gate, group_size, bits):
    rows, hidden, _ = check_moe_shared_expert_quantized(
        x, routed, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q, up_proj_scales, up_proj_biases,
        down_proj_q, down_proj_scales, down_proj_biases, gate, group_size, bits)
    return x.new_empty((rows, hidden))

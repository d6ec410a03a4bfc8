"""Typed wrapper and fake impl of ``hebrus::moe_experts``."""

from __future__ import annotations

import torch

from ..errors import translated
from .checks import check_moe_experts

__all__ = ["moe_experts"]


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

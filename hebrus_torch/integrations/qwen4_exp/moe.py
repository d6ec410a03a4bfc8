"""Qwen4ExpTextExperts.forward as one hebrus::moe_experts call (issue 36) where the module and the call
allow it (:func:`hebrus_torch.moe.block.experts_unsupported`); transformers' own forward otherwise."""

from __future__ import annotations

import torch

from hebrus_torch.moe.block import experts_unsupported
from hebrus_torch.moe.ops import moe_experts

from .common import _PATCH
from .stats import _STATS


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of hidden_states [T, H] (top_k_index, top_k_weights [T, k]) -> [T, H]."""
    # Under torch.compile transformers' own forward (its dispatcher query would break the graph).
    reason = "compiling" if torch.compiler.is_compiling() else experts_unsupported(self, hidden_states)
    if reason is None:
        _STATS["moe_experts_calls"] += 1
        return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
    if reason != "compiling":
        _STATS[f"moe_experts_skipped:{reason}"] += 1
    return self.__dict__[_PATCH]["original_forward"](hidden_states, top_k_index, top_k_weights)

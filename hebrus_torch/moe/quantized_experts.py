"""Qwen4Exp's routed experts with affine-quantized weights (issue 36): :class:`QuantizedExperts`, a drop-in
for transformers' ``Qwen4ExpTextExperts`` that runs ``hebrus::moe_experts_quantized``, and
:func:`quantize_experts`, which swaps it in for every experts module of a model."""

from __future__ import annotations

import torch

from .ops import moe_experts_quantized
from .quantize import check_quant_options, quantize

__all__ = ["QuantizedExperts", "quantize_experts"]


class QuantizedExperts(torch.nn.Module):
    """The routed experts of one MoE block, quantized (:mod:`hebrus_torch.moe.quantize`).

    Buffers: ``gate_up_q`` [E, 2I, H * bits / 32] int32, ``gate_up_scales`` / ``gate_up_biases``
    [E, 2I, H / group_size], ``down_q`` [E, H, I * bits / 32] int32, ``down_scales`` / ``down_biases``
    [E, H, I / group_size] (scales and biases in the model's dtype). ``forward(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, the call transformers' MoE block makes.
    """

    def __init__(self, gate_up_q: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_biases: torch.Tensor,
                 down_q: torch.Tensor, down_scales: torch.Tensor, down_biases: torch.Tensor, bits: int,
                 group_size: int) -> None:
        super().__init__()
        check_quant_options(bits, group_size)
        self.bits, self.group_size = int(bits), int(group_size)
        for name, t in (("gate_up_q", gate_up_q), ("gate_up_scales", gate_up_scales),
                        ("gate_up_biases", gate_up_biases), ("down_q", down_q), ("down_scales", down_scales),
                        ("down_biases", down_biases)):
            self.register_buffer(name, t)
        self.num_experts = gate_up_q.shape[0]

    @classmethod
    def from_experts(cls, experts: torch.nn.Module, bits: int = 4, group_size: int = 64) -> "QuantizedExperts":
        """Quantize an experts module's ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], one expert at a
        time (the fp32 working set is one expert's)."""
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        check_quant_options(bits, group_size, gate_up.shape[-1], op="quantize_experts")
        check_quant_options(bits, group_size, down.shape[-1], op="quantize_experts")
        parts = [quantize(gate_up[e], bits, group_size) + quantize(down[e], bits, group_size)
                 for e in range(gate_up.shape[0])]
        return cls(*(torch.stack([p[i] for p in parts]) for i in range(6)), bits, group_size)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, bits={self.bits}, group_size={self.group_size}"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return moe_experts_quantized(hidden_states, top_k_index, top_k_weights, self.gate_up_q, self.gate_up_scales,
                                     self.gate_up_biases, self.down_q, self.down_scales, self.down_biases,
                                     self.group_size, self.bits)


def quantize_experts(model: torch.nn.Module, bits: int = 4, group_size: int = 64) -> torch.nn.Module:
    """Replace every transformers ``Qwen4ExpTextExperts`` in ``model`` by its :class:`QuantizedExperts`, in place
    (every module is checked before any is replaced); returns ``model``."""
    from ..integrations.qwen4_exp.common import _modeling

    experts_type = _modeling().Qwen4ExpTextExperts
    owners = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if type(child) is experts_type]
    for _, _, child in owners:
        check_quant_options(bits, group_size, child.gate_up_proj.shape[-1], op="quantize_experts")
        check_quant_options(bits, group_size, child.down_proj.shape[-1], op="quantize_experts")
    for parent, name, child in owners:
        setattr(parent, name, QuantizedExperts.from_experts(child, bits, group_size))
    return model

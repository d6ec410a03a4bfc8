"""transformers' Qwen4Exp MoE block over packed rows with its routed experts as one ``hebrus::moe_experts``
call: what the engine's packed forward and the drop-in run. The router (softmax, top-k, renormalisation)
and the shared expert with its sigmoid gate stay the block's own modules (three matmuls, a softmax, a
top-k and a sigmoid beside the op). A block or an experts module that is not transformers' own (a
subclass, a wrapped or quantized module, one with hooks, another expert layout) runs as a module call."""

from __future__ import annotations

import torch

from .._emulate import EmulatedTensor
from .._op_registry import has_native_kernel
from .ops import moe_experts

__all__ = ["experts_unsupported", "routed_experts", "packed_moe"]


def _modeling():
    from ..integrations.qwen4_exp.common import _modeling as modeling

    return modeling()


@torch.compiler.assume_constant_result
def _native_moe_experts(device_type: str) -> bool:
    """``hebrus::moe_experts`` has a kernel for ``device_type``: a fact of the build (or of the emulated
    device), so ``torch.compile`` takes it as a constant instead of breaking the graph on the dispatcher
    query."""
    return has_native_kernel("moe_experts", device_type)


def _plain_call(module: torch.nn.Module, patched_by: str | None = None) -> bool:
    """No hooks and no forward of the instance's own (other than the drop-in's patch, ``patched_by``): calling
    around the module runs exactly what its class's forward runs."""
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return False
    own = module.__dict__.get("forward")
    return own is None or getattr(getattr(own, "__func__", None), "__name__", None) == patched_by


def experts_unsupported(experts: torch.nn.Module, hidden_states: torch.Tensor) -> str | None:
    """None when a transformers ``Qwen4ExpTextExperts`` module can run as one ``moe_experts`` call on
    ``hidden_states`` [T, H]; otherwise why not (a ``stats()`` key suffix of the drop-in)."""
    m = _modeling()
    if type(experts) is not m.Qwen4ExpTextExperts:
        return "not_transformers_experts"
    gate_up, down = experts.gate_up_proj, experts.down_proj
    # (a tensor subclass, e.g. a quantized weight, is the module's own business; the emulated device's
    # tensors stand in for plain ones)
    if not all(type(p) in (torch.Tensor, torch.nn.Parameter, EmulatedTensor) for p in (gate_up, down)):
        return "weights_not_plain_tensors"
    if (getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True)
            or getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True)
            or getattr(experts, "has_post_expert_norm", False) or getattr(experts, "_is_expert_parallel", False)
            or getattr(experts.config, "hidden_act", None) != "silu"):
        return "expert_layout"
    if hidden_states.dim() != 2 or hidden_states.dtype != gate_up.dtype or down.dtype != gate_up.dtype:
        return "dtype"
    if not _native_moe_experts(hidden_states.device.type):
        return "no_native_kernel"
    if torch.is_grad_enabled() and (hidden_states.requires_grad or gate_up.requires_grad or down.requires_grad):
        return "autograd"                     # hebrus::moe_experts has no backward
    return None


def routed_experts(experts: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of packed rows x [T, H] (ids, weights [T, k]): one ``moe_experts`` call where
    :func:`experts_unsupported` allows it and the module has no hooks, else the module call."""
    if _plain_call(experts, "_experts_forward") and experts_unsupported(experts, x) is None:
        return moe_experts(x, topk_ids, topk_weights, experts.gate_up_proj, experts.down_proj)
    return experts(x, topk_ids, topk_weights)


def packed_moe(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's MoE block over packed rows: x Tensor[T, H] -> Tensor[T, H].

    transformers' ``Qwen4ExpTextSparseMoeBlock.forward`` step for step (shared expert, router, routed experts
    through :func:`routed_experts`, sigmoid-gated shared output added); any other block (or one with hooks
    or a forward of its own) runs as the module call ``mlp(x[None])[0]``."""
    if type(mlp) is not _modeling().Qwen4ExpTextSparseMoeBlock or not _plain_call(mlp):
        return mlp(x[None])[0]
    shared = mlp.shared_expert(x)
    _, weights, ids = mlp.gate(x)
    routed = routed_experts(mlp.experts, x, ids, weights)
    return routed + torch.sigmoid(mlp.shared_expert_gate(x)) * shared

"""transformers' Qwen4Exp MoE block over packed rows with its routed experts as one ``hebrus::moe_experts``
call: what the engine's packed forward and the drop-in run. The router after its linear (softmax, top-k,
renormalisation, cast) and the shared expert's sigmoid gate are one ``hebrus::moe_route`` call, and the shared
expert with its gate and the sum one ``hebrus::moe_shared_expert`` call (``moe_shared_expert_quantized`` where its
projections are ``QuantizedLinear``; issue 37); the router's and the shared gate's linears stay the block's own
modules. A block, a router, a shared expert or an experts module that is not transformers' own (a subclass, a
wrapped module, one with hooks, another expert layout) runs as a module call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._emulate import EmulatedTensor
from .._op_registry import has_native_kernel
from ..module_calls import linear, submodule
from ..integrations.qwen4_exp.common import _modeling          # (transformers itself is imported lazily)
from .ops import moe_experts, moe_route, moe_shared_expert, moe_shared_expert_quantized
from .quantized_linear import QuantizedLinear

__all__ = ["experts_unsupported", "routed_experts", "packed_moe", "route", "shared_expert_weights",
           "shared_expert_quantized_weights", "stock_router_weight"]


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
    params = experts._parameters
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None:
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
        params = experts._parameters
        return moe_experts(x, topk_ids, topk_weights, params["gate_up_proj"], params["down_proj"])
    return experts(x, topk_ids, topk_weights)


def _fuse_elementwise(fused: bool | None) -> bool:
    """Whether the shared gate's sigmoid and the shared expert run inside the fused ops (``fused``; by default
    yes, on every device). Their CPU kernels compute the sigmoid, SiLU and sums in hebrus's own row arithmetic, so
    a row's bits do not depend on the row count (ATen's sigmoid gave an element other bits in its vectorised body
    than in its scalar tail, which kept them module calls on CPU before); their projections are BLAS products,
    whose rows vary with the row count (SPEC §8), so the engine's invariance suite runs the fused shared expert row
    by row, as it runs ``F.linear`` (tests/test_engine.py, ``row_invariant``)."""
    return True if fused is None else fused


def stock_router_weight(gate: torch.nn.Module) -> torch.Tensor | None:
    """The router's weight [E, H] where ``gate`` is transformers' own ``Qwen4ExpTextTopKRouter`` called as its class's
    forward (:func:`_plain_call`): what lets :func:`route` run it as ``F.linear`` then ``moe_route``, and the native
    layers take its weight (models/qwen4_exp/native.py); None otherwise."""
    if type(gate) is not _modeling().Qwen4ExpTextTopKRouter or not _plain_call(gate):
        return None
    return gate._parameters.get("weight")


def route(mlp: torch.nn.Module, x: torch.Tensor,
          fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router and the shared expert's gate of a ``Qwen4ExpTextSparseMoeBlock`` over packed rows x [T, H]:
    (ids [T, k] int64, routed weights [T, k], shared gate [T, 1]), weights and gate in the logits' dtype.

    Where the router is transformers' own ``Qwen4ExpTextTopKRouter`` (no hooks, no autograd) its linear runs as
    ``F.linear(x, gate.weight)`` and everything after it as one ``hebrus::moe_route`` (the router: the module's bits
    on CPU), with the sigmoid of ``shared_expert_gate(x)`` inside it where :func:`_fuse_elementwise` (by default),
    else ``torch.sigmoid`` beside it; otherwise the router module and a sigmoid."""
    gate = submodule(mlp, "gate")
    weight = stock_router_weight(gate)
    if weight is not None and x.dim() == 2 and not (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        logits = F.linear(x, weight)
        shared_logit = linear(submodule(mlp, "shared_expert_gate"), x)
        if _fuse_elementwise(fused) and shared_logit.dtype == logits.dtype \
                and not (torch.is_grad_enabled() and shared_logit.requires_grad):
            ids, weights = moe_route(logits, shared_logit, gate.top_k, gate.norm_topk_prob)
            return ids, weights[:, :gate.top_k], weights[:, gate.top_k:]
        ids, weights = moe_route(logits, None, gate.top_k, gate.norm_topk_prob)
        return ids, weights, torch.sigmoid(shared_logit)
    _, weights, ids = gate(x)
    return ids, weights, torch.sigmoid(submodule(mlp, "shared_expert_gate")(x))


def _plain_linear(linear: torch.nn.Module, dtype: torch.dtype) -> bool:
    if type(linear) is not torch.nn.Linear:
        return False
    params = linear._parameters          # (weight and bias live here: read without Module.__getattr__)
    weight = params["weight"]
    return params["bias"] is None and _plain_call(linear) \
        and type(weight) in (torch.Tensor, torch.nn.Parameter, EmulatedTensor) and weight.dtype == dtype


def _plain_quantized_linear(linear: torch.nn.Module, dtype: torch.dtype) -> bool:
    return type(linear) is QuantizedLinear and _plain_call(linear) and linear.scales.dtype == dtype \
        and all(type(t) in (torch.Tensor, torch.nn.Parameter, EmulatedTensor)
                for t in (linear.weight, linear.scales, linear.biases))


def _shared_projections(shared: torch.nn.Module, x: torch.Tensor, plain) -> tuple[torch.nn.Module, ...] | None:
    """(gate_proj, up_proj, down_proj) of transformers' own ``Qwen4ExpTextMLP`` (no hooks, SiLU, no autograd)
    where ``plain(projection, x.dtype)`` holds for all three; else None."""
    if type(shared) is not _modeling().Qwen4ExpTextMLP:
        return None
    projections = (submodule(shared, "gate_proj", None), submodule(shared, "up_proj", None),
                   submodule(shared, "down_proj", None))
    if not _plain_call(shared) \
            or getattr(shared.config, "hidden_act", None) != "silu" \
            or not all(plain(p, x.dtype) for p in projections):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for p in projections
                                                           for t in p.parameters())):
        return None
    return projections


def shared_expert_weights(shared: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """(gate_proj, up_proj, down_proj) weights of transformers' own ``Qwen4ExpTextMLP`` shared expert (no hooks,
    bias-free plain ``nn.Linear`` projections in x's dtype, SiLU, no autograd): what ``moe_shared_expert`` runs;
    None for any other module (a quantized one: :func:`shared_expert_quantized_weights`; a wrapped one runs as
    itself)."""
    projections = _shared_projections(shared, x, _plain_linear)
    return None if projections is None else tuple(p._parameters["weight"] for p in projections)


def shared_expert_quantized_weights(shared: torch.nn.Module, x: torch.Tensor) -> tuple | None:
    """The arguments of ``moe_shared_expert_quantized`` after x, routed for transformers' own ``Qwen4ExpTextMLP``
    whose three projections are :class:`QuantizedLinear` modules (no hooks, scales in x's dtype, one bits /
    group_size for all three, SiLU, no autograd): ((codes, scales, biases) of gate_proj, up_proj, down_proj,
    group_size, bits); None for any other module."""
    projections = _shared_projections(shared, x, _plain_quantized_linear)
    if projections is None or len({(p.bits, p.group_size) for p in projections}) != 1:
        return None
    tensors = tuple(t for p in projections for t in (p.weight, p.scales, p.biases))
    return tensors, projections[0].group_size, projections[0].bits


def packed_moe(mlp: torch.nn.Module, x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """A decoder layer's MoE block over packed rows: x Tensor[T, H] -> Tensor[T, H].

    transformers' ``Qwen4ExpTextSparseMoeBlock.forward`` step for step (router and shared gate through
    :func:`route`, routed experts through :func:`routed_experts`, the sigmoid-gated shared expert added by
    ``moe_shared_expert`` where :func:`shared_expert_weights` allows it, or ``moe_shared_expert_quantized`` where
    :func:`shared_expert_quantized_weights` does, and :func:`_fuse_elementwise` (``fused``; on by default),
    else by the module's own call); any other block (or one with hooks or a forward of its
    own) runs as the module call ``mlp(x[None])[0]``."""
    if type(mlp) is not _modeling().Qwen4ExpTextSparseMoeBlock or not _plain_call(mlp):
        return mlp(x[None])[0]
    ids, weights, shared_gate = route(mlp, x, fused)
    routed = routed_experts(submodule(mlp, "experts"), x, ids, weights)
    shared_expert = submodule(mlp, "shared_expert")
    if _fuse_elementwise(fused) and routed.dtype == x.dtype and shared_gate.dtype == x.dtype and x.dim() == 2:
        shared = shared_expert_weights(shared_expert, x)
        if shared is not None:
            return moe_shared_expert(x, routed, *shared, shared_gate)
        quantized = shared_expert_quantized_weights(shared_expert, x)
        if quantized is not None:
            tensors, group_size, bits = quantized
            return moe_shared_expert_quantized(x, routed, *tensors, shared_gate, group_size, bits)
    return routed + shared_gate * shared_expert(x)

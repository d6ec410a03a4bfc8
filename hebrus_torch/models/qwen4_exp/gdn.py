"""The gated-delta-net layer (transformers' ``Qwen4ExpTextGatedDeltaNet``) on packed rows, its conv and delta
rule through state operations the caller binds (a ``ChunkStep``'s, or a ``GDNState``'s in ``gdn_forward``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ...gdn.fused import _sigmoid, _softplus, layer_gates, output_norm  # noqa: F401 (_sigmoid, _softplus: their old home)
from ...module_calls import linear

if TYPE_CHECKING:
    from ...model_cache import ChunkStep

ConvOp = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
"""``conv(mixed [T, conv_dim], weight, activation) -> [T, conv_dim]``: the causal conv over the conv tails."""
DeltaRuleOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``delta_rule(q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv], beta [T, Hv]) -> [T, Hv, Dv]``."""

_HEADS = (("num_k_heads", "num_key_heads"), ("num_v_heads", "num_value_heads"), ("head_k_dim", "key_head_dim"),
          ("head_v_dim", "value_head_dim"))


def module_mismatch(module: torch.nn.Module, state) -> str | None:
    """Why ``module`` (a ``Qwen4ExpTextGatedDeltaNet``) does not fit the GDNState ``state`` (its head counts
    and head dims), or None."""
    for name, attr in _HEADS:
        got, want = getattr(module, name, None), getattr(state, attr)
        if got != want:
            return f"module.{name} is {got}, the GDNState has {want}"
    return None


def gated_delta_net(module: torch.nn.Module, hidden: torch.Tensor, conv: ConvOp,
                    delta_rule: DeltaRuleOp) -> torch.Tensor:
    """``Qwen4ExpTextGatedDeltaNet.forward`` on packed rows: hidden Tensor[T, hidden_size] -> Tensor[T, hidden_size].

    Calls the module's own submodules (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``norm``,
    ``out_proj``; ``conv1d.weight``, ``A_log``, ``dt_bias``), never copies of their weights; what carries state
    (the conv over the tails, the delta rule over the recurrent states) goes through ``conv`` and
    ``delta_rule``, which stage it. The beta gate and the log decay are computed in fp32 with every token's
    bits independent of where it sits in the step, in one ``hebrus::gdn_gates`` dispatch, and the gated
    output norm in one ``hebrus::gdn_gated_rms_norm`` (:mod:`hebrus_torch.gdn.fused`: issue 37).
    """
    T = hidden.shape[0]
    hk, hv = module.num_k_heads, module.num_v_heads
    dk, dv = module.head_k_dim, module.head_v_dim
    mixed = linear(module.in_proj_qkv, hidden)                                   # [T, conv_dim]
    z = linear(module.in_proj_z, hidden).reshape(T, hv, dv)
    b = linear(module.in_proj_b, hidden)
    a = linear(module.in_proj_a, hidden)
    g, beta = layer_gates(module, a, b)
    mixed = conv(mixed, module.conv1d.weight, module.activation)
    q, k, v = mixed.split_with_sizes([hk * dk, hk * dk, hv * dv], dim=-1)
    out = delta_rule(q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv), g, beta)
    out = output_norm(module.norm, out.reshape(-1, dv), z.reshape(-1, dv)).reshape(T, hv * dv)
    return linear(module.out_proj, out)


def packed_gated_delta_net(step: ChunkStep, layer_idx: int, module: torch.nn.Module,
                           hidden: torch.Tensor) -> torch.Tensor:
    """:func:`gated_delta_net` of decoder layer ``layer_idx`` on a ``ChunkStep``'s batch (its GDN state ops)."""
    return gated_delta_net(module, hidden,
                           conv=lambda x, weight, activation: step.gdn_conv(layer_idx, x, weight, activation),
                           delta_rule=lambda q, k, v, g, beta: step.gdn_delta_rule(layer_idx, q, k, v, g, beta))

"""``gdn_forward``: a transformers ``Qwen4ExpTextGatedDeltaNet`` layer over a packed step, state in a GDNState."""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import HebrusError
from ..state.args import as_tensor
from ..state.handles import SeqHandle
from ..state.transaction import atomic
from .state import GDNState


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in fp32. torch.sigmoid's CPU kernel rounds differently in the vectorised body
    and the scalar tail of a loop, so a token's value would depend on where it sits in the packed step;
    exp and division give every element the same bits wherever it sits."""
    return 1.0 / (1.0 + torch.exp(-x.float()))


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0) + log(1 + exp(-|x|))`` in fp32 (softplus; ``F.softplus`` has torch.sigmoid's position
    dependence through log1p). Differs from log1p's result by under 6e-8 absolute."""
    x = x.float()
    return x.clamp(min=0) + torch.log(1.0 + torch.exp(-x.abs()))


def gdn_forward(module: torch.nn.Module, state: GDNState, layer: int, seqs: Sequence[SeqHandle],
                hidden: torch.Tensor, cu_seqlens: torch.Tensor, *,
                start_pos: Sequence[int | None] | None = None) -> torch.Tensor:
    """``Qwen4ExpTextGatedDeltaNet.forward`` over a packed step: Tensor[T, hidden] -> Tensor[T, hidden].

    Calls the module's own submodules (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
    ``norm``, ``out_proj``; the conv weight ``conv1d.weight`` and ``A_log``, ``dt_bias``), never copies of
    their weights; the conv and the delta rule run through ``state`` (:meth:`GDNState.conv`,
    :meth:`GDNState.delta_rule`) for GDN layer ``layer`` (``state.layer_index(decoder_layer)``), staging
    the new state. The two stagings are one atomic step: inside a transaction they publish at its
    commit; outside one, both publish or neither does.

    Args:
        module: the layer's ``linear_attn`` (a ``Qwen4ExpTextGatedDeltaNet``).
        state: the model's GDNState.
        layer: GDN layer index.
        seqs: one handle per packed row.
        hidden: Tensor[T, hidden_size], the rows' tokens back to back.
        cu_seqlens: Tensor[B+1] int32, row boundaries.
        start_pos: per row, the absolute position of its first token for rows that run the chunked form
            (:meth:`GDNState.delta_rule`), None for recurrent rows; None: all recurrent.
    """
    hidden = as_tensor("gdn_forward: hidden", hidden)
    if hidden.dim() != 2:
        raise HebrusError(f"gdn_forward: hidden must be [T, hidden_size], got {list(hidden.shape)}")
    T = hidden.shape[0]
    hk, hv = state.num_key_heads, state.num_value_heads
    dk, dv = state.key_head_dim, state.value_head_dim
    for name, want in (("num_k_heads", hk), ("num_v_heads", hv), ("head_k_dim", dk), ("head_v_dim", dv)):
        got = getattr(module, name, None)
        if got != want:
            raise HebrusError(f"gdn_forward: module.{name} is {got}, the GDNState has {want}")
    mixed = module.in_proj_qkv(hidden)                                   # [T, conv_dim]
    z = module.in_proj_z(hidden).reshape(T, hv, dv)
    b = module.in_proj_b(hidden)
    a = module.in_proj_a(hidden)
    beta = _sigmoid(b).to(b.dtype)
    g = -module.A_log.float().exp() * _softplus(a.float() + module.dt_bias)
    with atomic(state):
        mixed = state.conv(layer, seqs, mixed, cu_seqlens, module.conv1d.weight, activation=module.activation)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        out = state.delta_rule(layer, seqs, cu_seqlens, q.reshape(T, hk, dk), k.reshape(T, hk, dk),
                               v.reshape(T, hv, dv), g, beta, start_pos=start_pos)
    out = module.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(T, hv * dv)
    return module.out_proj(out)

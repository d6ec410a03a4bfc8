"""``gdn_forward``: a transformers ``Qwen4ExpTextGatedDeltaNet`` layer over a packed step, state in a GDNState.

The layer's math is :func:`hebrus_torch.models.qwen4_exp.gdn.gated_delta_net` (what the engine runs too);
this binds it to a GDNState's conv and delta rule, outside a ``ModelCache``."""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import HebrusError
from ..models.qwen4_exp.gdn import _sigmoid, _softplus, gated_delta_net, module_mismatch  # noqa: F401 (their old home)
from ..state.args import as_tensor
from ..state.handles import SeqHandle
from ..state.transaction import atomic
from .state import GDNState


def gdn_forward(module: torch.nn.Module, state: GDNState, layer: int, seqs: Sequence[SeqHandle],
                hidden: torch.Tensor, cu_seqlens: torch.Tensor, *,
                start_pos: Sequence[int | None] | None = None) -> torch.Tensor:
    """``Qwen4ExpTextGatedDeltaNet.forward`` over a packed step: Tensor[T, hidden] -> Tensor[T, hidden].

    Calls the module's own submodules (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
    ``norm``, ``out_proj``; the conv weight ``conv1d.weight`` and ``A_log``, ``dt_bias``), never copies of
    their weights; the conv and the delta rule run through ``state`` (:meth:`GDNState.conv`,
    :meth:`GDNState.delta_rule`) for GDN layer ``layer`` (``state.layer_index(decoder_layer)``), staging
    the new state. The call is one atomic step: inside a transaction its stagings publish at the
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
    why = module_mismatch(module, state)
    if why is not None:
        raise HebrusError(f"gdn_forward: {why}")
    with atomic(state):
        return gated_delta_net(
            module, hidden,
            conv=lambda x, weight, activation: state.conv(layer, seqs, x, cu_seqlens, weight, activation=activation),
            delta_rule=lambda q, k, v, g, beta: state.delta_rule(layer, seqs, cu_seqlens, q, k, v, g, beta,
                                                                 start_pos=start_pos))

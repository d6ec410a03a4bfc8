"""PLE (transformers' ``Qwen4ExpTextPLELayer``) on packed rows, its n-gram ids and dilated conv through a
``ChunkStep`` (``ple_ngram_ids``, ``ple_conv``: the PLE state's history and conv tails, staged)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from ...hc.premix import fused_norm
from ...module_calls import linear

if TYPE_CHECKING:
    from ...model_cache import ChunkStep
    from .native import PleGateCall


def packed_ple(step: ChunkStep, layer_idx: int, ple: torch.nn.Module, h: torch.Tensor,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """``Qwen4ExpTextPLELayer.forward`` on a ChunkStep's batch: h Tensor[T, hc * hidden] (the hyper-connection
    streams) -> what the layer adds to them, Tensor[T, hc * hidden].

    ``rows``: the layer's n-gram embedding rows Tensor[T, (N-1)*H, dim] when they were gathered ahead (the
    step's prefetch, :mod:`hebrus_torch.ple.prefetch`, which computed the ids and advanced the history);
    None: the ids are computed here and the rows gathered by the layer's ``ngram_embedding``.

    Each stream gates the n-gram value by its normed activations against that stream's key (a signed
    square root of the scaled dot product, through a sigmoid); the gated values go through the dilated
    depthwise conv over the sequence's conv tail."""
    hidden_size, hc = ple.hidden_size, ple.hc_count
    if rows is None:
        ids = step.ple_ngram_ids(layer_idx)                                       # [T, (N-1)H]
        rows = ple.ple_embedding.ngram_embedding(ids)
    emb = rows.flatten(-2)
    key = fused_norm(ple.norm_key, linear(ple.key_proj, emb)).unflatten(-1, (hc, hidden_size))
    value = linear(ple.value_proj, emb)
    query = fused_norm(ple.norm_query, h).unflatten(-1, (hc, hidden_size))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = torch.sigmoid(gate) * value.unsqueeze(-2)
    gated_normed = fused_norm(ple.norm_conv, gated.flatten(-2))
    return gated.flatten(-2) + step.ple_conv(layer_idx, gated_normed, ple.conv1d.weight)


def native_ple(step: ChunkStep, layer_idx: int, ple: torch.nn.Module, gate: PleGateCall, h: torch.Tensor,
               rows: torch.Tensor | None = None, conv: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> torch.Tensor:
    """:func:`packed_ple` with its gate one native call (``hebrus::decode_ple_gate``, the same ops): the n-gram ids,
    rows and conv as there, or ``conv`` where the step made the layer's conv ahead (``ChunkStep.ple_conv_call``, for
    rows in h's dtype). Rows not in h's dtype take :func:`packed_ple`."""
    if rows is None:
        rows = ple.ple_embedding.ngram_embedding(step.ple_ngram_ids(layer_idx))
    if rows.dtype != h.dtype:
        return packed_ple(step, layer_idx, ple, h, rows)
    gated, normed = gate(rows, h)
    return gated + (conv(normed) if conv is not None else step.ple_conv(layer_idx, normed, gate.conv_weight))

"""PLE (transformers' ``Qwen4ExpTextPLELayer``) on packed rows, its n-gram ids and dilated conv through a
``ChunkStep`` (``ple_ngram_ids``, ``ple_conv``: the PLE state's history and conv tails, staged)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ...hc.premix import fused_norm

if TYPE_CHECKING:
    from ...model_cache import ChunkStep


def packed_ple(step: ChunkStep, layer_idx: int, ple: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``Qwen4ExpTextPLELayer.forward`` on a ChunkStep's batch: h Tensor[T, hc * hidden] (the hyper-connection
    streams) -> what the layer adds to them, Tensor[T, hc * hidden].

    Each stream gates the n-gram value by its normed activations against that stream's key (a signed
    square root of the scaled dot product, through a sigmoid); the gated values go through the dilated
    depthwise conv over the sequence's conv tail."""
    hidden_size, hc = ple.hidden_size, ple.hc_count
    ids = step.ple_ngram_ids(layer_idx)                                           # [T, (N-1)H]
    emb = ple.ple_embedding.ngram_embedding(ids).flatten(-2)
    key = fused_norm(ple.norm_key, ple.key_proj(emb)).unflatten(-1, (hc, hidden_size))
    value = ple.value_proj(emb)
    query = fused_norm(ple.norm_query, h).unflatten(-1, (hc, hidden_size))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = torch.sigmoid(gate) * value.unsqueeze(-2)
    gated_normed = fused_norm(ple.norm_conv, gated.flatten(-2))
    return gated.flatten(-2) + step.ple_conv(layer_idx, gated_normed, ple.conv1d.weight)

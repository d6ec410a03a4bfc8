"""Qwen4Exp's multi-token-prediction block (the checkpoint's ``mtp.*``): the module, its packed forward over a
``ChunkStep`` and a plain-PyTorch reference.

The block takes the trunk's 4-stream residual after its last decoder layer, **before** the top-level
``hyper_connection_mixer`` (``h``, Tensor[T, hc * hidden]), and the embedding ``e`` of the token that follows
it; each stream becomes ``fc_hidden(pre_fc_norm_hidden(h)_s) + fc_embedding(pre_fc_norm_embedding(e))``. Then one
full decoder block (indexed attention with its indexer and its own K/V, the MoE, both hyper-connections; no
PLE), the MTP's own ``hyper_connection_mixer`` and the trunk's ``lm_head`` (shared, as is ``embed_tokens``).
Its output streams (before its mixer) are what the next draft step feeds back in place of ``h``.

``pre_fc_norm_hidden`` [hc * hidden] normalises each stream on its own (grouped like the hyper-connections'
``hc_norm``); the modules are transformers' own classes (``Qwen4ExpTextDecoderLayer`` built as decoder layer
``num_hidden_layers`` of a config with one more ``indexed_attention`` layer, ``Qwen4ExpTextGatedResidual``,
``Qwen4ExpTextRMSNorm``), so the block's math is transformers' and the packed forward reuses the trunk's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from ...hc.premix import fused_norm, hyper_premix

if TYPE_CHECKING:
    from ...model_cache import ChunkStep
    from .forward import PackedQwen4Exp

__all__ = ["Qwen4ExpMTP", "mtp_layer_index", "packed_fuse", "packed_mtp", "mtp_write", "mtp_logits", "causal_mask", "reference_mtp"]


def _modeling():
    from ...integrations.qwen4_exp.common import _modeling as modeling

    return modeling()


def mtp_layer_index(config) -> int:
    """The decoder-layer index the MTP block's attention state is kept under: ``num_hidden_layers``."""
    return int(config.num_hidden_layers)


def _block_config(config):
    """The text config with one more ``indexed_attention`` layer (the MTP block's) and no PLE on it."""
    cfg = copy.deepcopy(config)
    cfg.layer_types = list(config.layer_types[: config.num_hidden_layers]) + ["indexed_attention"]
    return cfg


class Qwen4ExpMTP(torch.nn.Module):
    """The ``mtp.*`` weights as modules (names as in the checkpoint, without the ``mtp.`` prefix).

    Args:
        config: the trunk's text config (``Qwen4ExpTextConfig``).
    """

    def __init__(self, config) -> None:
        super().__init__()
        m = _modeling()
        hidden, hc = int(config.hidden_size), int(config.hc_count)
        self.hidden_size, self.hc_count = hidden, hc
        self.layer_idx = mtp_layer_index(config)
        self.fc_embedding = torch.nn.Linear(hidden, hidden, bias=False)
        self.fc_hidden = torch.nn.Linear(hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = m.Qwen4ExpTextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = m.Qwen4ExpTextRMSNorm(hidden * hc, group_size=hidden, eps=config.rms_norm_eps)
        block = m.Qwen4ExpTextDecoderLayer(_block_config(config), self.layer_idx)
        assert block.ple is None and block.layer_type == "indexed_attention"
        self.layers = torch.nn.ModuleList([block])
        self.hyper_connection_mixer = m.Qwen4ExpTextGatedResidual(config, use_combine=False)
        experts = self.block.mlp.experts       # (transformers leaves them uninitialised outside post_init)
        with torch.no_grad():
            for p in (experts.gate_up_proj, experts.down_proj):
                p.normal_(0.0, float(getattr(config, "initializer_range", 0.02)))

    @property
    def block(self) -> torch.nn.Module:
        return self.layers[0]

    def fuse(self, streams: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The block's input: streams Tensor[..., hc * hidden] (pre-mixer), embeds Tensor[..., hidden] (the next
        token's) -> Tensor[..., hc * hidden]."""
        h = self.fc_hidden(self.pre_fc_norm_hidden(streams).unflatten(-1, (self.hc_count, self.hidden_size)))
        e = self.fc_embedding(self.pre_fc_norm_embedding(embeds))
        return (h + e.unsqueeze(-2)).flatten(-2)


def packed_fuse(mtp: Qwen4ExpMTP, streams: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """:meth:`Qwen4ExpMTP.fuse` on packed rows (streams Tensor[T, hc * hidden], embeds Tensor[T, hidden] ->
    Tensor[T, hc * hidden]) with its two norms as one ``hebrus::hc_rms_norm`` each (``fused_norm``: hebrus's own
    row arithmetic on CPU, no autograd: the packed forward's, not training's)."""
    h = mtp.fc_hidden(fused_norm(mtp.pre_fc_norm_hidden, streams).unflatten(-1, (mtp.hc_count, mtp.hidden_size)))
    e = mtp.fc_embedding(fused_norm(mtp.pre_fc_norm_embedding, embeds))
    return (h + e.unsqueeze(-2)).flatten(-2)


def packed_mtp(step: ChunkStep, trunk: PackedQwen4Exp, mtp: Qwen4ExpMTP, streams: torch.Tensor,
               tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The MTP block on a ``ChunkStep``'s packed rows: streams Tensor[T, hc * hidden] (each row's pre-mixer
    streams of the position before), tokens Tensor[T] int64 (the tokens at the step's positions), cos/sin
    Tensor[T, R] at those positions -> the block's output streams Tensor[T, hc * hidden] (before its mixer).
    Its indexed attention writes and selects over decoder layer ``mtp.layer_idx`` of the step's QSA cache."""
    h = packed_fuse(mtp, streams, trunk.text.embed_tokens(tokens))
    return trunk.decoder_layer(step, mtp.layer_idx, mtp.block, h, cos, sin)


def mtp_write(step: ChunkStep, trunk: PackedQwen4Exp, mtp: Qwen4ExpMTP, streams: torch.Tensor,
              tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """What :func:`packed_mtp` writes to the cache (the block's raw indexer keys, K and V at the step's
    positions), without the rest of the block: in a trunk step only the MTP block's attention state is
    wanted (its K/V depend on the block's input alone: its one attention reads only its own K/V)."""
    from .attention import write_keys_and_values

    x = hyper_premix(mtp.block.attn_hyper_connection, packed_fuse(mtp, streams, trunk.text.embed_tokens(tokens)))[0]
    rope = trunk.rope if trunk.rope is not None else trunk_rope()
    write_keys_and_values(step, mtp.layer_idx, mtp.block.self_attn, x, cos, sin, rope)


def trunk_rope():
    from .forward import _rope_function

    return _rope_function()


def mtp_logits(mtp: Qwen4ExpMTP, lm_head: torch.nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """The block's output streams Tensor[T, hc * hidden] -> logits Tensor[T, vocab] float32 (its mixer, the
    trunk's ``lm_head``). Without autograd the mixer runs as the packed forward's (``hyper_premix``: its norm
    fused); with it (training) as the module."""
    mixer = mtp.hyper_connection_mixer
    return lm_head(mixer(streams) if torch.is_grad_enabled() else hyper_premix(mixer, streams)).float()


def causal_mask(mtp: Qwen4ExpMTP, t: int, like: torch.Tensor) -> torch.Tensor:
    """The 4-D causal mask [1, 1, t, t] transformers' attention takes: bool for sdpa, additive (0 / the dtype's
    minimum) for eager attention."""
    mask = torch.ones(t, t, dtype=torch.bool, device=like.device).tril()[None, None]
    if mtp.block.self_attn.config._attn_implementation != "eager":
        return mask
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(~mask, torch.finfo(like.dtype).min)


@torch.no_grad()
def reference_mtp(model: torch.nn.Module, mtp: Qwen4ExpMTP, streams: torch.Tensor, tokens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own modules on one whole sequence, no cache: entry p of the MTP sequence is
    ``(streams[p], tokens[p])`` at position p (dense causal attention masked by the indexer's own per-query
    selection, ``Qwen4ExpTextQSAIndexer``).

    Args:
        model: the trunk (``Qwen4ExpForCausalLM``: its ``embed_tokens``, ``rotary_emb``, ``lm_head``).
        streams: Tensor[T, hc * hidden]; tokens: Tensor[T] int64.

    Returns:
        (output streams Tensor[T, hc * hidden], logits Tensor[T, vocab] float32).
    """
    from .forward import find_text_model

    text = find_text_model(model)
    t = tokens.shape[0]
    x = mtp.fuse(streams, text.embed_tokens(tokens))[None]
    pos = torch.arange(t, device=tokens.device).view(1, 1, -1).expand(3, 1, -1)
    cos_sin = text.rotary_emb(x[..., : mtp.hidden_size], pos)
    out = mtp.block(x, position_embeddings=cos_sin, attention_mask=causal_mask(mtp, t, x))[0]
    return out, mtp_logits(mtp, model.lm_head, out)

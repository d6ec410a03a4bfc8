"""Executes one packed step on a transformers Qwen4Exp model's own modules, inside one ModelCache transaction.

The runner never decides who runs (that is the scheduler's); it takes rows of tokens, one per
sequence, and returns the logits of the rows that asked for them. Every module call is the model's
own ``nn.Module`` (projections, norms, MoE, hyper-connections, embeddings, ``lm_head``): no weight is
copied, so a user's quantized or LoRA-wrapped modules still run. What carries state goes through
the cache's step: PLE (``ple_ngram_ids``, ``ple_conv``), the gated-delta-net layers (their conv tail
and recurrent state, ``hebrus_torch.gdn``) and indexed attention (``qsa_write``, ``qsa_select``,
``qsa_attention`` over the cells the indexer selected; a query whose history is within the budget
attends to all of it). Token-wise modules run on the packed ``[T, ...]`` activations as they are.

Leaving the transaction publishes every layer's new state at once; an exception publishes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import HebrusError
from ..model_cache import Batch, ChunkStep, ModelCache
from ..state.handles import SeqHandle
from .logits_layout import LogitsLayout

__all__ = ["ModelRunner", "find_text_model"]


def find_text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Qwen4Exp text model (embed_tokens, layers, rotary_emb) inside a causal-LM or multimodal model."""
    m = model
    for _ in range(4):
        if hasattr(m, "layers") and hasattr(m, "rotary_emb") and hasattr(m, "embed_tokens"):
            return m
        for attr in ("model", "language_model", "text_model"):
            if isinstance(getattr(m, attr, None), torch.nn.Module):
                m = getattr(m, attr)
                break
        else:
            break
    raise HebrusError(f"engine: cannot find a Qwen4Exp text model in {type(model).__name__}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on x [T, H, D] with cos/sin [T, R] (R <= D, rotate-half layout)."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rope, x_pass = x[..., :r], x[..., r:]
    return torch.cat(((x_rope * cos) + (_rotate_half(x_rope) * sin), x_pass), dim=-1)


class ModelRunner:
    """Runs packed steps of a transformers Qwen4Exp model over one ``ModelCache``.

    Args:
        model: ``Qwen4ExpForCausalLM`` (or a model holding one text model and an ``lm_head``).
        cache: the ``ModelCache`` holding every sequence's state (built with ``with_kv=True`` when the
            model has indexed-attention layers, and with a GDN holder when it has linear-attention ones).
    """

    def __init__(self, model: torch.nn.Module, cache: ModelCache):
        self.model = model
        self.text = find_text_model(model)
        self.lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
        if self.lm_head is None:
            raise HebrusError(f"engine: {type(model).__name__} has no lm_head")
        self.config = self.text.config
        self.cache = cache
        types = list(self.config.layer_types)
        if "indexed_attention" in types and (cache.qsa is None or not cache.qsa.has_kv):
            raise HebrusError("engine: the model has indexed-attention layers; its ModelCache needs a QSA cache "
                              "with K/V planes (with_kv=True)")
        if "linear_attention" in types and cache.gdn is None:
            raise HebrusError("engine: the model has linear-attention layers; its ModelCache needs a GDN holder")
        unknown = sorted(set(types) - {"indexed_attention", "linear_attention"})
        if unknown:
            raise HebrusError(f"engine: unsupported layer types {unknown}")
        self.hc_count = int(self.config.hc_count)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None     # cos/sin tables, ROPE_BLOCK rows at a time
        self.timings: collections.Counter | None = None
        """Set to a Counter to accumulate seconds per part of the step (ple, gdn, attention, moe, other):
        host wall time, so only meaningful where the ops run synchronously (CPU)."""
        self.parts: list[str] | None = None
        """Set to a list to have the part of the step now running pushed on it (``engine.step_counts``)."""

    @contextlib.contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        with self._part(part):
            if self.timings is None:
                yield
                return
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.timings[part] += time.perf_counter() - t0

    @contextlib.contextmanager
    def _part(self, part: str) -> Iterator[None]:
        """Names a part of the step for ``parts`` only (not timed)."""
        if self.parts is None:
            yield
            return
        self.parts.append(part)
        try:
            yield
        finally:
            self.parts.pop()

    @property
    def device(self) -> torch.device:
        return self.text.embed_tokens.weight.device

    @torch.no_grad()
    def execute(self, seqs: Sequence[SeqHandle], rows: Sequence[Sequence[int]],
                logit_rows: LogitsLayout | Sequence[bool | int],
                positions: Sequence[int], chunked: Sequence[bool] | None = None,
                consume: Callable[[torch.Tensor], Any] | None = None) -> Any:
        """One step: row i feeds ``rows[i]`` to sequence ``seqs[i]`` starting at position ``positions[i]``;
        the GDN layers run row i in the chunked form where ``chunked[i]`` (its whole chunks of 64 aligned
        positions; the caller cuts rows at aligned positions), else in the recurrent form.

        ``logit_rows``: where each row's logits go (a ``LogitsLayout``), or per row how many of its last tokens
        want logits (True: 1, False: 0; a speculative verification row wants all of its tokens').

        ``consume(logits)`` runs inside the transaction (what the caller reads from the logits: an exception
        there publishes nothing, as one in the model does).

        Returns:
            Tensor[n, vocab] float32: the logits at those tokens, row after row, in token order; with
            ``consume``, what it returned.
        """
        device = self.device
        batch = Batch.pack({s: torch.tensor(list(r), dtype=torch.int64) for s, r in zip(seqs, rows)},
                           first_positions={s: p for s, p in zip(seqs, positions)}, device=device)
        counts = [len(r) for r in rows]
        layout = logit_rows if isinstance(logit_rows, LogitsLayout) else LogitsLayout.of(logit_rows)
        ends = torch.tensor(layout.token_indices(counts), dtype=torch.int64, device=device)
        with self._part("transaction"), self.cache.transaction(batch) as step:
            if chunked is not None and any(chunked):
                step.gdn_start_positions = [int(p) if c else None for p, c in zip(positions, chunked)]
            pos = step.positions
            if pos is None:
                pos = torch.cat([torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(positions, counts)]
                                ).to(device) if counts else torch.empty(0, dtype=torch.int64, device=device)
            last = max((p + n - 1 for p, n in zip(positions, counts) if n), default=0)
            with self._part("other"):
                hidden = self._forward(step, batch, pos, last)
                logits = self.lm_head(hidden.index_select(0, ends)).float()
            if consume is not None:
                with self._part("engine"):
                    return consume(logits)
        return logits

    # ------------------------------------------------------------------ the model, packed
    ROPE_BLOCK = 4096

    def _rope_rows(self, positions: torch.Tensor, last: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, R] of the model's own rotary embedding at ``positions`` (largest ``last``).

        They are read from tables that the rotary module fills ROPE_BLOCK positions per call, always the
        same block per call, so a position's cos/sin never depend on which other positions share the
        step (CPU transcendental kernels give an element other bits by where it sits in a vector)."""
        blocks = 0 if self._rope is None else self._rope[0].shape[0] // self.ROPE_BLOCK
        need = last // self.ROPE_BLOCK + 1
        if self._rope is None or self._rope[0].dtype != like.dtype or need > blocks:
            done = [] if self._rope is None or self._rope[0].dtype != like.dtype else [self._rope]
            start = sum(t[0].shape[0] for t in done)
            for b0 in range(start, need * self.ROPE_BLOCK, self.ROPE_BLOCK):
                pos = torch.arange(b0, b0 + self.ROPE_BLOCK, dtype=torch.int64, device=like.device)
                cos, sin = self.text.rotary_emb(like[None, :1], pos.view(1, 1, -1).expand(3, 1, -1))
                done.append((cos[0], sin[0]))
            self._rope = (torch.cat([c for c, _ in done]), torch.cat([s for _, s in done]))
        return self._rope[0].index_select(0, positions), self._rope[1].index_select(0, positions)

    def _forward(self, step: ChunkStep, batch: Batch, positions: torch.Tensor, last: int) -> torch.Tensor:
        text = self.text
        embeds = text.embed_tokens(batch.tokens)                                      # [T, hidden]
        cos, sin = self._rope_rows(positions, last, embeds)                           # [T, R]
        h = embeds.repeat(1, self.hc_count)                                           # [T, hc * hidden]
        for idx, layer in enumerate(text.layers[: self.config.num_hidden_layers]):
            if layer.ple is not None:
                with self._timed("ple"):
                    h = h + self._ple(step, idx, layer.ple, h)
            with self._timed("hyper-connections"):
                x, hyper, inject = layer.attn_hyper_connection(h)
            if layer.layer_type == "linear_attention":
                with self._timed("gdn"):
                    out = step.linear_attention(idx, layer.linear_attn, x)
            else:
                with self._timed("attention"):
                    out = self._indexed_attention(step, idx, layer.self_attn, x, cos, sin)
            with self._timed("hyper-connections"):
                h = hyper + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
                x, hyper, inject = layer.mlp_hyper_connection(h)
            with self._timed("moe"):
                out = layer.mlp(x[None])[0]
            with self._timed("hyper-connections"):
                h = hyper + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
        return text.hyper_connection_mixer(h)

    def _ple(self, step: ChunkStep, idx: int, ple: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Qwen4ExpTextPLELayer.forward on packed rows, its n-gram ids and dilated conv through the cache."""
        hidden_size = ple.hidden_size
        ids = step.ple_ngram_ids(idx)                                                 # [T, (N-1)H]
        emb = ple.ple_embedding.ngram_embedding(ids).flatten(-2)
        key = ple.norm_key(ple.key_proj(emb)).unflatten(-1, (self.hc_count, hidden_size))
        value = ple.value_proj(emb)
        query = ple.norm_query(h).unflatten(-1, (self.hc_count, hidden_size))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = torch.sigmoid(gate) * value.unsqueeze(-2)
        gated_normed = ple.norm_conv(gated.flatten(-2))
        return gated.flatten(-2) + step.ple_conv(idx, gated_normed, ple.conv1d.weight)

    def _indexed_attention(self, step: ChunkStep, idx: int, attn: torch.nn.Module, x: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Qwen4ExpTextAttention.forward with its indexer, on packed rows, over the QSA cache."""
        t = x.shape[0]
        indexer = attn.indexer
        d_index = indexer.index_head_dim
        q_index, raw_keys = torch.split(indexer.index_qk_proj(x), [indexer.index_n_heads * d_index,
                                                                    indexer.index_kv_heads * d_index], dim=-1)
        q_index = _rope(indexer.q_layernorm(q_index.reshape(t, -1, d_index)), cos, sin)
        hd = attn.head_dim
        q, gate = torch.chunk(attn.q_proj(x).view(t, -1, hd * 2), 2, dim=-1)
        gate = gate.reshape(t, -1)
        q = _rope(attn.q_norm(q), cos, sin)
        k = _rope(attn.k_norm(attn.k_proj(x).view(t, -1, hd)), cos, sin)
        v = attn.v_proj(x).view(t, -1, hd)
        step.qsa_write(idx, raw_keys.reshape(t, d_index), k, v)
        plan = step.qsa_select(idx, q_index)
        out = step.qsa_attention(idx, q, plan, attn.scaling)
        out = out.reshape(t, -1) * torch.sigmoid(gate)
        return attn.o_proj(out)

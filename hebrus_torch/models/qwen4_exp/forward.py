"""Qwen4Exp's packed forward: every decoder layer of a transformers Qwen4Exp text model over one step's
packed rows, the state-carrying parts through a ``ChunkStep`` of the ``ModelCache``.

Every module call is the model's own ``nn.Module`` (embeddings, projections, norms, MoE,
hyper-connections): no weight is copied, so a user's quantized or LoRA-wrapped modules still run. The
routed experts of transformers' own MoE blocks run as one ``hebrus::moe_experts`` call
(:func:`hebrus_torch.moe.block.packed_moe`; any other block as its module call).
Token-wise modules run on the packed ``[T, ...]`` activations as they are; what carries state goes
through the step: PLE (:mod:`.ple`), the gated-delta-net layers (:mod:`.gdn`) and indexed attention
(:mod:`.attention`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from ...errors import HebrusError
from ...hc import hyper_premix, post_combine
from ...module_calls import embedding
from ...moe.block import packed_moe
from ...ple.prefetch import PLEPrefetcher, PrefetchedRows, PrefetchLayer, prefetch_enabled
from ...ple.row_store import DiskNgramEmbedding
from .attention import _gated_heads, packed_indexed_attention, rope_fuses
from .gdn import module_mismatch, packed_gated_delta_net
from .native import AttentionLayerCall, BoundLayer, LayerCalls, MixerCall, MoeTailCall, NativeLayers
from .ple import native_ple, packed_ple
from .rope import RopeRows

if TYPE_CHECKING:
    from ...model_cache import ChunkStep, ModelCache

Timed = Callable[[str], ContextManager]
"""``timed(part)``: a context around one part of the step ("ple", "hyper-connections", "gdn", "attention",
"moe"), for the runner's timings and step counts."""

LAYER_TYPES = ("indexed_attention", "linear_attention")


def find_text_model(model: torch.nn.Module, who: str = "engine") -> torch.nn.Module:
    """The Qwen4Exp text model (embed_tokens, layers, rotary_emb) inside a causal-LM or multimodal model;
    ``who`` names the caller in the error raised when there is none."""
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
    raise HebrusError(f"{who}: cannot find a Qwen4Exp text model in {type(model).__name__}")


_NO_PART = contextlib.nullcontext()
"""What ``_timed`` / ``_part`` give when nothing times or names the parts (reentrant: one instance serves all)."""


def _untimed(part: str) -> ContextManager:
    return _NO_PART


def _rope_function() -> Callable:
    """transformers' ``apply_rotary_pos_emb`` (what the model's attention ropes with)."""
    from ...integrations.qwen4_exp.common import _modeling

    return _modeling().apply_rotary_pos_emb


@dataclass(frozen=True)
class LayerAhead:
    """What of one decoder layer's step :meth:`PackedQwen4Exp._host_work_ahead` made before the first layer:
    ``ple_rows`` Tensor[T, (N-1)*H, dim], its PLE's n-gram rows (None: prefetched, or gathered by the layer);
    ``ple_conv``, its PLE's conv (``ChunkStep.ple_conv_call``; None: ``ChunkStep.ple_conv``); ``layer``, its native
    call bound to the step's state (None: the layer's own path)."""

    ple_rows: torch.Tensor | None = None
    ple_conv: Callable[[torch.Tensor], torch.Tensor] | None = None
    layer: BoundLayer | None = None


_NOTHING_AHEAD = LayerAhead()


class PackedQwen4Exp:
    """The packed forward of a transformers Qwen4Exp text model over a ``ModelCache``.

    Args:
        text: the text model (:func:`find_text_model`).
        cache: the ``ModelCache`` its steps run in: with a QSA cache keeping K/V planes (``with_kv=True``)
            when the model has indexed-attention layers, with a GDN holder when it has linear-attention ones.
        ple_prefetch: for PLE layers whose n-gram table is on disk (``DiskNgramEmbedding``), compute the step's
            n-gram ids as the step starts and gather their rows on a worker thread (:attr:`prefetcher`) while
            the layers before run; False: each PLE layer gathers its rows in its own call; ``"auto"``: True where
            the model is on CUDA or MPS, False on the CPU (``ple.prefetch.prefetch_enabled``).
        native_layers: on the CPU, stock decoder layers run as native calls (:mod:`.native`: the same ops, the same
            bits); False: every layer through the Python path.
    """

    def __init__(self, text: torch.nn.Module, cache: ModelCache, *, ple_prefetch: bool | str = "auto",
                 native_layers: bool = True) -> None:
        self.text = text
        self.config = text.config
        types = list(self.config.layer_types)
        if "indexed_attention" in types and (cache.qsa is None or not cache.qsa.has_kv):
            raise HebrusError("engine: the model has indexed-attention layers; its ModelCache needs a QSA cache "
                              "with K/V planes (with_kv=True)")
        if "linear_attention" in types and cache.gdn is None:
            raise HebrusError("engine: the model has linear-attention layers; its ModelCache needs a GDN holder")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise HebrusError(f"engine: unsupported layer types {unknown}")
        for idx, layer in enumerate(self._layers()):
            if layer.layer_type == "linear_attention":
                why = module_mismatch(layer.linear_attn, cache.gdn)
                if why is not None:
                    raise HebrusError(f"engine: decoder layer {idx}'s linear attention does not fit the "
                                      f"ModelCache's GDN holder: {why}")
        self.hc_count = int(self.config.hc_count)
        self._disk_tables = self._disk_ple_layers()
        on = prefetch_enabled(ple_prefetch, text.embed_tokens.weight.device)
        self.prefetcher = PLEPrefetcher() if on and self._disk_tables else None
        """The step's PLE rows gathered off the engine thread (None: no table on disk, or prefetch off)."""
        self.rope_rows = RopeRows(text.rotary_emb)
        self.rope = _rope_function() if "indexed_attention" in types else None
        self.native = NativeLayers(text.layers, self.config.num_hidden_layers, enabled=native_layers, text=text)
        """Which decoder layers run as native calls (re-resolved when their modules change)."""

    def _layers(self) -> list[torch.nn.Module]:
        """The decoder layers the forward runs, read afresh (a layer replaced in ``text.layers`` is used from the next
        call): a list, where slicing the ``ModuleList`` would build a new ``ModuleList`` on every step (~14 us)."""
        return list(self.text.layers)[: self.config.num_hidden_layers]

    def _disk_ple_layers(self) -> list[tuple[int, DiskNgramEmbedding]]:
        """(decoder-layer index, its n-gram table on disk) of every PLE layer whose table is read from disk."""
        found = []
        for idx, layer in enumerate(self._layers()):
            table = getattr(getattr(layer, "ple", None), "ple_embedding", None)
            table = getattr(table, "ngram_embedding", None)
            if isinstance(table, DiskNgramEmbedding):
                found.append((idx, table))
        return found

    def _start_prefetch(self, step: ChunkStep, device: torch.device) -> PrefetchedRows | None:
        """The step's n-gram ids of every PLE layer read from disk (each layer's history advanced, staged in
        the transaction as the layer's own call would), their rows asked of the worker."""
        if self.prefetcher is None:
            return None
        layers = [PrefetchLayer(idx, step.ple_ngram_ids(idx), table.store) for idx, table in self._disk_tables]
        return self.prefetcher.submit(layers, device)

    def close(self) -> None:
        """Stop the prefetch worker (a later step starts it again)."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    def __call__(self, step: ChunkStep, positions: torch.Tensor, last: int, timed: Timed = _untimed) -> torch.Tensor:
        """The final hidden states of a step.

        Args:
            step: the ``ChunkStep`` of the open transaction (its batch: the packed tokens).
            positions: Tensor[T] int64, every packed token's position; last: the largest of them (host int).
            timed: see :data:`Timed`.

        Returns:
            Tensor[T, hidden_size]: the hyper-connection mixer's output (what ``lm_head`` reads).
        """
        h, _, mixer = self._streams(step, positions, last, timed)
        return mixer(h) if mixer is not None else hyper_premix(self.text.hyper_connection_mixer, h)

    def streams(self, step: ChunkStep, positions: torch.Tensor, last: int, timed: Timed = _untimed
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The 4-stream residual after the last decoder layer, before the mixer: Tensor[T, hc * hidden], and the
        step's rotary (cos, sin) Tensor[T, R] (what the MTP block reuses); arguments as :meth:`__call__`."""
        return self._streams(step, positions, last, timed)[:2]

    def _streams(self, step: ChunkStep, positions: torch.Tensor, last: int, timed: Timed
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], MixerCall | None]:
        """:meth:`streams`, and the final mixer's native call where the layers ran natively (None: ``hyper_premix``)."""
        with timed("ple"):
            prefetched = self._start_prefetch(step, step.batch.tokens.device)
        try:
            return self._layers_forward(step, positions, last, timed, prefetched)
        finally:
            if prefetched is not None:
                prefetched.discard()

    def _layers_forward(self, step: ChunkStep, positions: torch.Tensor, last: int, timed: Timed,
                        prefetched: PrefetchedRows | None
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], MixerCall | None]:
        text = self.text
        embeds = embedding(text.embed_tokens, step.batch.tokens)                       # [T, hidden]
        cos, sin = self.rope_rows(positions, last, embeds)                             # [T, R]
        h = torch.cat((embeds,) * self.hc_count, dim=1)      # [T, hc * hidden]: embeds.repeat(1, hc), one copy pass
        layers = self._layers()
        native = self.native.calls(h)
        ahead = None if native is None else self._host_work_ahead(step, layers, native, h, cos, sin, prefetched)
        for idx, layer in enumerate(layers):
            h = self.decoder_layer(step, idx, layer, h, cos, sin, timed, prefetched,
                                   None if native is None else native[idx], None if ahead is None else ahead[idx])
        step.finish_qsa_layers()
        return h, (cos, sin), None if native is None else self.native.mixer

    def _host_work_ahead(self, step: ChunkStep, layers: list[torch.nn.Module], native: list[LayerCalls],
                         h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         prefetched: PrefetchedRows | None) -> list[LayerAhead]:
        """The state holders' host work of a step whose layers run as native calls, done before the first call: the
        QSA cache's step plan, the GDN state's logged pools, the rows of every PLE layer with a native gate whose
        rows were not prefetched (n-gram ids, history advanced and staged) and its conv (checked, its undo logged),
        each layer's native call bound to them, and the bound indexed layers' QSA bookkeeping settled
        (``ChunkStep.qsa_layer_call``). Between two layers' calls the host runs with cold caches (each
        call streams megabytes of weights through them), several times slower than here, next to the step's other
        host work; what is left there is the calls. Returns per decoder layer what was made ahead of it.

        Indexed layers are bound only where every one of them fuses: otherwise a layer that writes the QSA cache
        through its own modules runs between them, and the others read the cache's planes when they run."""
        plan = step.qsa_step_plan() if any(calls.attention is not None for calls in native) else None
        rope = self.rope if self.rope is not None else _rope_function()
        qsa = step.cache.qsa
        fused = [plan is not None and calls.attention is not None and qsa.v_head_dim == calls.attention.dims[3]
                 and rope_fuses(rope, cos, sin, h.shape[0], h.dtype, calls.attention.rope_dims)
                 for calls in native]
        bind_attention = all(f for f, layer in zip(fused, layers) if layer.layer_type != "linear_attention")
        ahead = []
        for idx, (layer, calls) in enumerate(zip(layers, native)):
            rows = conv = bound = None
            if calls.ple is not None and layer.ple is not None:
                if prefetched is None or idx not in prefetched:
                    rows = embedding(layer.ple.ple_embedding.ngram_embedding, step.ple_ngram_ids(idx))
                conv = step.ple_conv_call(idx, h.dtype, calls.ple.conv_weight)
            if calls.layer is not None:
                bound = step.gdn_layer_call(idx, h, calls.layer)      # (the step's pools at the first)
            elif fused[idx] and bind_attention:
                bound = step.qsa_layer_call(idx, calls.attention, cos, sin)
            ahead.append(_NOTHING_AHEAD if rows is None and conv is None and bound is None
                         else LayerAhead(rows, conv, bound))
        step.settle_qsa_layers()        # (the bound indexed layers' bookkeeping, while the caches are warm)
        return ahead

    def decoder_layer(self, step: ChunkStep, idx: int, layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, timed: Timed = _untimed, prefetched: PrefetchedRows | None = None,
                      native: LayerCalls | None = None, ahead: LayerAhead | None = None) -> torch.Tensor:
        """One ``Qwen4ExpTextDecoderLayer`` (decoder layer ``idx`` of the step's state) on the streams
        h Tensor[T, hc * hidden] -> Tensor[T, hc * hidden]; ``prefetched``: the step's PLE rows gathered off
        the engine thread (None: the PLE layer gathers its own); ``native``: what of the layer runs as a native
        call (:meth:`NativeLayers.calls`; None: nothing); ``ahead``: what of the layer's step was made before the
        first layer (:meth:`_host_work_ahead`)."""
        if layer.ple is not None:
            with timed("ple"):
                rows = None
                if prefetched is not None and idx in prefetched:
                    rows = prefetched.rows(idx, layer.ple.ple_embedding.ngram_embedding.out_dtype)
                elif ahead is not None:
                    rows = ahead.ple_rows
                gate = None if native is None else native.ple
                h = h + (packed_ple(step, idx, layer.ple, h, rows) if gate is None else
                         native_ple(step, idx, layer.ple, gate, h, rows, None if ahead is None else ahead.ple_conv))
        if ahead is not None and ahead.layer is not None:
            with timed("native layer"):
                return ahead.layer(h)
        tail = None if native is None else native.tail
        if layer.layer_type == "linear_attention":
            return packed_decoder_layer(layer, h, partial(packed_gated_delta_net, step, idx, layer.linear_attn),
                                        "gdn", timed, tail)
        rope = self.rope if self.rope is not None else _rope_function()
        call = None if native is None else native.attention
        if call is not None and rope_fuses(rope, cos, sin, h.shape[0], h.dtype, call.rope_dims):
            return self._native_attention_layer(step, idx, layer, call, h, cos, sin, timed)
        return packed_decoder_layer(layer, h, partial(packed_indexed_attention, step, idx, layer.self_attn,
                                                      cos=cos, sin=sin, rope=rope), "attention", timed, tail)

    @staticmethod
    def _native_attention_layer(step: ChunkStep, idx: int, layer: torch.nn.Module, call: AttentionLayerCall,
                                h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, timed: Timed) -> torch.Tensor:
        """An indexed-attention layer as one native call over the QSA cache's step plan (``ChunkStep.qsa_layer``)
        where the cache planned the step once, else as its native head, the QSA cache's write, selection and
        attention (what ``packed_indexed_attention`` asks of the step), and its native tail."""
        step_plan = step.qsa_step_plan()
        if step_plan is not None and step.cache.qsa.v_head_dim == call.dims[3]:
            with timed("native layer"):
                return step.qsa_layer(idx, partial(call.whole, h, cos, sin))
        with timed("native layer"):
            inject, q_index, raw_keys, q, k, v, gate = call.head(h, cos, sin)
        with timed("attention"):
            step.qsa_write(idx, raw_keys, k, v)
            out = step.qsa_attention(idx, q, step.qsa_select(idx, q_index), call.scaling)
        if out.shape == gate.shape and out.dtype == gate.dtype:
            with timed("native layer"):
                return call.finish(h, out, gate, inject)
        out = _gated_heads(layer.self_attn, out, gate)
        return _after_mixer(layer, h, out, inject, timed, call.tail)


def packed_decoder_layer(layer: torch.nn.Module, h: torch.Tensor, mixer: Callable[[torch.Tensor], torch.Tensor],
                         part: str = "mixer", timed: Timed = _untimed, tail: MoeTailCall | None = None
                         ) -> torch.Tensor:
    """One decoder layer after its PLE on packed rows: the attention hyper-connection, the token mixer, the
    MLP hyper-connection and the MoE block (:func:`~hebrus_torch.moe.block.packed_moe`), each on the layer's
    own modules.

    Args:
        layer: a ``Qwen4ExpTextDecoderLayer``; h: Tensor[T, hc * hidden] (the hyper-connection streams).
        mixer: the layer's token mixer on x Tensor[T, hidden] -> Tensor[T, hidden] (the GDN or the indexed
            attention, its state through a ``ChunkStep``, or the hebrus slot ops on explicit pools).
        part: the mixer's name for ``timed``.
        tail: the layer's part after the mixer as one native call (``NativeLayers``; the same ops), used where the
            mixer's output has the streams' dtype; None: that part op by op.

    Returns:
        Tensor[T, hc * hidden]. No Python decision depends on tensor values, so ``torch.compile(fullgraph=True)``
        traces it whole when ``mixer`` is made of tensor ops and hebrus ops (tests/test_compile.py).
    """
    with timed("hyper-connections"):
        x, hyper, inject = hyper_premix(layer.attn_hyper_connection, h)
    with timed(part):
        out = mixer(x)
    return _after_mixer(layer, hyper, out, inject, timed, tail)


def _after_mixer(layer: torch.nn.Module, hyper: torch.Tensor, out: torch.Tensor, inject: torch.Tensor, timed: Timed,
                 tail: MoeTailCall | None) -> torch.Tensor:
    """:func:`packed_decoder_layer` after the token mixer's output out Tensor[T, hidden]: post-combine, the MLP
    pre-mix, the MoE block, post-combine (one native call where ``tail`` is given and out has the streams'
    dtype)."""
    if tail is not None and out.dim() == 2 and out.dtype == hyper.dtype:
        with timed("native layer"):
            return tail(hyper, out, inject)
    with timed("hyper-connections"):
        h = post_combine(hyper, out, inject)
        x, hyper, inject = hyper_premix(layer.mlp_hyper_connection, h)
    with timed("moe"):
        out = packed_moe(layer.mlp, x)
    with timed("hyper-connections"):
        return post_combine(hyper, out, inject)

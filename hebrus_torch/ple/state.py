"""PLEState: per-sequence n-gram history and dilated-conv tails of a model's PLE layers (SPEC §2, §4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import HebrusError
from ..state import blob
from ..state.args import FLOAT_DTYPES, as_int, as_tensor, conv_weight
from ..state.handles import SeqHandle, SlotTable
from ..state.plain_attrs import PlainAttrs
from ..state.replay import ReplayLog
from ..state.slot_pool import RowsUndo, SeqPart, SlotPoolHolder, SlotUndo
from ..state.transaction import Transactional, atomic
from . import ops

_KIND = "hebrus_torch.PLEState"


@dataclass(frozen=True)
class PLESnapshot:
    """An in-memory copy of one sequence's PLE state, for rewinding (a conv tail cannot be recomputed backwards).

    ``position`` is the caller's label for the next position the sequence would consume (ModelCache
    uses the QSA frontier + 1); PLEState itself does not interpret it.
    """

    handle: SeqHandle
    position: int | None
    history: torch.Tensor      # [layers, N-1] int64
    conv_tails: torch.Tensor   # [layers, L, C]


@dataclass(frozen=True)
class _TailUndo:
    """conv's undo, only what the in-place update dropped: a row that consumed n tokens lost the first
    min(n, L) entries of its tail (the rest moved n places left), so ``rows[b, :n]`` ++ the current
    ``tail[:L - n]`` is the old tail. ``kept`` is min(n, L) per row (host ints), or None where every row's
    whole tail was kept (``rows`` is then the old tails)."""

    layer: int
    slots: torch.Tensor        # [B] int32 or int64
    kept: list[int] | None     # [B], min(n, L) per row
    rows: torch.Tensor         # [B, max kept, C]


@dataclass(eq=False)
class _ArmedUndo:
    """An undo entry logged before the write it undoes (``conv_call``), applied only once armed: when the op ran,
    or raised after writing (the pool's version counter moved)."""

    entry: _TailUndo
    armed: bool = False


@dataclass(frozen=True)
class PLEHashParams:
    """One PLE layer's n-gram hash buffers (transformers' ``Qwen4ExpTextNGramEmbedding``)."""

    multipliers: torch.Tensor  # [N] int64, layer_multipliers
    vocab_sizes: torch.Tensor  # [(N-1)*H] int64, ngram_heads_vocab_sizes
    offsets: torch.Tensor      # [(N-1)*H] int64, ngram_heads_offsets


class PLEState(PlainAttrs, SlotPoolHolder, torch.nn.Module, Transactional):
    """Owns, per sequence slot and PLE layer, the n-gram history ``[N-1]`` and the conv tail ``[L, C]``.

    Buffers (``state_dict``): ``history`` [layers, S, N-1] int64 (each layer carries its own, as
    transformers' cache does, so a layer never depends on whether another ran this chunk), ``conv_state`` [layers, S, L, C] of ``dtype``,
    ``generation`` [S] int64 and ``live`` [S] bool. L = (K-1) * dilation. Sequences are addressed by
    ``SeqHandle``; a chunk runs through :meth:`ngram_ids` (once per chunk) and :meth:`conv` (once per
    layer), which update each sequence's state in place by slot (``hebrus::ple_ngram_ids_slots`` /
    ``hebrus::ple_conv_slots``) and log what they overwrite: a rollback of the enclosing
    :func:`hebrus_torch.transaction` restores it bitwise; its commit has nothing left to publish.

    Args:
        num_layers: number of PLE layers.
        channels: conv channels C (``hidden_size * hc_count`` for Qwen4Exp).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        eos_token_id: the EOS id of the history rule: any int64, inside the vocabulary or not (SPEC §2).
        ngram_size: N (history length N-1).
        conv_kernel_size: K.
        dilation: conv dilation (Qwen4Exp: N).
        max_sequences: number of slots S.
        dtype: dtype of the conv tails (the model's activation dtype).
        hash_params: optional per-layer :class:`PLEHashParams` used by :meth:`ngram_ids`.
        conv_weights: optional per-layer conv weights ``[C, K]`` used by :meth:`conv` when none is passed.
        activation: ``"silu"`` (Qwen4Exp) or ``"none"``.
    """

    _STATE_OWNER = "PLEState"
    _KIND = _KIND
    _SNAPSHOT = PLESnapshot
    # The pools, per layer and slot (updated in place, undo-logged); the state dict adds generation, live.
    _SEQ_PARTS = (SeqPart("history", "history", "history", "history", True),
                  SeqPart("conv_state", "conv_tails", "tails", "conv tails", False))

    def __init__(self, num_layers: int, channels: int, *, vocab_size: int, eos_token_id: int,
                 ngram_size: int = 3, conv_kernel_size: int = 4, dilation: int | None = None,
                 max_sequences: int = 64, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 hash_params: Sequence[PLEHashParams] | None = None,
                 conv_weights: Sequence[torch.Tensor] | None = None, activation: str = "silu"):
        super().__init__()
        # Plain ints: the config is saved as JSON and compared with exact types on restore.
        num_layers, channels = as_int("PLEState: num_layers", num_layers), as_int("PLEState: channels", channels)
        vocab_size = as_int("PLEState: vocab_size", vocab_size)
        eos_token_id = as_int("PLEState: eos_token_id", eos_token_id)
        ngram_size = as_int("PLEState: ngram_size", ngram_size)
        conv_kernel_size = as_int("PLEState: conv_kernel_size", conv_kernel_size)
        dilation = None if dilation is None else as_int("PLEState: dilation", dilation)
        max_sequences = as_int("PLEState: max_sequences", max_sequences)
        if num_layers < 1 or channels < 1 or ngram_size < 2 or conv_kernel_size < 1:
            raise HebrusError(f"PLEState: need num_layers, channels, conv_kernel_size >= 1 and ngram_size >= 2, got "
                              f"{num_layers}, {channels}, {conv_kernel_size}, {ngram_size}")
        self.num_layers, self.channels = num_layers, channels
        self.vocab_size, self.eos_token_id, self.ngram_size = vocab_size, eos_token_id, ngram_size
        self.conv_kernel_size = conv_kernel_size
        self.dilation = ngram_size if dilation is None else dilation
        if self.dilation < 1:
            raise HebrusError(f"PLEState: dilation must be >= 1, got {self.dilation}")
        if dtype not in FLOAT_DTYPES:
            raise HebrusError(f"PLEState: dtype must be float32, float16 or bfloat16, got {dtype}")
        if activation not in ("silu", "none"):
            raise HebrusError(f"PLEState: activation must be 'silu' or 'none', got {activation!r}")
        self.state_len = (conv_kernel_size - 1) * self.dilation
        self.activation = activation
        self.slots = SlotTable(max_sequences, "PLEState")
        self.register_buffer("history", torch.full((num_layers, max_sequences, ngram_size - 1), eos_token_id,
                                                   dtype=torch.int64, device=device))
        self.register_buffer("conv_state", torch.zeros((num_layers, max_sequences, self.state_len, channels),
                                                       dtype=dtype, device=device))
        self._register_slot_buffers(device)
        if hash_params is not None and len(hash_params) != num_layers:
            raise HebrusError(f"PLEState: hash_params has {len(hash_params)} entries for {num_layers} layers")
        if conv_weights is not None and len(conv_weights) != num_layers:
            raise HebrusError(f"PLEState: conv_weights has {len(conv_weights)} entries for {num_layers} layers")
        for i, p in enumerate(hash_params or []):
            self.register_buffer(f"multipliers_{i}", p.multipliers.clone().to(device), persistent=False)
            self.register_buffer(f"vocab_sizes_{i}", p.vocab_sizes.clone().to(device), persistent=False)
            self.register_buffer(f"offsets_{i}", p.offsets.clone().to(device), persistent=False)
        self._has_hash = hash_params is not None
        self._conv_weights = list(conv_weights) if conv_weights is not None else None
        # Every change is made in place (the slot ops update the pool rows by slot id; lifecycle ops write
        # slots); the undo log of the open transaction holds what each change overwrote, in order.
        self._undo: list[SlotUndo | RowsUndo | _TailUndo] = []
        self._base = None
        # The slot index of the last chunk, (key, int32 tensor): every layer of a step, and usually the next
        # step, runs the same sequences (see _slot_index). And views of conv_state per layer (_tail_pools).
        self._index_cache: tuple | None = None
        self._pool_cache: tuple | None = None
        self._history_cache: tuple | None = None      # views of history per layer (_history_pool)
        self._weight_cache: dict[int, tuple] = {}      # per layer: a conv weight and its [C, K] form (conv_call)
        self.replay_log: ReplayLog | None = None
        """While set, the state ops record their inputs there (speculative decoding: ``state/replay.py``)."""

    # Bookkeeping set on every transaction and chunk, never a parameter, buffer or module (state/plain_attrs.py).
    _PLAIN_ATTRS = frozenset({"_undo", "_base", "_txn_depth_owner", "_index_cache", "_pool_cache", "_history_cache",
                              "_weight_cache", "replay_log"})

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_transformers(cls, model: torch.nn.Module, *, max_sequences: int = 64) -> "PLEState":
        """Build from a transformers Qwen4Exp model (``Qwen4ExpForCausalLM`` or its text model).

        Hash buffers are copied; conv weights are referenced (they follow the model's parameters).
        ``layer_ids`` maps PLE index -> decoder layer index.
        """
        text = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
        config = text.config
        layers = [(i, layer.ple) for i, layer in enumerate(text.layers) if getattr(layer, "ple", None) is not None]
        if not layers:
            raise HebrusError("PLEState.from_transformers: the model has no PLE layers (config.ple_layer_ids is empty)")
        emb0 = layers[0][1].ple_embedding
        conv0 = layers[0][1].conv1d
        state = cls(
            len(layers), conv0.weight.shape[0], vocab_size=config.vocab_size, eos_token_id=emb0.eos_token_id,
            ngram_size=emb0.ngram_size, conv_kernel_size=conv0.kernel_size[0], dilation=conv0.dilation[0],
            max_sequences=max_sequences, dtype=conv0.weight.dtype, device=conv0.weight.device,
            hash_params=[PLEHashParams(p.ple_embedding.layer_multipliers, p.ple_embedding.ngram_heads_vocab_sizes,
                                       p.ple_embedding.ngram_heads_offsets) for _, p in layers],
            conv_weights=[p.conv1d.weight for _, p in layers],
        )
        state.layer_ids = [i for i, _ in layers]
        return state

    def hash_params(self, layer: int) -> PLEHashParams:
        if not self._has_hash:
            raise HebrusError("PLEState: built without hash_params; pass them to ngram_ids via ple_ngram_ids directly")
        self._check_layer(layer)
        buffers = self._buffers         # (the module's own dict: no nn.Module.__getattr__ per buffer, every step)
        return PLEHashParams(buffers[f"multipliers_{layer}"], buffers[f"vocab_sizes_{layer}"],
                             buffers[f"offsets_{layer}"])

    # ----------------------------------------------------------------------------- lifecycle
    # new_sequence, free, reset, clear, copy, fork, keep: SlotLifecycle, over the slot primitives below
    # (a fresh slot: history all EOS, zero tails).
    # snapshot, restore (a PLESnapshot or the bytes of save), save: SlotPoolHolder, over history, conv_tails.

    # ----------------------------------------------------------------------------- chunk execution
    def ngram_ids(self, layer: int, seqs: Sequence[SeqHandle], tokens: torch.Tensor,
                  cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Row ids ``[T, (N-1)*H]`` int64 of a packed chunk for PLE layer ``layer``; updates its history in place.

        Args: seqs: one handle per packed row; tokens: Tensor[T] int64; cu_seqlens: Tensor[B+1] int32.
        """
        slots = self._slots_of(seqs, cu_seqlens)
        p = self.hash_params(layer)
        pool = self._history_pool(layer)
        index = self._slot_index(slots, pool.device)
        with atomic(self):
            # In place by slot (hebrus::ple_ngram_ids_slots). The undo entry (the rows' whole old histories,
            # so applying it is right whether or not the op wrote) is logged before the write: an exception
            # after the write (a KeyboardInterrupt, a fault in a wrapper) is still undone.
            old = pool.index_select(0, index)
            self._undo.append(RowsUndo("history", layer, index, old))
            if self.replay_log is not None:
                self.replay_log.record(self, "ngram_ids", layer, seqs, cu_seqlens, {"tokens": tokens}, ("history", old))
            return ops.ple_ngram_ids_slots(tokens, cu_seqlens, pool, index, p.multipliers,
                                           p.vocab_sizes, p.offsets, self.eos_token_id, self.vocab_size)

    def conv(self, layer: int, seqs: Sequence[SeqHandle], x: torch.Tensor, cu_seqlens: torch.Tensor,
             weight: torch.Tensor | None = None) -> torch.Tensor:
        """Dilated causal conv ``[T, C]`` of a packed chunk for PLE layer ``layer``; updates its tails in place.

        ``weight`` is ``[C, K]`` (or transformers' ``[C, 1, K]``); defaults to the layer's registered weight.
        """
        self._check_layer(layer)
        x = as_tensor("PLEState.conv: x", x)
        state = self._buffers["conv_state"]
        if x.dtype != state.dtype and torch.promote_types(x.dtype, state.dtype) != state.dtype:
            # The conv runs in x's dtype and the carried tail is stored in the state's: a state narrower than x
            # would round the tail at every chunk boundary, so outputs would depend on how the stream is
            # chunked (SPEC §5.1). A state at least as wide as x holds x's values exactly.
            raise HebrusError(f"PLEState.conv: x is {x.dtype} but the conv state is {self.conv_state.dtype}, which "
                              f"cannot hold x's values exactly; pass x in a dtype the state holds exactly (or cast "
                              f"the holder with .to(dtype))")
        slots = self._slots_of(seqs, cu_seqlens)
        weight = conv_weight("PLEState.conv", layer, weight, self._conv_weights, ("C", self.channels),
                             self.conv_kernel_size, x.dtype, x.device)
        pool, first = self._tail_pools(layer)
        index = self._slot_index(slots, pool.device)
        if self.replay_log is not None:     # (the undo entry below keeps only what a decode drops: copy the tails)
            self.replay_log.record(self, "conv", layer, seqs, cu_seqlens, {"x": x},
                                   ("conv_state", pool.index_select(0, index)), weight=weight)
        in_place = x.dtype == pool.dtype and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        if in_place:
            return self._in_place_conv(layer, pool, first, index, cu_seqlens, weight)(x)
        with atomic(self):
            # x narrower than the state, or a conv whose output must carry autograd history (the op's
            # output requires grad when the weight does): gather, op, write back (the state itself
            # carries no autograd history).
            old = pool.index_select(0, index)
            y, new_state = ops.ple_conv(x, weight, cu_seqlens, old.to(x.dtype), self.dilation, self.activation)
            with torch.no_grad():
                pool.index_copy_(0, index.long(), new_state.detach().to(pool.dtype))
            self._undo.append(_TailUndo(layer, index, None, old))
        return y

    def conv_call(self, layer: int, seqs: Sequence[SeqHandle], cu_seqlens: torch.Tensor, dtype: torch.dtype,
                  weight: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """:meth:`conv` of a packed chunk's inputs in ``dtype``, made ahead inside a transaction: the checks run, the
        slots are indexed and the undo entry is logged now; the returned ``conv(x)`` Tensor[T, C] -> Tensor[T, C] is
        the in-place op alone. What a model's step calls before its first layer, so that between two layers'
        native calls only the op is left (``ChunkStep.ple_conv_call``). The entry is applied on rollback only once
        the op ran (``_ArmedUndo``: the entry restores old tails from the updated ones), or holds whole tails
        where the pool has no version counter (an inference tensor). None where :meth:`conv` would not update the
        tails in place (outside a transaction, with a replay log, ``dtype`` not the state's, grad mode on): call
        :meth:`conv` then."""
        self._check_layer(layer)
        pool, first = self._tail_pools(layer)
        if not self.in_transaction or self.replay_log is not None or dtype != pool.dtype or torch.is_grad_enabled():
            return None
        slots = self._slots_of(seqs, cu_seqlens)
        held = self._weight_cache.get(layer)
        if held is not None and held[0] is weight and weight is not None and held[1] == weight.data_ptr() \
                and held[2] == weight.shape and held[3] == dtype:
            weight = held[4]        # (the same tensor as last step's, its data unmoved: its [C, K] form again)
        else:
            given = weight
            weight = conv_weight("PLEState.conv", layer, weight, self._conv_weights, ("C", self.channels),
                                 self.conv_kernel_size, dtype, pool.device)
            if given is not None and weight.data_ptr() == given.data_ptr():     # (a view of it: no copy kept)
                self._weight_cache[layer] = (given, given.data_ptr(), given.shape, dtype, weight)
        return self._in_place_conv(layer, pool, first, self._slot_index(slots, pool.device), cu_seqlens, weight)

    def _in_place_conv(self, layer: int, pool: torch.Tensor, first: torch.Tensor, index: torch.Tensor,
                       cu_seqlens: torch.Tensor, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``conv(x)``: hebrus::ple_conv_slots over layer ``layer``'s tails (``pool``) at the slots ``index``, which
        updates them in place and refuses before writing anything. Outside a transaction nothing can roll it back,
        so nothing is logged; inside one, the undo entry is logged now, before the write, so that an exception after
        it (a KeyboardInterrupt, a fault in a wrapper) is undone too. The entry keeps only what the update drops
        (decode: one of the L rows per sequence) and restores the old tails from the updated ones, so it is an
        ``_ArmedUndo``, applied only once the op ran or raised after writing (the pool's version counter, bumped by
        the op's write, says which). An inference tensor has no version counter: it logs whole tails, right either
        way."""
        dilation, activation = self.dilation, self.activation

        def op(x: torch.Tensor) -> torch.Tensor:
            return ops.ple_conv_slots(x, weight, cu_seqlens, pool, index, dilation, activation)
        if not self.in_transaction:
            return op
        counted = not pool.is_inference()
        entry = self._tail_undo(layer, pool, first, index, cu_seqlens, whole=not counted)
        if not counted:
            self._undo.append(entry)
            return op
        armed = _ArmedUndo(entry)
        self._undo.append(armed)

        def conv(x: torch.Tensor) -> torch.Tensor:
            version, armed.armed = pool._version, True
            try:
                return op(x)
            except BaseException:
                armed.armed = pool._version != version     # (a refused op wrote nothing: nothing to undo)
                raise
        return conv

    # ----------------------------------------------------------------------------- transactions
    # The undo log's hooks (_txn_begin ... _txn_restore, _log_slot): SlotPoolHolder; conv's undo entries
    # (_TailUndo, _ArmedUndo) are applied here.
    def _apply_undo(self, entry) -> None:
        if isinstance(entry, _ArmedUndo):
            if entry.armed:
                self._apply_undo(entry.entry)
            return
        if not isinstance(entry, _TailUndo):
            return super()._apply_undo(entry)
        with torch.no_grad():
            pool = self.conv_state[entry.layer]
            slots = entry.slots.long()
            rows = entry.rows.to(pool.dtype)
            if entry.kept is None:
                old = rows
            else:
                # old[b, j] = rows[b, j] for j < kept[b], else current[b, j - kept[b]]: rows of
                # rows ++ current picked by index_select, which keeps every bit (gather turned the NaN
                # payloads of 16-bit tails into 0xFFFF).
                current = pool.index_select(0, slots)
                batch, width, length = rows.shape[0], rows.shape[1], self.state_len
                j = torch.arange(length, device=pool.device)[None, :]
                kept = torch.tensor(entry.kept, dtype=torch.int64, device=pool.device)[:, None]
                src = torch.where(j < kept, j, width + j - kept)
                src = src + torch.arange(batch, device=pool.device)[:, None] * (width + length)
                both = torch.cat([rows, current], dim=1).reshape(batch * (width + length), pool.shape[2])
                old = both.index_select(0, src.reshape(-1)).reshape(batch, length, pool.shape[2])
            pool.index_copy_(0, slots, old)

    def _tail_undo(self, layer: int, pool: torch.Tensor, first: torch.Tensor, index: torch.Tensor,
                   cu_seqlens: torch.Tensor, whole: bool = False) -> _TailUndo:
        """What ple_conv_slots drops from each row's tail: its first min(n, L) entries. The token counts
        come from cu_seqlens on the host where it lives there (int32, as the op takes it); on a device,
        or with ``whole``, every row keeps its whole tail (no host read inside a step)."""
        if not whole and cu_seqlens.device.type == "cpu" and cu_seqlens.dtype == torch.int32:
            cu = cu_seqlens.tolist()
            length = self.state_len
            kept = [min(max(b - a, 0), length) for a, b in zip(cu, cu[1:])]
            width = max(kept, default=0)
        else:
            kept, width = None, self.state_len
        source = first if width == first.shape[1] else pool.narrow(1, 0, width)
        rows = source.index_select(0, index)   # 2-5x faster than pool[index, :width]
        return _TailUndo(layer, index, kept, rows)

    def _history_pool(self, layer: int) -> torch.Tensor:
        """``history[layer]`` Tensor[S, N-1] int64, a view made once for the buffer (as :meth:`_tail_pools`): each
        indexing op costs several microseconds inside a step. Made again when ``history`` is another tensor or has
        moved."""
        state = self._buffers["history"]
        cache = self._history_cache
        if cache is None or cache[0] is not state or cache[1] != state.data_ptr():
            cache = self._history_cache = (state, state.data_ptr(), state.unbind(0))
        return cache[2][layer]

    def _tail_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of layer ``layer``'s tails, ``conv_state[layer]`` and its first entries ``[S, 1, C]`` (what
        a decode step's undo copies), made once for the buffer rather than at every call: with cold caches
        each indexing op costs ~0.1 ms, as much as a decode step's undo copy. Made again when
        ``conv_state`` is another tensor or has moved (``_apply`` and ``load_state_dict`` drop them)."""
        state = self._buffers["conv_state"]
        cache = self._pool_cache
        if cache is None or cache[0] is not state or cache[1] != state.data_ptr():
            views = [(pool, pool.narrow(1, 0, min(1, self.state_len))) for pool in state.unbind(0)]
            cache = self._pool_cache = (state, state.data_ptr(), views)
        return cache[2][layer]

    # ----------------------------------------------------------------------------- device / dtype moves
    # _check_apply: SlotPoolHolder.
    def _apply(self, fn, recurse: bool = True):
        self._check_apply(fn)
        self._index_cache = self._pool_cache = self._history_cache = None   # (they would keep the old tensors alive)
        self._weight_cache = {}
        return super()._apply(fn, recurse)

    # ----------------------------------------------------------------------------- whole-holder state
    # digest, state_dict / load_state_dict / check_state_dict / publish_state_dict and their checks:
    # SlotPoolHolder (over StateDictProtocol), with the value checks below.
    def _check_state_values(self, sd: dict[str, Any]) -> None:
        tokens_ok = ((sd["history"] >= 0) & (sd["history"] < self.vocab_size)) | (sd["history"] == self.eos_token_id)
        blob.expect(_KIND, bool(tokens_ok.all()), f"history ids outside [0, {self.vocab_size}) that are not the EOS id")

    def _check_seq_values(self, parts: tuple[torch.Tensor, ...], error: type) -> None:
        history = parts[0]
        if bool((((history < 0) | (history >= self.vocab_size)) & (history != self.eos_token_id)).any()):
            raise error(f"PLEState: history ids {history.tolist()} outside [0, {self.vocab_size}) that are not "
                        f"the EOS id {self.eos_token_id}")

    def _seq_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        if type(meta.get("max_sequences")) is int:   # blobs of earlier builds record it: restorable into any slot count
            meta = {k: v for k, v in meta.items() if k != "max_sequences"}
        return meta

    def _fresh_value(self, pool: str) -> int:
        return self.eos_token_id if pool == "history" else 0   # a fresh slot: history all EOS, zero tails

    def _drop_caches(self) -> None:
        self._index_cache = self._pool_cache = self._history_cache = None
        self._weight_cache = {}

    # ----------------------------------------------------------------------------- internals
    def _config_meta(self) -> dict[str, Any]:
        return {"layers": self.num_layers, "channels": self.channels, "ngram_size": self.ngram_size,
                "state_len": self.state_len, "kernel": self.conv_kernel_size, "dilation": self.dilation,
                "eos": self.eos_token_id, "vocab": self.vocab_size, "dtype": str(self.conv_state.dtype),
                "max_sequences": self.slots.capacity}

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise HebrusError(f"PLEState: layer {layer} outside [0, {self.num_layers})")

    def _slots_of(self, seqs: Sequence[SeqHandle], cu_seqlens: torch.Tensor) -> list[int]:
        slots = self.slots.check_all(seqs)
        if len(set(slots)) != len(slots):
            raise HebrusError(f"PLEState: a sequence appears twice in one packed chunk: {list(seqs)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != len(slots) + 1:
            raise HebrusError(f"PLEState: cu_seqlens must have {len(slots) + 1} entries for {len(slots)} sequences, "
                              f"got shape {tuple(cu_seqlens.shape)}")
        return slots

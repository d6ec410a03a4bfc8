"""GDNState: per-sequence conv tails and recurrent states of a model's gated-delta-net layers (SPEC §4, §8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import HebrusError
from ..ple import ops as ple_ops
from ..state.args import FLOAT_DTYPES, as_int, as_tensor, conv_weight
from ..state.handles import SeqHandle, SlotTable
from ..state.host_mirror import host_ints
from ..state.layer_views import LayerViews
from ..state.plain_attrs import PlainAttrs
from ..state.replay import ReplayLog
from ..state.slot_pool import RowsUndo, SeqPart, SlotPoolHolder, SlotUndo
from ..state.transaction import Transactional, atomic
from .chunked import chunk_gated_delta_rule_slots
from .delta_rule import gated_delta_rule_slots

_KIND = "hebrus_torch.GDNState"
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "none": "none", None: "none"}


@dataclass(frozen=True)
class GDNSnapshot:
    """An in-memory copy of one sequence's GDN state (neither part can be recomputed backwards).

    ``position`` is the caller's label for the next position the sequence would consume; GDNState
    does not interpret it.
    """

    handle: SeqHandle
    position: int | None
    conv_tails: torch.Tensor   # [layers, K-1, conv_dim], the state's dtype
    recurrent: torch.Tensor    # [layers, Hv, Dk, Dv] float32


class GDNState(PlainAttrs, SlotPoolHolder, torch.nn.Module, Transactional):
    """Owns, per sequence slot and GDN layer, the conv tail ``[K-1, conv_dim]`` and the recurrent state
    ``[Hv, Dk, Dv]`` of Qwen4Exp's ``linear_attention`` layers (transformers' ``Qwen4ExpTextGatedDeltaNet``).

    Buffers (``state_dict``): ``conv_state`` [layers, S, K-1, conv_dim] of ``dtype`` (the last K-1 conv
    inputs, oldest first; zero for a fresh sequence), ``recurrent_state`` [layers, S, Hv, Dk, Dv] float32
    (zero for a fresh sequence; it stays float32 under ``.to(dtype)``), ``generation`` [S] int64 and
    ``live`` [S] bool. Sequences are addressed by ``SeqHandle``; a step runs through :meth:`conv` and
    :meth:`delta_rule` once per layer (or :func:`hebrus_torch.gdn.gdn_forward`), which update each
    sequence's state in place by slot (``hebrus::ple_conv_slots`` / ``hebrus::gdn_delta_rule_slots``: no
    gather or scatter of state) after logging the rows they overwrite: a rollback of the enclosing
    :func:`hebrus_torch.transaction` (or of the call's own, when there is none) restores them bitwise;
    a commit has nothing left to publish.

    Args:
        num_layers: number of GDN layers.
        num_key_heads, num_value_heads: Hk and Hv (Hv a multiple of Hk).
        key_head_dim, value_head_dim: Dk and Dv.
        conv_kernel_size: K (``linear_conv_kernel_dim``).
        max_sequences: number of slots S.
        dtype: dtype of the conv tails (the model's activation dtype).
        conv_weights: optional per-layer conv weights ``[conv_dim, K]`` used by :meth:`conv` when none is passed.
        activation: the conv's activation, ``"silu"`` (Qwen4Exp) or ``"none"``.
    """

    # Bookkeeping set on every transaction and operation, never a parameter, buffer or module (state/plain_attrs.py).
    _PLAIN_ATTRS = frozenset({"_undo", "_undo_used", "_base", "_txn_depth_owner", "_index_cache", "replay_log"})

    _STATE_OWNER = "GDNState"
    _KIND = _KIND
    _SNAPSHOT = GDNSnapshot
    # The pools, per layer and slot (updated in place, undo-logged); the state dict adds generation, live.
    _SEQ_PARTS = (SeqPart("conv_state", "conv_tails", "conv_tails", "conv tails", False),
                  SeqPart("recurrent_state", "recurrent", "recurrent", "recurrent states", True))

    def __init__(self, num_layers: int, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel_size: int = 4, max_sequences: int = 64,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 conv_weights: Sequence[torch.Tensor] | None = None, activation: str | None = "silu"):
        super().__init__()
        num_layers = as_int("GDNState: num_layers", num_layers)
        hk, hv = as_int("GDNState: num_key_heads", num_key_heads), as_int("GDNState: num_value_heads", num_value_heads)
        dk, dv = as_int("GDNState: key_head_dim", key_head_dim), as_int("GDNState: value_head_dim", value_head_dim)
        conv_kernel_size = as_int("GDNState: conv_kernel_size", conv_kernel_size)
        max_sequences = as_int("GDNState: max_sequences", max_sequences)
        if min(num_layers, hk, hv, dk, dv) < 1 or conv_kernel_size < 2:
            raise HebrusError(f"GDNState: need num_layers, heads and head dims >= 1 and conv_kernel_size >= 2, got "
                              f"layers={num_layers}, Hk={hk}, Hv={hv}, Dk={dk}, Dv={dv}, K={conv_kernel_size}")
        if hv % hk:
            raise HebrusError(f"GDNState: num_value_heads ({hv}) must be a multiple of num_key_heads ({hk})")
        if dtype not in FLOAT_DTYPES:
            raise HebrusError(f"GDNState: dtype must be float32, float16 or bfloat16, got {dtype}")
        if activation not in _ACTIVATIONS:
            raise HebrusError(f"GDNState: activation must be 'silu' or 'none', got {activation!r}")
        self.num_layers = num_layers
        self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim = hk, hv, dk, dv
        self.conv_kernel_size = conv_kernel_size
        self.conv_dim = 2 * hk * dk + hv * dv
        self.state_len = conv_kernel_size - 1
        self.activation = _ACTIVATIONS[activation]
        self.slots = SlotTable(max_sequences, "GDNState")
        self._layer_views = LayerViews()        # StepPools' per-layer views of the pools
        self.register_buffer("conv_state", torch.zeros((num_layers, max_sequences, self.state_len, self.conv_dim),
                                                       dtype=dtype, device=device))
        self.register_buffer("recurrent_state", torch.zeros((num_layers, max_sequences, hv, dk, dv),
                                                            dtype=torch.float32, device=device))
        self._register_slot_buffers(device)
        if conv_weights is not None and len(conv_weights) != num_layers:
            raise HebrusError(f"GDNState: conv_weights has {len(conv_weights)} entries for {num_layers} layers")
        self._conv_weights = list(conv_weights) if conv_weights is not None else None
        self.layer_ids: list[int] | None = None
        # Undo log of the open transaction: what each in-place change overwrote, in order (an entry is
        # logged before its write, so an exception between the two still finds it).
        self._undo: list[SlotUndo | RowsUndo] = []
        self.replay_log: ReplayLog | None = None
        """While set, the state ops record their inputs there (speculative decoding: ``state/replay.py``)."""
        self._base = None
        self._index_cache: tuple[tuple[tuple[int, ...], torch.device], torch.Tensor] | None = None
        # The step undo entries' row buffers: those of the open transaction, and spares from finished ones
        # by (shape, dtype, device), reused by the next (a decode step's undo of 64 rows is 32 MiB per
        # layer at Hv = 8, Dk = Dv = 128: a fresh allocation of that size costs more in page faults than
        # the copy itself).
        self._undo_used: list[torch.Tensor] = []
        self._undo_spare: dict[tuple, list[torch.Tensor]] = {}

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_transformers(cls, model: torch.nn.Module, *, max_sequences: int = 64) -> "GDNState":
        """Build from a transformers Qwen4Exp model (``Qwen4ExpForCausalLM``, its text model, or the
        multimodal ``Qwen4ExpForConditionalGeneration`` / ``Qwen4ExpModel``, whose language model is used).

        Conv weights are referenced (they follow the model's parameters). ``layer_ids`` maps GDN index ->
        decoder layer index; :meth:`layer_index` maps back.
        """
        text = model
        for _ in range(2):   # ForCausalLM -> model; ForConditionalGeneration -> model -> language_model
            if not hasattr(text, "layers"):
                inner = getattr(text, "language_model", None)
                inner = getattr(text, "model", None) if inner is None else inner
                text = text if inner is None else inner
        if not hasattr(text, "layers"):
            raise HebrusError(f"GDNState.from_transformers: {type(model).__name__} has no decoder layers")
        config = text.config
        types = list(getattr(config, "layer_types", None) or [])
        ids = [i for i, t in enumerate(types) if t == "linear_attention"]
        if not ids:
            raise HebrusError("GDNState.from_transformers: the model has no linear_attention layers "
                              f"(layer_types = {types})")
        attn = [text.layers[i].linear_attn for i in ids]
        w = attn[0].conv1d.weight
        state = cls(len(ids), num_key_heads=config.linear_num_key_heads, num_value_heads=config.linear_num_value_heads,
                    key_head_dim=config.linear_key_head_dim, value_head_dim=config.linear_value_head_dim,
                    conv_kernel_size=config.linear_conv_kernel_dim, max_sequences=max_sequences, dtype=w.dtype,
                    device=w.device, conv_weights=[a.conv1d.weight for a in attn],
                    activation=getattr(attn[0], "activation", config.hidden_act))
        state.layer_ids = ids
        return state

    def layer_index(self, model_layer: int) -> int:
        """The GDN layer index of decoder layer ``model_layer`` (HebrusError for a layer without a GDN).

        Without ``layer_ids`` (a holder not built by :meth:`from_transformers`) indices are GDN indices."""
        model_layer = as_int("GDNState.layer_index: model_layer", model_layer)
        if self.layer_ids is None:
            self._check_layer(model_layer)
            return model_layer
        if model_layer not in self.layer_ids:
            raise HebrusError(f"GDNState: decoder layer {model_layer} is not a linear_attention (GDN) layer "
                              f"(GDN layers: {self.layer_ids})")
        return self.layer_ids.index(model_layer)

    # ----------------------------------------------------------------------------- lifecycle
    # new_sequence, free, reset, clear, copy, fork, keep: SlotLifecycle, over the slot primitives below.
    # snapshot, restore (a GDNSnapshot or the bytes of save), save: SlotPoolHolder, over conv_tails, recurrent.
    def restore(self, seq: SeqHandle, state: GDNSnapshot | bytes) -> None:
        """Overwrite a live sequence's state with a snapshot or the bytes of :meth:`save` (SlotPoolHolder's),
        refusing anything else with HebrusError.

        Everything is validated first; a bad snapshot (HebrusError) or blob (CorruptStateError) changes nothing.
        """
        if not isinstance(state, (GDNSnapshot, bytes, bytearray, memoryview)):
            self.slots.check(seq)
            raise HebrusError(f"GDNState.restore: expected a GDNSnapshot or the bytes of save, got "
                              f"{type(state).__name__}")
        super().restore(seq, state)

    # ----------------------------------------------------------------------------- step execution
    def conv(self, layer: int, seqs: Sequence[SeqHandle], x: torch.Tensor, cu_seqlens: torch.Tensor,
             weight: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
        """The GDN's causal depthwise conv (dilation 1) of a packed step: ``[T, conv_dim]`` -> ``[T, conv_dim]``,
        through ``hebrus::ple_conv_slots`` on the tail pool in place (``hebrus::ple_conv`` and a write-back
        when x is narrower than the tails or the output must carry autograd history).

        Args:
            layer: GDN layer index (see :meth:`layer_index`).
            seqs: one handle per packed row; x: Tensor[T, conv_dim]; cu_seqlens: Tensor[B+1] int32.
            weight: ``[conv_dim, K]`` (or transformers' ``[conv_dim, 1, K]``); defaults to the registered one.
            activation: ``"silu"`` or ``"none"``; defaults to the holder's.
        """
        self._check_layer(layer)
        x = as_tensor("GDNState.conv: x", x)
        act = self.activation if activation is None else activation
        if act not in _ACTIVATIONS:
            raise HebrusError(f"GDNState.conv: activation must be 'silu' or 'none', got {act!r}")
        act = _ACTIVATIONS[act]
        if x.dim() != 2 or x.shape[1] != self.conv_dim:
            raise HebrusError(f"GDNState.conv: x must be [T, conv_dim] = [T, {self.conv_dim}], got {list(x.shape)}")
        state_dtype = self.conv_state.dtype
        if x.dtype != state_dtype and torch.promote_types(x.dtype, state_dtype) != state_dtype:
            # The tail is stored in the state's dtype: one narrower than x would round it at every step
            # boundary, so outputs would depend on how the stream was cut (SPEC §5.1).
            raise HebrusError(f"GDNState.conv: x is {x.dtype} but the conv state is {self.conv_state.dtype}, which "
                              f"cannot hold x's values exactly; pass x in the state's dtype (or cast the holder)")
        if x.device != self.conv_state.device:
            raise HebrusError(f"GDNState.conv: x is on {x.device}, the state on {self.conv_state.device}")
        slots = self._slots_of(seqs, cu_seqlens, x.shape[0], "conv")
        weight = conv_weight("GDNState.conv", layer, weight, self._conv_weights, ("conv_dim", self.conv_dim),
                             self.conv_kernel_size, x.dtype, x.device)
        pool = self.conv_state[layer]
        index = self._slot_index(slots, pool.device)
        in_place = x.dtype == pool.dtype and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        with atomic(self):
            old = self._log_rows("conv_state", layer, pool, index)   # before the write: see _log_rows
            if self.replay_log is not None:
                self.replay_log.record(self, "conv", layer, seqs, cu_seqlens, {"x": x}, ("conv_state", old),
                                       weight=weight, activation=activation)
            if in_place:
                # hebrus::ple_conv_slots reads and rewrites the tails in the pool (and refuses before writing).
                return ple_ops.ple_conv_slots(x, weight, cu_seqlens, pool, index, 1, act)
            # x narrower than the tails, or an output that must carry autograd history: gather, op, write back.
            y, new_state = ple_ops.ple_conv(x, weight, cu_seqlens, pool.index_select(0, index).to(x.dtype), 1, act)
            with torch.no_grad():
                pool.index_copy_(0, index.long(), new_state.detach().to(pool.dtype))
        return y

    def delta_rule(self, layer: int, seqs: Sequence[SeqHandle], cu_seqlens: torch.Tensor, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                   start_pos: Sequence[int | None] | None = None) -> torch.Tensor:
        """The gated delta rule (qk l2-norm, q scaled by Dk**-0.5) of a packed step from each sequence's
        recurrent state, updated in place in ``recurrent_state[layer]`` by ``hebrus::gdn_delta_rule_slots``
        (its bits are ``gdn_delta_rule``'s on the gathered states). Bitwise chunk-invariant (see
        ``gated_delta_rule``).

        Args:
            layer: GDN layer index; seqs: one handle per packed row; cu_seqlens: Tensor[B+1] int32.
            q, k: Tensor[T, Hk, Dk]; v: Tensor[T, Hv, Dv]; g (log decay), beta: Tensor[T, Hv].
            start_pos: per row, the absolute position of its first token for the rows that run the chunked
                form (``hebrus::gdn_chunk_delta_rule_slots``: the whole chunks of 64 aligned positions a row
                covers in the WY form, its partial chunks with ``gdn_delta_rule``'s bits), None for the rows
                that run the recurrent form; None: every row recurrent. Bitwise chunk-invariant for callers
                that cut a row's stream only at multiples of 64 below where it runs chunked (the engine's
                scheduler; docs/semantics.md for other cuts).

        Returns:
            Tensor[T, Hv, Dv] in v's dtype.
        """
        self._check_layer(layer)
        if start_pos is not None and len(start_pos) != len(seqs):
            raise HebrusError(f"GDNState.delta_rule: start_pos must have one entry per row ({len(seqs)}), "
                              f"got {len(start_pos)}")
        tensors = {"q": as_tensor("GDNState.delta_rule: q", q), "k": as_tensor("GDNState.delta_rule: k", k),
                   "v": as_tensor("GDNState.delta_rule: v", v), "g": as_tensor("GDNState.delta_rule: g", g),
                   "beta": as_tensor("GDNState.delta_rule: beta", beta)}
        hk, hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        T = q.shape[0] if q.dim() else -1
        wants = {"q": (T, hk, dk), "k": (T, hk, dk), "v": (T, hv, dv), "g": (T, hv), "beta": (T, hv)}
        for name, t in tensors.items():
            if tuple(t.shape) != wants[name]:
                raise HebrusError(f"GDNState.delta_rule: {name} must be {list(wants[name])} (T, heads, head dim of "
                                  f"this holder), got {list(t.shape)}")
            if t.device != self.recurrent_state.device:
                raise HebrusError(f"GDNState.delta_rule: {name} is on {t.device}, the state on "
                                  f"{self.recurrent_state.device}")
        slots = self._slots_of(seqs, cu_seqlens, T, "delta_rule")
        pool = self.recurrent_state[layer]
        index = self._slot_index(slots, pool.device)
        if self.replay_log is not None:
            if start_pos is not None and any(p is not None and s in self.replay_log.seqs
                                             for p, s in zip(start_pos, seqs)):
                raise HebrusError("GDNState.delta_rule: a row that may be cut short (speculative decoding) must run "
                                  "the recurrent form (its replay does)")
        with atomic(self):
            old = self._log_rows("recurrent_state", layer, pool, index)   # before the write: see _log_rows
            if self.replay_log is not None:
                self.replay_log.record(self, "delta_rule", layer, seqs, cu_seqlens,
                                       {"q": q, "k": k, "v": v, "g": g, "beta": beta}, ("recurrent_state", old))
            if start_pos is None or all(p is None for p in start_pos):
                return gated_delta_rule_slots(q, k, v, g, beta, cu_seqlens, pool, index)
            return _mixed_delta_rule(q, k, v, g, beta, cu_seqlens, pool, slots, list(start_pos))

    def step_pools(self, seqs: Sequence[SeqHandle], cu_seqlens: torch.Tensor, tokens: int,
                   dtype: torch.dtype) -> "StepPools | None":
        """The state of a packed step whose layers update their conv tails and recurrent states in place by one native
        call each (``hebrus::decode_gdn_layer``: the conv and the delta rule of :meth:`conv` and :meth:`delta_rule`,
        recurrent form, the tails in ``dtype``), inside a transaction (what a model's step runs:
        ``ChunkStep.gdn_layer_call``): the slots checked, both pools' rows at them logged for undo for all layers at
        once (one gather per pool, before any layer writes), the index made. None where a replay log records the
        step (speculation), outside a transaction, or where the tails are not stored in ``dtype`` (:meth:`conv`
        would not update them in place): the layers then run :meth:`conv` and :meth:`delta_rule`. A layer's call
        that raises leaves its rows to the transaction's rollback (the step's)."""
        if self.replay_log is not None or self._txn_depth_owner is None:
            return None
        buffers = self._buffers
        conv, recurrent = buffers["conv_state"], buffers["recurrent_state"]
        if conv.dtype != dtype:
            return None
        slots = self._slots_of(seqs, cu_seqlens, tokens, "step_pools")
        index = self._slot_index(slots, conv.device)
        self._undo.append(RowsUndo("conv_state", None, index, conv.index_select(1, index)))
        self._undo.append(RowsUndo("recurrent_state", None, index, recurrent.index_select(1, index)))
        return StepPools(self, (conv, recurrent), index, cu_seqlens)

    # ----------------------------------------------------------------------------- transactions
    # The undo log's hooks (_txn_begin ... _txn_restore, _apply_undo, _log_slot): SlotPoolHolder.
    def _reset_staging(self) -> None:
        super()._reset_staging()
        used, self._undo_used = self._undo_used, []
        log = self.replay_log
        for buf in used:              # no entry refers to them any more (but a replay log's record may)
            if log is None or not log.holds(buf):
                self.recycle_undo_rows(buf)

    def recycle_undo_rows(self, buf: torch.Tensor) -> None:
        """Take back an undo buffer nobody refers to any more (a ReplayLog's, once released). One still in the
        open transaction's log is left to its end, and one already spare is not listed twice (two undo
        entries would then share it)."""
        spare = self._undo_spare.setdefault((tuple(buf.shape), buf.dtype, buf.device), [])
        if not any(b is buf for b in self._undo_used) and not any(b is buf for b in spare):
            spare.append(buf)

    def _log_rows(self, name: str, layer: int, pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Log the pool rows a step's in-place op is about to overwrite. Called inside ``atomic(self)``
        BEFORE the op: should anything raise after the op has written (between the write and the end of
        the call), the rollback finds the entry and restores the rows; a refused op wrote nothing, so
        restoring its rows changes nothing either. (Logging after the op, as PLEState does, issue 27,
        would leave such a write in place.)"""
        key = ((index.shape[0], *pool.shape[1:]), pool.dtype, pool.device)
        spare = self._undo_spare.get(key)
        rows = spare.pop() if spare else torch.empty(key[0], dtype=pool.dtype, device=pool.device)
        self._undo_used.append(rows)
        torch.index_select(pool, 0, index, out=rows)
        self._undo.append(RowsUndo(name, layer, index, rows))
        return rows

    # ----------------------------------------------------------------------------- device / dtype moves
    # _check_apply: SlotPoolHolder.
    def _apply(self, fn, recurse: bool = True):
        # The recurrent state stays float32 (what the delta rule accumulates in): it only follows moves.
        self._check_apply(fn)
        self._undo_spare = {}
        rec = self._buffers.pop("recurrent_state")
        try:
            device = fn(torch.empty(0, device=rec.device)).device
            moved = rec if rec.device == device else rec.to(device)
            result = super()._apply(fn, recurse)
        except BaseException:
            self._buffers["recurrent_state"] = rec
            raise
        self._buffers["recurrent_state"] = moved
        return result

    # ----------------------------------------------------------------------------- whole-holder state
    # digest, state_dict / load_state_dict / check_state_dict / publish_state_dict and their checks:
    # SlotPoolHolder (over StateDictProtocol).

    # ----------------------------------------------------------------------------- internals
    def _config_meta(self) -> dict[str, Any]:
        return {"layers": self.num_layers, "key_heads": self.num_key_heads, "value_heads": self.num_value_heads,
                "key_head_dim": self.key_head_dim, "value_head_dim": self.value_head_dim,
                "kernel": self.conv_kernel_size, "conv_dim": self.conv_dim, "dtype": str(self.conv_state.dtype),
                "max_sequences": self.slots.capacity}

    def _check_layer(self, layer: int) -> None:
        layer = as_int("GDNState: layer", layer)
        if not 0 <= layer < self.num_layers:
            raise HebrusError(f"GDNState: layer {layer} outside [0, {self.num_layers})")

    def _slots_of(self, seqs: Sequence[SeqHandle], cu_seqlens: torch.Tensor, tokens: int, op: str) -> list[int]:
        slots = [self.slots.check(s) for s in seqs]
        if len(set(slots)) != len(slots):
            raise HebrusError(f"GDNState.{op}: a sequence appears twice in one packed step: {list(seqs)}")
        if not isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = as_tensor(f"GDNState.{op}: cu_seqlens", cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.shape[0] != len(slots) + 1:
            raise HebrusError(f"GDNState.{op}: cu_seqlens must be int32 with {len(slots) + 1} entries for "
                              f"{len(slots)} sequences, got shape {list(cu_seqlens.shape)} {cu_seqlens.dtype}")
        cu = host_ints(cu_seqlens)   # Batch.pack's host copy: no read back
        if cu[0] != 0 or cu[-1] != tokens or any(a > b for a, b in zip(cu[:-1], cu[1:])):
            raise HebrusError(f"GDNState.{op}: cu_seqlens must rise from 0 to T = {tokens} without decreasing, "
                              f"got {cu}")
        return slots


@dataclass(eq=False)
class StepPools:
    """:meth:`GDNState.step_pools`: the step's index and logged pools; :meth:`layer_args`: one layer's in-place call's
    state arguments."""

    state: GDNState
    pools: tuple[torch.Tensor, torch.Tensor]
    index: torch.Tensor
    cu_seqlens: torch.Tensor

    def layer_args(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv_pool, recurrent_pool, slots, cu_seqlens): what an update of GDN layer ``layer`` takes."""
        state = self.state
        state._check_layer(layer)
        conv_pool, recurrent_pool = state._layer_views.views(self.pools, layer)
        return conv_pool, recurrent_pool, self.index, self.cu_seqlens


def _mixed_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: torch.Tensor, pool: torch.Tensor, slots: list[int],
                      start_pos: list[int | None]) -> torch.Tensor:
    """The rows with a start position through the chunked op, the others through the recurrent one, each
    group's rows packed on their own; both update ``pool`` [S, Hv, Dk, Dv] in place at the rows' slots."""
    dev = pool.device
    if all(p is not None for p in start_pos):
        return chunk_gated_delta_rule_slots(q, k, v, g, beta, cu_seqlens, torch.tensor(start_pos, dtype=torch.int64,
                                                                                        device=dev),
                                            pool, torch.tensor(slots, dtype=torch.int32, device=dev))
    cu = cu_seqlens.tolist()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for chunked in (True, False):
        rows = [b for b, p in enumerate(start_pos) if (p is not None) == chunked]
        sub_cu = [0]
        for b in rows:
            sub_cu.append(sub_cu[-1] + cu[b + 1] - cu[b])
        ix = torch.cat([torch.arange(cu[b], cu[b + 1], device=q.device) for b in rows])
        part = (q[ix], k[ix], v[ix], g[ix], beta[ix], torch.tensor(sub_cu, dtype=torch.int32, device=dev))
        sub_slots = torch.tensor([slots[b] for b in rows], dtype=torch.int32, device=dev)
        if chunked:
            starts = torch.tensor([start_pos[b] for b in rows], dtype=torch.int64, device=dev)
            out[ix] = chunk_gated_delta_rule_slots(*part[:5], part[5], starts, pool, sub_slots)
        else:
            out[ix] = gated_delta_rule_slots(*part, pool, sub_slots)
    return out

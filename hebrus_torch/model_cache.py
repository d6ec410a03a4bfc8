"""ModelCache: the one object a runtime holds per model, over a QSACache and a PLEState (SPEC §4)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from .errors import DuplicateSequenceError, HebrusError
from .gdn.state import GDNSnapshot, GDNState
from .ple.state import PLESnapshot, PLEState
from .qsa.attention import qsa_attention
from .qsa.cache import MAX_POSITION, QSACache, QSAPlan
from .state import blob
from .state.args import as_int, as_tensor
from .state.handles import SeqHandle, SlotTable, generation_problem
from .state.host_mirror import host_ints, mirror
from .state.plain_attrs import PlainAttrs
from .state.replay import ReplayLog
from .state.protocol import StateDictProtocol
from .state.transaction import Transactional, atomic, transaction

if TYPE_CHECKING:
    from .models.qwen4_exp.native import AttentionLayerCall, BoundLayer, GdnLayerCall

_KIND = "hebrus_torch.ModelCache"


@dataclass(frozen=True)
class CacheSnapshot:
    """The recurrent state of one sequence at one position: a snapshot of each recurrent holder (PLE,
    GDN), none of which can be recomputed backwards. What ``ModelCache.checkpoint`` keeps and
    ``rewind`` restores.

    Attributes:
        handle: the sequence it was taken of.
        position: the position the sequence was at (its next token's), or None for a fresh state.
        parts: holder name ("ple", "gdn") -> that holder's snapshot.
    """

    handle: SeqHandle
    position: int | None
    parts: dict[str, Any]

    @property
    def ple(self) -> PLESnapshot | None:
        return self.parts.get("ple")

    @property
    def gdn(self) -> GDNSnapshot | None:
        return self.parts.get("gdn")

    def relabelled(self, handle: SeqHandle | None = None, position: int | None = None) -> "CacheSnapshot":
        handle = self.handle if handle is None else handle
        position = self.position if position is None else position
        return CacheSnapshot(handle, position, {k: dataclasses.replace(v, handle=handle, position=position)
                                                for k, v in self.parts.items()})


@dataclass
class StepRecording:
    """What :meth:`ModelCache.recording` kept of one step (see :meth:`ModelCache.truncate`)."""

    starts: dict[SeqHandle, int | None]     # each sequence's first position in the step (None: no QSA cache)
    fed: dict[SeqHandle, int]               # tokens the step feeds it
    log: ReplayLog

    def release(self) -> None:
        """Done with the recording (after :meth:`ModelCache.truncate`, or when nothing is cut): the holders take
        back the undo buffers it kept (else they are freed with it and allocated again)."""
        self.log.release()


def _refuse_duplicates(seqs: Sequence[SeqHandle], who: str) -> None:
    rows: dict[SeqHandle, int] = {}
    for i, seq in enumerate(seqs):
        if seq in rows:
            raise DuplicateSequenceError(f"{who}: a sequence appears twice in one batch: {seq} (rows {rows[seq]} "
                                         f"and {i})")
        rows[seq] = i


def _token_row(seq: SeqHandle, value: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """One row's tokens as Tensor[n] int64 (host, unless given on a device); a list of Python ints through numpy (a
    third of ``torch.tensor``'s time on a list, every step)."""
    try:
        if type(value) is list and all(type(v) is int for v in value):
            return torch.from_numpy(np.array(value, dtype=np.int64))
        row = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise HebrusError(f"Batch.pack: the tokens of {seq} must be integers, got {value!r}") from None
    if row.numel() and (row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool):
        raise HebrusError(f"Batch.pack: the tokens of {seq} must be integers, got {row.dtype}")
    return row.to(torch.int64).reshape(-1)


@dataclass
class Batch:
    """A packed chunk of several sequences: rows in ``seqs`` order.

    Attributes:
        seqs: one handle per row.
        tokens: Tensor[T] int64, the rows' tokens back to back.
        cu_seqlens: Tensor[B+1] int32, row boundaries.
        first_positions: per row, the position of its first token when the sequence is still empty
            (left padding / an offset start); None means "0 if empty, else frontier + 1".
    """

    seqs: list[SeqHandle]
    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    first_positions: list[int | None] = field(default_factory=list)

    @classmethod
    def pack(cls, rows: Mapping[SeqHandle, torch.Tensor | Sequence[int]], *,
             first_positions: Mapping[SeqHandle, int] | None = None,
             device: torch.device | str | None = None) -> "Batch":
        """Pack ``{handle: tokens}`` into one batch (insertion order = row order). A mapping holds one row per
        sequence: pack parallel lists with :meth:`from_rows`, which refuses a sequence listed twice."""
        seqs = list(rows)
        token_rows = [_token_row(s, rows[s]) for s in seqs]
        if device is None:
            device = token_rows[0].device if token_rows else "cpu"
        bounds = [0]
        for t in token_rows:
            bounds.append(bounds[-1] + t.numel())
        cu = torch.from_numpy(np.array(bounds, dtype=np.int32))
        cu = mirror(cu if torch.device(device).type == "cpu" else cu.to(device), bounds)   # (bounds known: no read back)
        if len(seqs) == 1 and not isinstance(rows[seqs[0]], torch.Tensor):
            tokens = token_rows[0].to(device)   # (made here from the caller's list: the batch's own, as a cat's is)
        elif token_rows:
            tokens = torch.cat(token_rows).to(device)
        else:
            tokens = torch.empty(0, dtype=torch.int64, device=device)
        firsts = [(first_positions or {}).get(s) for s in seqs]
        return cls(seqs, tokens, cu, firsts)

    @classmethod
    def from_rows(cls, seqs: Sequence[SeqHandle], rows: Sequence[torch.Tensor | Sequence[int]],
                  first_positions: Sequence[int] | None = None, *,
                  device: torch.device | str | None = None) -> "Batch":
        """:meth:`pack` of parallel lists: row i feeds ``rows[i]`` to ``seqs[i]`` (first position
        ``first_positions[i]``). A sequence listed twice is a :class:`DuplicateSequenceError` (a mapping would
        keep one of its rows and drop the other)."""
        _refuse_duplicates(seqs, "Batch.from_rows")
        if len(rows) != len(seqs) or (first_positions is not None and len(first_positions) != len(seqs)):
            raise HebrusError(f"Batch.from_rows: {len(seqs)} sequences, {len(rows)} rows and "
                              f"{'no' if first_positions is None else len(first_positions)} first positions")
        return cls.pack(dict(zip(seqs, rows)), device=device,
                        first_positions=None if first_positions is None else dict(zip(seqs, first_positions)))

    @property
    def counts(self) -> list[int]:
        cu = host_ints(self.cu_seqlens)
        return [b - a for a, b in zip(cu[:-1], cu[1:])]


_UNPLANNED = object()


class ChunkStep:
    """The state operations of one step, what a model's layers call inside ``ModelCache.transaction(batch)``:
    PLE (:meth:`ple_ngram_ids`, :meth:`ple_conv`), GDN (:meth:`gdn_conv`, :meth:`gdn_delta_rule`) and QSA
    (:meth:`qsa_write`, :meth:`qsa_select`, :meth:`qsa_attention`). The model math around them is the
    model's (Qwen4Exp's: :mod:`hebrus_torch.models.qwen4_exp`).

    Layer indices are the model's decoder-layer indices; the step maps them to PLE, GDN and QSA layers.
    Every call stages its state change; nothing is visible until the transaction commits.
    """

    _qsa_step_plan = _gdn_pools = _UNPLANNED
    _unsettled: tuple[int, ...] = ()
    """QSA cache layers whose bookkeeping waits for :meth:`settle_qsa_layers`: those :meth:`qsa_layer` ran, and those
    :meth:`qsa_layer_call` bound."""
    _bound_unrun: tuple[int, ...] = ()
    """QSA cache layers :meth:`qsa_layer_call` bound whose call has not returned yet (:meth:`finish_qsa_layers`
    refuses to end a step with one)."""

    def __init__(self, cache: "ModelCache", batch: Batch):
        self.cache, self.batch = cache, batch
        self.gdn_start_positions: list[int | None] | None = None
        """Per row, the absolute position of its first token where its GDN layers may run the chunked
        form (``hebrus::gdn_chunk_delta_rule_slots``), None where a row runs the recurrent form; None:
        every row recurrent. Set by the engine's runner (chunks cut at aligned positions)."""
        self.chunk = cache._reserve_step(batch)

    @classmethod
    def held(cls, cache: "ModelCache", seqs: Sequence[SeqHandle], positions: Sequence[Sequence[int]]) -> "ChunkStep":
        """A step over positions the sequences already hold (row i: ``positions[i]`` of ``seqs[i]``), inside an open
        transaction, for :meth:`qsa_write` only: it (re)writes one indexed layer's entries there
        (``QSACache.held_chunk``: the old content undo-logged, the groups that contain them re-pooled). Nothing
        is reserved and no batch is fed (``batch`` is None): what a layer whose writes were deferred, or a subset
        of a step's rows, is written with (the MTP block's, ``engine/mtp.py``)."""
        step = cls.__new__(cls)
        step.cache, step.batch, step.gdn_start_positions = cache, None, None
        step.chunk = cache._need("qsa").held_chunk(seqs, positions)
        return step

    @property
    def positions(self) -> torch.Tensor | None:
        """Tensor[T] int64: the logical position of every packed token (None without a QSA cache)."""
        return None if self.chunk is None else self.chunk.positions

    def ple_ngram_ids(self, layer_idx: int) -> torch.Tensor:
        """``hebrus::ple_ngram_ids`` for the batch's tokens: Tensor[T, (N-1)*H] int64."""
        ple = self.cache._need("ple")
        return ple.ngram_ids(self.cache._ple_layer(layer_idx), self.batch.seqs, self.batch.tokens,
                             self.batch.cu_seqlens)

    def ple_conv(self, layer_idx: int, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``hebrus::ple_conv`` of the conv input x: Tensor[T, C] (in the PLE state's dtype) -> Tensor[T, C];
        tails staged."""
        ple = self.cache._need("ple")
        return ple.conv(self.cache._ple_layer(layer_idx), self.batch.seqs, as_tensor("ChunkStep.ple_conv: x", x),
                        self.batch.cu_seqlens, weight)

    def ple_conv_call(self, layer_idx: int, dtype: torch.dtype,
                      weight: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """:meth:`ple_conv` for conv inputs in ``dtype``, made ahead (``PLEState.conv_call``: the checks run and the
        undo logged now); the returned ``conv(x)`` is the in-place op alone. None where :meth:`ple_conv` must run."""
        ple = self.cache._need("ple")
        return ple.conv_call(self.cache._ple_layer(layer_idx), self.batch.seqs, self.batch.cu_seqlens, dtype, weight)

    def gdn_conv(self, layer_idx: int, x: torch.Tensor, weight: torch.Tensor | None = None,
                 activation: str | None = None) -> torch.Tensor:
        """``GDNState.conv`` of a gated-delta-net layer's conv input x: Tensor[T, conv_dim] -> Tensor[T, conv_dim];
        conv tails read by slot and staged."""
        gdn = self.cache._need("gdn")
        return gdn.conv(self.cache._gdn_layer(layer_idx), self.batch.seqs, as_tensor("ChunkStep.gdn_conv: x", x),
                        self.batch.cu_seqlens, weight, activation=activation)

    def gdn_delta_rule(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> torch.Tensor:
        """``GDNState.delta_rule`` of a gated-delta-net layer: q, k Tensor[T, Hk, Dk], v Tensor[T, Hv, Dv], g, beta
        Tensor[T, Hv] -> Tensor[T, Hv, Dv]; recurrent states read by slot and staged. Rows run the chunked form
        where :attr:`gdn_start_positions` says so."""
        gdn = self.cache._need("gdn")
        return gdn.delta_rule(self.cache._gdn_layer(layer_idx), self.batch.seqs, self.batch.cu_seqlens, q, k, v, g,
                              beta, start_pos=self.gdn_start_positions)

    def gdn_layer_call(self, layer_idx: int, x: torch.Tensor, call: "GdnLayerCall") -> "BoundLayer | None":
        """A gated-delta-net layer's native call (``call``: a ``GdnLayerCall``) bound to this step's state: its conv
        tails and recurrent states, updated in place by the call at the step's slots, their rows logged for undo
        before any layer writes (:meth:`gdn_step_pools`). The returned ``bound(h)`` runs the call alone. None where
        the state cannot be updated in place (speculation's replay log, rows that run the chunked form, tails not in
        x's dtype): the layer then runs :meth:`gdn_conv` and :meth:`gdn_delta_rule`. x: the layer's input (its rows
        and dtype)."""
        if self.gdn_chunked:
            return None
        pools = self.gdn_step_pools(x)
        if pools is None or pools.pools[0].dtype != x.dtype:
            return None
        return call.bound(*pools.layer_args(self.cache._gdn_layer(layer_idx)))

    @property
    def gdn_chunked(self) -> bool:
        """Whether some row runs its GDN layers in the chunked form (:attr:`gdn_start_positions`)."""
        return self.gdn_start_positions is not None and any(p is not None for p in self.gdn_start_positions)

    def gdn_step_pools(self, x: torch.Tensor):
        """``GDNState.step_pools`` of this step for layer inputs like x (Tensor[T, ...]: its rows and dtype): the
        slots checked and every GDN layer's rows logged once, at the first call (the others reuse it); None where
        the layers cannot update the state in place (:meth:`gdn_layer_call`). A forward whose GDN layers run as native
        calls asks for it before its first layer (host work outside the gaps between the layers' calls, see
        :meth:`qsa_step_plan`); nothing writes the GDN state before a GDN layer does."""
        pools = self._gdn_pools
        if pools is _UNPLANNED:
            pools = self._gdn_pools = self.cache._need("gdn").step_pools(self.batch.seqs, self.batch.cu_seqlens,
                                                                        x.shape[0], x.dtype)
        return pools

    def linear_attention(self, layer_idx: int, module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Deprecated: the layer's math is ``hebrus_torch.models.qwen4_exp.gdn.packed_gated_delta_net(step,
        layer_idx, module, hidden)`` (its state goes through :meth:`gdn_conv` and :meth:`gdn_delta_rule`).

        A gated-delta-net layer (transformers' ``Qwen4ExpTextGatedDeltaNet``, its own submodules) on the
        batch: hidden Tensor[T, hidden_size] -> Tensor[T, hidden_size]."""
        warnings.warn("ChunkStep.linear_attention is deprecated: call hebrus_torch.models.qwen4_exp.gdn."
                      "packed_gated_delta_net(step, layer_idx, module, hidden)", DeprecationWarning, stacklevel=2)
        from .models.qwen4_exp.gdn import module_mismatch, packed_gated_delta_net

        hidden = as_tensor("ChunkStep.linear_attention: hidden", hidden)
        why = module_mismatch(module, self.cache._need("gdn"))
        if why is not None:
            raise HebrusError(f"gdn_forward: {why}")
        return packed_gated_delta_net(self, layer_idx, module, hidden)

    def qsa_write(self, layer_idx: int, index_keys: torch.Tensor, k: torch.Tensor | None = None,
                  v: torch.Tensor | None = None) -> None:
        """Write the chunk's raw indexer keys Tensor[T, D] (and K/V) for one layer; pools completed groups."""
        qsa = self.cache._need("qsa")
        self.settle_qsa_layers()
        index_keys = as_tensor("ChunkStep.qsa_write: index_keys", index_keys)
        qsa.write(self.cache._qsa_layer(layer_idx), self.chunk, index_keys, k, v)

    def qsa_select(self, layer_idx: int, q_index: torch.Tensor, top_k: int | None = None):
        """Selection plan (``QSAPlan``) for one query per packed token: q_index Tensor[T, Hq, D]."""
        qsa = self.cache._need("qsa")
        top_k = top_k if top_k is not None else self.cache.top_k
        if top_k is None:
            raise HebrusError("ChunkStep.qsa_select: pass top_k, or build the ModelCache with top_k= "
                              "(indexer_budget // indexer_compress_ratio)")
        q_index = as_tensor("ChunkStep.qsa_select: q_index", q_index)
        top_k = as_int("ChunkStep.qsa_select: top_k", top_k)
        self.settle_qsa_layers()
        return qsa.plan(self.cache._qsa_layer(layer_idx), self.chunk, q_index, top_k)

    def qsa_step_plan(self):
        """The QSA cache's :class:`~hebrus_torch.qsa.planning.StepPlan` of this step's chunk (``QSACache.step_plan``,
        with the cache's top_k), decided at the first call and kept for the step's other layers; None where the
        cache cannot plan the step once for every layer.

        A forward that will run indexed layers over it asks for it before its first layer: the plan is then made
        before the layers' weights stream through the caches (the host work between two layers' calls runs with
        cold caches, several times slower). Each layer's part of it stays valid whatever another layer writes
        (a layer writes and pools only its own planes)."""
        plan = self._qsa_step_plan
        if plan is _UNPLANNED:
            qsa, top_k = self.cache.qsa, self.cache.top_k
            plan = None if qsa is None or top_k is None or self.chunk is None else qsa.step_plan(self.chunk, top_k)
            self._qsa_step_plan = plan
        return plan

    def qsa_layer(self, layer_idx: int, run) -> torch.Tensor:
        """One indexed layer over the step plan (:meth:`qsa_step_plan`, not None): ``run(planes, qsa, plan, sizes,
        qsa_eps)`` (``hebrus::decode_attention_layer``'s QSA arguments) writes, pools and attends the layer's part of
        the cache. Returns what ``run`` returns.

        The cache's bookkeeping of the write (``QSACache.settle_step_plan``) waits for :meth:`settle_qsa_layers`:
        done for every such layer at once after the step's layers (one pass instead of one cold pass between two
        layers' calls), before any other QSA operation of the step and at the latest when the transaction's block
        ends (``ModelCache.transaction``). No other layer's work reads it: each layer's part of the plan is its own
        (its flags, its pending groups). (Layers bound ahead, :meth:`qsa_layer_call`, are settled before they run.)"""
        layer = self.cache._qsa_layer(layer_idx)
        out = run(*self._qsa_step_plan.layer_args(layer))
        self._ran_qsa_layer(layer)
        return out

    def qsa_layer_call(self, layer_idx: int, call: "AttentionLayerCall", cos: torch.Tensor,
                       sin: torch.Tensor) -> "BoundLayer":
        """:meth:`qsa_layer` of ``call.whole`` made ahead (the step plan, not None, bound with the step's rotary rows
        cos, sin Tensor[T, R]): the returned ``bound(h)`` runs the call alone.

        Binding commits the step to running the call: the layer's bookkeeping is listed at once, so that the forward
        settles every bound layer before the first layer runs (:meth:`settle_qsa_layers`, with the caches the host
        work left warm: after the layers, their weights have streamed through them). Nothing the layers run reads
        it (each layer's part of the plan is its own; the call reads the planes and the plan, not the flags). A
        step whose bound call never returned cannot end: :meth:`finish_qsa_layers` raises, and the transaction
        rolls back."""
        layer = self.cache._qsa_layer(layer_idx)
        self._unsettled += (layer,)
        self._bound_unrun += (layer,)
        return call.bound(cos, sin, *self._qsa_step_plan.layer_args(layer), then=partial(self._ran_bound_layer, layer))

    def _ran_qsa_layer(self, layer: int) -> None:
        self._unsettled += (layer,)

    def _ran_bound_layer(self, layer: int) -> None:
        self._bound_unrun = tuple(x for x in self._bound_unrun if x != layer)

    def settle_qsa_layers(self) -> None:
        """The QSA cache's bookkeeping of every layer :meth:`qsa_layer` ran or :meth:`qsa_layer_call` bound since the
        last call, at once (``QSACache.settle_step_plan``)."""
        layers = self._unsettled
        if layers:
            self._unsettled = ()        # (if the settle raises, the step rolls back anyway)
            self.cache.qsa.settle_step_plan(self._qsa_step_plan, layers)

    def finish_qsa_layers(self) -> None:
        """The end of the step's layers: :meth:`settle_qsa_layers`; ``HebrusError`` where a call
        :meth:`qsa_layer_call` bound never returned (its layer's bookkeeping says written: the step must not
        commit)."""
        if self._bound_unrun:
            raise HebrusError(f"ChunkStep: the bound call of QSA cache layer(s) {list(self._bound_unrun)} never ran; "
                              f"the step cannot commit")
        self.settle_qsa_layers()

    def qsa_attention(self, layer_idx: int, q: torch.Tensor, plan, scale: float | None = None) -> torch.Tensor:
        """``hebrus::qsa_attention`` of the chunk's queries over exactly the cells ``plan`` selected.

        q: Tensor[T, Hq, Dh] (main attention queries) -> Tensor[T, Hq, Dv]. Reads the K/V planes
        of the QSA cache (built ``with_kv=True``; written by :meth:`qsa_write`'s k and v).
        """
        qsa = self.cache._need("qsa")
        if not qsa.has_kv:
            raise HebrusError("ModelCache: the QSA cache keeps no K/V planes (build it with with_kv=True)")
        layer = self.cache._qsa_layer(layer_idx)
        if not isinstance(plan, QSAPlan):
            raise HebrusError(f"ChunkStep.qsa_attention: plan must be the QSAPlan of qsa_select, got "
                              f"{type(plan).__name__}")
        self.settle_qsa_layers()
        return qsa_attention(as_tensor("ChunkStep.qsa_attention: q", q), qsa.k_cache[layer], qsa.v_cache[layer],
                             plan.token_cells, scale)


class ModelCache(PlainAttrs, StateDictProtocol, torch.nn.Module, Transactional):
    """Issues the handles both holders use and forwards every lifecycle operation to both, atomically.

    PLE goes first in each operation because it can refuse (a partial rewind needs a PLE snapshot
    at that position). Any holder may be None for a model without that path.

    PLE and GDN (the gated-delta-net layers' conv tails and recurrent states) are the **recurrent**
    holders: their state cannot be recomputed backwards, so both follow the same rules below (what is
    said of "PLE state" holds for both; snapshots hold both).

    The **PLE origin** of a sequence (SPEC §4) is the position at which its PLE state was fresh: its
    first token, or where a reset, a full removal or a rewind to the origin left it fresh (then unset
    until the next token). ``rewind(seq, p)`` with ``p <=`` the origin clears the PLE state; any other
    rewind needs a snapshot taken at p. Removing or evicting a prefix moves p0, never the origin.
    ``save``/``restore``, ``state_dict`` and ``digest`` carry it.

    Args:
        qsa: a ``QSACache`` or None.
        ple: a ``PLEState`` or None.
        gdn: a ``GDNState`` (hebrus_torch.gdn) or None.
        top_k: default number of groups ``ChunkStep.qsa_select`` keeps (``indexer_budget // r``).
        keep_snapshots: PLE snapshots kept automatically per sequence, taken at the start of each
            transaction (what ``rewind`` into the last chunks needs); 0 keeps only explicit
            :meth:`checkpoint` snapshots. Each costs ``layers * L * C`` elements.
    """

    # Bookkeeping set on every transaction, never a parameter, buffer or module (state/plain_attrs.py).
    _PLAIN_ATTRS = frozenset({"_backup", "_txn_depth_owner"})
    _STATE_OWNER = "ModelCache"

    def __init__(self, qsa=None, ple: PLEState | None = None, *, gdn: GDNState | None = None,
                 top_k: int | None = None, keep_snapshots: int = 0):
        super().__init__()
        if qsa is None and ple is None and gdn is None:
            raise HebrusError("ModelCache needs a qsa cache, a ple state or a gdn state")
        self.qsa, self.ple, self.gdn = qsa, ple, gdn
        capacities = [h.slots.capacity for h in (qsa, ple, gdn) if h is not None]
        self.slots = SlotTable(min(capacities), "ModelCache")
        self.top_k = top_k
        self.keep_snapshots = keep_snapshots
        self._snapshots: dict[int, list[CacheSnapshot]] = {}
        self._origin: dict[int, int | None] = {}       # slot -> PLE origin; None/absent: fresh, no token yet
        self._backup: tuple | None = None
        self.owner: str | None = None
        """Who runs on this cache (an ``Engine`` sets its name): loading a state dict into it is then refused, since
        its sequences belong to the owner's requests and kept prompts, whose bookkeeping a load would not change."""

    @classmethod
    def from_transformers(cls, model: torch.nn.Module, *, capacity_tokens: int, max_sequences: int = 64,
                          with_kv: bool = False, window: int | None = None, keep_snapshots: int = 0) -> "ModelCache":
        """Every holder a transformers Qwen4Exp model needs, in one call: QSA for indexed attention, PLE,
        and GDN for linear-attention layers."""
        text = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
        config = text.config
        has_indexer = "indexed_attention" in config.layer_types
        qsa = QSACache.from_transformers(model, capacity_tokens=capacity_tokens, max_sequences=max_sequences,
                                         with_kv=with_kv, window=window) if has_indexer else None
        ple = PLEState.from_transformers(model, max_sequences=max_sequences) if config.ple_layer_ids else None
        gdn = (GDNState.from_transformers(model, max_sequences=max_sequences)
               if "linear_attention" in config.layer_types else None)
        top_k = config.indexer_budget // config.indexer_compress_ratio if has_indexer else None
        return cls(qsa=qsa, ple=ple, gdn=gdn, top_k=top_k, keep_snapshots=keep_snapshots)

    # ----------------------------------------------------------------------------- holders
    @property
    def holders(self) -> list:
        """The recurrent holders (PLE, GDN) first: they are the ones that can refuse."""
        return [h for h in (self.ple, self.gdn, self.qsa) if h is not None]

    def _named_holders(self) -> list[tuple[str, Any]]:
        return [(n, h) for n, h in (("ple", self.ple), ("gdn", self.gdn), ("qsa", self.qsa)) if h is not None]

    @property
    def _recurrent(self) -> list[tuple[str, Any]]:
        return [(n, h) for n, h in (("ple", self.ple), ("gdn", self.gdn)) if h is not None]

    def _snapshot(self, seq: SeqHandle, position: int | None) -> CacheSnapshot:
        return CacheSnapshot(seq, position, {name: h.snapshot(seq, position) for name, h in self._recurrent})

    def _need(self, name: str):
        holder = getattr(self, name)
        if holder is None:
            raise HebrusError(f"ModelCache: this model has no {name} holder")
        return holder

    @staticmethod
    def _layer_index(holder, layer_idx: int, what: str) -> int:
        if type(layer_idx) is not int:         # (the message only where it may be needed: every layer, every step)
            layer_idx = as_int(f"ModelCache: the {what} layer index", layer_idx)
        ids = getattr(holder, "layer_ids", None)
        if ids is None:
            return layer_idx
        if layer_idx not in ids:
            raise HebrusError(f"ModelCache: decoder layer {layer_idx} has no {what} (layers with one: {ids})")
        return ids.index(layer_idx)

    def _ple_layer(self, layer_idx: int) -> int:
        return self._layer_index(self.ple, layer_idx, "PLE")

    def _qsa_layer(self, layer_idx: int) -> int:
        return self._layer_index(self.qsa, layer_idx, "indexer")

    def _gdn_layer(self, layer_idx: int) -> int:
        return self._layer_index(self.gdn, layer_idx, "linear attention")

    def _atomic(self):
        """One lifecycle operation over both holders, atomic even inside an open transaction."""
        return atomic(self)

    def _reserve_step(self, batch: Batch):
        """Begin one step's batch (what :class:`ChunkStep` starts with): check its handles, reserve its positions
        in the QSA cache (the ``ReservedChunk``, or None without one) and give each sequence whose PLE state is
        fresh its origin at its first token (SPEC §4)."""
        for seq in batch.seqs:
            self.slots.check(seq)
        _refuse_duplicates(batch.seqs, "ModelCache")
        if self.qsa is None:
            return None
        chunk = self.qsa.reserve(batch.seqs, batch.counts, batch.first_positions or None)
        # (the rows' first positions, as the QSA cache planned them on the host: no read back)
        firsts = chunk._starts if chunk._starts is not None else [
            int(chunk.positions[i]) if n else 0 for i, n in zip(host_ints(chunk.cu_seqlens)[:-1], batch.counts)]
        self._set_origins(batch.seqs, firsts, batch.counts)
        return chunk

    def _set_origins(self, seqs: Sequence[SeqHandle], firsts: Sequence[int], counts: Sequence[int]) -> None:
        """A sequence fed ``counts[i] > 0`` tokens from position ``firsts[i]`` while its PLE state is fresh (no
        origin) has its origin there."""
        for seq, first, count in zip(seqs, firsts, counts):
            if count and self._origin.get(seq.slot) is None:
                self._origin[seq.slot] = int(first)

    # ----------------------------------------------------------------------------- transactions
    @contextlib.contextmanager
    def transaction(self, batch: Batch | None = None) -> Iterator[ChunkStep | None]:
        """Open one transaction over both holders; with a batch, reserve its positions and yield a ChunkStep.

        Leaving the block publishes every layer's new state at once; an exception publishes nothing.
        """
        if batch is not None and not isinstance(batch, Batch):
            raise HebrusError(f"ModelCache.transaction: batch must be a Batch (Batch.pack) or None, got "
                              f"{type(batch).__name__}")
        with transaction(self):
            if batch is not None and self.keep_snapshots and self._recurrent:
                for seq in batch.seqs:
                    position = self._snapshot_position(seq)
                    if position is not None:           # a fresh state rewinds by clearing
                        self._remember(seq, self._snapshot(seq, position))
            step = ChunkStep(self, batch) if batch is not None else None
            yield step
            if step is not None:
                step.finish_qsa_layers()        # (what the block's layers left to settle: before the commit)

    def _txn_members(self) -> tuple[Transactional, ...]:
        return (self, *self.holders)

    def _txn_begin(self) -> None:
        self._backup = self._txn_savepoint()

    def _txn_commit(self) -> None:
        """Nothing to publish (the handle table changed in place); the backup stays until ``_txn_finish``."""

    def _txn_finish(self) -> None:
        self._backup = None

    def _txn_rollback(self) -> None:
        self._txn_restore(self._backup)
        self._backup = None

    def _txn_savepoint(self) -> tuple:
        return (*self.slots.lists(),
                {k: list(v) for k, v in self._snapshots.items()}, dict(self._origin))

    def _txn_restore(self, savepoint: tuple) -> None:
        generation, live, snapshots, origin = savepoint
        self.slots.load(generation, live)
        self._snapshots = {k: list(v) for k, v in snapshots.items()}
        self._origin = dict(origin)

    # ----------------------------------------------------------------------------- lifecycle
    def new_sequence(self) -> SeqHandle:
        with self._atomic():
            handle = self.slots.claim()
            for holder in self.holders:
                holder.new_sequence(handle)
        return handle

    def free(self, seq: SeqHandle) -> None:
        with self._atomic():
            self.slots.check(seq)
            for holder in self.holders:
                holder.free(seq)
            self.slots.release(seq)
            self._snapshots.pop(seq.slot, None)
            self._origin.pop(seq.slot, None)

    def reset(self, seq: SeqHandle) -> SeqHandle:
        """Empty the sequence; returns its new handle (the slot's generation is bumped)."""
        with self._atomic():
            self.free(seq)
            handle = SeqHandle(seq.slot, seq.generation + 1)
            self.slots.claim(handle)
            for holder in self.holders:
                holder.new_sequence(handle)
        return handle

    def copy(self, src: SeqHandle, dst: SeqHandle) -> None:
        with self._atomic():
            self.slots.check(src), self.slots.check(dst)
            for holder in self.holders:
                holder.copy(src, dst)
            self._snapshots[dst.slot] = [s.relabelled(handle=dst) for s in self._snapshots.get(src.slot, [])]
            self._origin[dst.slot] = self._origin.get(src.slot)

    def fork(self, src: SeqHandle) -> SeqHandle:
        with self._atomic():
            self.slots.check(src)
            handle = self.new_sequence()
            self.copy(src, handle)
        return handle

    def keep(self, seq: SeqHandle) -> None:
        """Free every sequence but ``seq``."""
        with self._atomic():
            self.slots.check(seq)
            for other in self.slots.live_handles():
                if other != seq:
                    self.free(other)

    def checkpoint(self, seq: SeqHandle) -> CacheSnapshot:
        """Keep a snapshot of the recurrent state (PLE, GDN) at the sequence's current frontier, so that
        ``rewind`` can return here.

        A sequence whose PLE state is fresh (no token since a reset or a full removal) is at no position
        yet: its snapshot is labelled None and not kept (a rewind to the origin clears the state anyway)."""
        if not self._recurrent:
            raise HebrusError("ModelCache.checkpoint: this model has no recurrent state (PLE or GDN) to keep")
        self.slots.check(seq)
        position = self._snapshot_position(seq)
        snap = self._snapshot(seq, position)
        if position is not None:
            self._remember(seq, snap, bound=False)
        return snap

    def rewind(self, seq: SeqHandle, p: int) -> None:
        """Drop positions >= p in both holders, or refuse and change nothing.

        A rewind to the sequence's PLE origin (or before it) clears the PLE state; any other needs a
        PLE snapshot taken at position p (:meth:`checkpoint`, or ``keep_snapshots``), also at a p0 that
        a prefix removal or a window eviction moved (the state there is not fresh).
        """
        self.slots.check(seq)
        p = as_int("ModelCache.rewind: p", p)
        if self.qsa is None:
            raise HebrusError("ModelCache.rewind: positions live in the QSA cache; this model has none")
        p0, n = self.qsa.run(seq)
        if p >= p0 + n:
            return
        with self._atomic():
            restored = False
            if self._recurrent:
                origin = self._origin.get(seq.slot)
                if origin is None or p <= origin:
                    self._clear_recurrent(seq)
                else:
                    snap = next((s for s in self._snapshots.get(seq.slot, []) if s.position == p), None)
                    if snap is None:
                        kept = [s.position for s in self._snapshots.get(seq.slot, [])]
                        raise HebrusError(f"ModelCache.rewind: {seq} to position {p} needs a PLE snapshot at {p} "
                                          f"(a conv tail or recurrent state cannot be recomputed backwards; the "
                                          f"PLE state is fresh only at its origin {origin}); snapshots kept at "
                                          f"{kept}")
                    for name, holder in self._recurrent:
                        holder.restore(seq, snap.parts[name])
                    restored = True
            self.qsa.rewind(seq, p)
            if restored and self.qsa.run(seq)[1] == 0:
                # p lay before the run (its prefix was removed): the next token is at p, where PLE now is.
                self.qsa._start_empty_run_at(seq, p)
            self._snapshots[seq.slot] = [s for s in self._snapshots.get(seq.slot, []) if s.position <= p]

    def remove(self, seq: SeqHandle, p0: int, p1: int) -> None:
        """seq_rm over [p0, p1) (p1 = -1: to the end): a prefix, a suffix (= rewind) or all."""
        self.slots.check(seq)
        p0, p1 = as_int("ModelCache.remove: p0", p0), as_int("ModelCache.remove: p1", p1)
        q0, n = self._need("qsa").run(seq)
        end = q0 + n if p1 < 0 else p1
        if n and p0 > q0 and end >= q0 + n:
            self.rewind(seq, p0)
            return
        with self._atomic():
            self.qsa.remove(seq, p0, p1)
            if self._recurrent and self.qsa.run(seq)[1] == 0:
                self._clear_recurrent(seq)

    def shift(self, seq: SeqHandle, p0: int, p1: int, delta: int) -> None:
        """seq_add: move the whole run by delta (PLE state is position-free; snapshot labels move with
        the run, by as much as it actually moved: a range that misses the run moves nothing)."""
        p0, p1 = as_int("ModelCache.shift: p0", p0), as_int("ModelCache.shift: p1", p1)
        delta = as_int("ModelCache.shift: delta", delta)
        with self._atomic():
            self.slots.check(seq)
            qsa = self._need("qsa")
            before = qsa.run(seq)[0]
            qsa.shift(seq, p0, p1, delta)
            moved = qsa.run(seq)[0] - before
            if moved:
                self._snapshots[seq.slot] = [s.relabelled(position=s.position + moved)
                                             for s in self._snapshots.get(seq.slot, [])]
                if self._origin.get(seq.slot) is not None:   # (no position is below 0)
                    self._origin[seq.slot] = max(self._origin[seq.slot] + moved, 0)

    # ----------------------------------------------------------------------------- cutting a step short
    @contextlib.contextmanager
    def recording(self, rows: Mapping[SeqHandle, int]) -> Iterator["StepRecording"]:
        """Around one step that feeds ``rows[seq]`` tokens to each of these sequences: afterwards
        :meth:`truncate` can keep only the first n of them (speculative decoding's verification step).

        While the block runs, the recurrent holders' state ops record, for the calls with these rows, their
        inputs and the pool rows their undo log copied before writing (``state/replay.py``: references, no
        copy of the state; PLE's conv tails are copied). The recording is only valid for the one step run
        inside the block; :meth:`StepRecording.release` hands the rows back when done."""
        for seq in rows:
            self.slots.check(seq)
        rec = StepRecording({seq: self._next_position(seq) for seq in rows}, dict(rows), ReplayLog(list(rows)))
        for _, holder in self._recurrent:
            holder.replay_log = rec.log
        try:
            yield rec
        finally:
            for _, holder in self._recurrent:
                holder.replay_log = None

    def truncate(self, rec: "StepRecording", keep: Mapping[SeqHandle, int]) -> None:
        """After the recorded step committed: keep only the first ``keep[seq]`` (>= 1) of the tokens it fed
        each sequence. Every holder is then bitwise as if the step had fed only those: the recurrent state is
        restored from the recorded rows and its state ops run again on the kept tokens' recorded inputs (not
        the model), the QSA cache drops the positions past them. One atomic operation: it changes all or
        nothing."""
        todo: dict[SeqHandle, int] = {}
        for seq, n in keep.items():
            if seq not in rec.fed:
                raise HebrusError(f"ModelCache.truncate: {seq} was not recorded")
            self.slots.check(seq)
            n = as_int("ModelCache.truncate: keep", n)
            if not 1 <= n <= rec.fed[seq]:
                raise HebrusError(f"ModelCache.truncate: {seq} was fed {rec.fed[seq]} tokens; keep must be in "
                                  f"[1, {rec.fed[seq]}], got {n}")
            if n < rec.fed[seq]:
                todo[seq] = n
        if not todo:
            return
        with self._atomic():
            rec.log.rewind(todo)
            rec.log.replay(todo)
            ends = {seq: rec.starts[seq] + n for seq, n in todo.items() if rec.starts[seq] is not None}
            if self.qsa is not None and ends:
                self.qsa.rewind_many(ends)
                for seq, end in ends.items():
                    kept = [s for s in self._snapshots.get(seq.slot, []) if s.position <= end]
                    if kept or seq.slot in self._snapshots:
                        self._snapshots[seq.slot] = kept

    def save(self, seq: SeqHandle) -> bytes:
        """One sequence of every holder as bytes (no pickle; see hebrus_torch.state.blob)."""
        return self.save_unpacked(seq).pack()

    def save_unpacked(self, seq: SeqHandle) -> blob.Unpacked:
        """What :meth:`save` serialises, copied out of every holder now; its ``pack()`` gives the same bytes and
        may run on another thread (the prompt cache writes files so, off the engine's step)."""
        self.slots.check(seq)
        parts = {name: h.save_unpacked(seq) for name, h in self._named_holders()}
        return blob.Unpacked.of(_KIND, {"holders": sorted(parts), "origin": self._origin.get(seq.slot)}, parts)

    def restore(self, data: bytes, seq: SeqHandle | None = None) -> SeqHandle:
        """Restore a saved sequence into a new sequence (or the free handle ``seq``); returns its handle.

        SPEC §4's argument order, ``restore(seq, data)``, is accepted too."""
        if isinstance(data, SeqHandle) and isinstance(seq, (bytes, bytearray, memoryview)):
            data, seq = seq, data
        if seq is not None and not isinstance(seq, SeqHandle):
            raise HebrusError(f"ModelCache.restore: seq must be a SeqHandle or None, got {type(seq).__name__}")
        meta, parts = blob.unpack(data, _KIND)
        names = sorted(n for n, _ in self._named_holders())
        blob.expect(_KIND, blob.same(meta.get("holders"), names) and sorted(parts) == names,
                    f"blob holds {blob.short(meta.get('holders'))}, this cache has {names}")
        # Everything in the blob is validated before a slot is claimed (a bad blob is CorruptStateError
        # whatever the cache holds).
        ple_state = self.ple._decode(parts["ple"].numpy().tobytes()) if self.ple is not None else None
        gdn_state = self.gdn._decode(parts["gdn"].numpy().tobytes()) if self.gdn is not None else None
        qsa_state = self.qsa._decode_seq(parts["qsa"].numpy().tobytes()) if self.qsa is not None else None
        if "origin" in meta:
            origin = meta["origin"]
            blob.expect(_KIND, origin is None or (type(origin) is int and 0 <= origin <= MAX_POSITION),
                        f"bad PLE origin {blob.short(origin)} (None or a position)")
        else:   # blobs of earlier builds: the run's p0 (what those builds took for the origin)
            origin = qsa_state[0] if qsa_state is not None and qsa_state[1] else None
        if origin is not None and qsa_state is not None:
            blob.expect(_KIND, origin <= qsa_state[0], f"PLE origin {origin} lies inside the saved run "
                                                       f"[{qsa_state[0]}, {qsa_state[0] + qsa_state[1] - 1}]")
        if origin is None:
            why = self._tokens_seen(qsa_state[1] if qsa_state is not None else 0, ple_state, gdn_state)
            blob.expect(_KIND, why is None, f"PLE origin None (a fresh sequence with no token yet), but {why}")
        with self._atomic():
            handle = self.slots.claim(seq)
            if self.ple is not None:
                self.ple.new_sequence(handle)
                self.ple.restore(handle, PLESnapshot(handle, None, *ple_state))
            if self.gdn is not None:
                self.gdn.new_sequence(handle)
                self.gdn.restore(handle, GDNSnapshot(handle, None, *gdn_state))
            if self.qsa is not None:
                self.qsa._restore_decoded(handle, qsa_state)
            self._origin[handle.slot] = origin
        return handle

    def digest(self) -> str:
        """sha256 over every holder's digest, the handle table (free slots' generations too: they decide
        the next handles) and each live sequence's PLE origin."""
        generation, live = self.slots.generation.tolist(), self.slots.live.tolist()
        return blob.digest_of([("generation", generation), ("live", live), ("origin", self._origins())] +
                              [(type(h).__name__, h.digest()) for h in self.holders])

    def _origins(self) -> list[int | None]:
        """Per slot, the PLE origin (None for a free slot or a fresh state with no token yet)."""
        live = self.slots.live.tolist()
        return [self._origin.get(slot) if on else None for slot, on in enumerate(live)]

    # ----------------------------------------------------------------------------- internals
    def _next_position(self, seq: SeqHandle) -> int | None:
        if self.qsa is None:
            return None
        p0, n = self.qsa.run(seq)
        return p0 + n

    def _snapshot_position(self, seq: SeqHandle) -> int | None:
        """The position a PLE snapshot of the sequence is at now: its next position, or None while its PLE
        state is fresh with no token yet (its origin is where its next token lands)."""
        position = self._next_position(seq)
        if position is None or (self.qsa.run(seq)[1] == 0 and self._origin.get(seq.slot) is None):
            return None
        return position

    def _clear_recurrent(self, seq: SeqHandle) -> None:
        """Fresh PLE state for a sequence whose whole run was dropped; its snapshots, of the stream just
        dropped, go too (none fits what comes next), and its origin is where its next token lands."""
        for _, holder in self._recurrent:
            holder.clear(seq)
        self._snapshots.pop(seq.slot, None)
        self._origin.pop(seq.slot, None)

    def _remember(self, seq: SeqHandle, snap: CacheSnapshot, bound: bool = True) -> None:
        kept = [s for s in self._snapshots.get(seq.slot, []) if s.position != snap.position] + [snap]
        if bound and self.keep_snapshots:
            kept = kept[-self.keep_snapshots:]
        self._snapshots[seq.slot] = kept

    # ----------------------------------------------------------------------------- state dict (StateDictProtocol)
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Loaded as part of a parent module: the same validated, all-or-nothing load, then the holders'
        # own hooks (which torch calls next, on the same entries) have nothing left to do.
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for holder in self.holders:
            holder._loaded_by_owner = True

    def _state_keys(self) -> set[str]:
        """The keys of this cache's state dict."""
        return {"_extra_state", *(f"{name}.{k}" for name, h in self._named_holders() for k in h._state_keys())}

    _NO_ORIGIN = object()

    def _table_checksum(self, generation: list, live: list, origin: Any = _NO_ORIGIN) -> str:
        """sha256 of the handle table and, when given, the PLE origins (state dicts of earlier builds have none)."""
        parts: list[tuple[str, Any]] = [("generation", generation), ("live", live)]
        if origin is not self._NO_ORIGIN:
            parts.append(("origin", origin))
        return blob.digest_of(parts)

    def _tokens_seen(self, qsa_tokens: int, ple_state: tuple | None, gdn_state: tuple | None) -> str | None:
        """Why a saved sequence has consumed tokens (None if nothing says so): a QSA run, or PLE / GDN state
        other than a fresh sequence's (EOS histories, zero tails and states). Such a sequence must record its
        PLE origin: with None, a later rewind would clear its PLE state as if it were fresh there (SPEC §4)."""
        if qsa_tokens:
            return f"its QSA run holds {qsa_tokens} tokens"
        if ple_state is not None:
            history, tails = ple_state
            if bool((history != self.ple.eos_token_id).any()) or bool((tails != 0).any()):
                return "its PLE state is not a fresh sequence's"
        if gdn_state is not None and any(bool((t != 0).any()) for t in gdn_state):
            return "its GDN state is not a fresh sequence's"
        return None

    def _validate_state_dict(self, sd: dict[str, Any]) -> tuple:
        """The handle table, the PLE origins and both holders' parts (each checked by its holder), all
        validated against each other (CorruptStateError)."""
        if self.in_transaction:
            raise HebrusError("ModelCache.load_state_dict cannot run inside a transaction")
        if self.owner is not None:
            raise HebrusError(f"ModelCache.load_state_dict: this cache is run by {self.owner}, whose requests and kept "
                              f"prompts hold its sequences; load into a cache nothing runs on (move one sequence "
                              f"between caches with save / restore)")
        extra = sd.get("_extra_state")
        cap = self.slots.capacity
        blob.expect(_KIND, isinstance(extra, dict) and blob.same(extra.get("format"), _KIND),
                    "state dict lacks ModelCache metadata")
        blob.expect(_KIND, blob.same(extra.get("version"), blob.FORMAT_VERSION),
                    f"unsupported version {blob.short(extra.get('version'))}")
        generation, live = extra.get("generation"), extra.get("live")
        blob.expect(_KIND, isinstance(generation, list) and isinstance(live, list) and len(generation) == cap
                    and len(live) == cap, f"the handle table must list {cap} generations and live flags")
        problem = generation_problem(generation, live)
        blob.expect(_KIND, problem is None, f"the handle table is invalid: {problem}")
        origin = extra.get("origin", self._NO_ORIGIN)
        blob.expect(_KIND, extra.get("checksum") == self._table_checksum(generation, live, origin),
                    "checksum mismatch: the handle table was modified")

        parts = {}
        for name, holder in self._named_holders():
            prefix = name + "."
            parts[name] = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
            holder.check_state_dict(parts[name])
            h_gen, h_live = parts[name].get("generation"), parts[name].get("live")
            blob.expect(_KIND, isinstance(h_gen, torch.Tensor) and isinstance(h_live, torch.Tensor),
                        f"{name} state lacks its handle table")
            h_gen, h_live = h_gen.tolist(), h_live.tolist()
            for slot in range(len(h_live)):
                mine = (generation[slot], live[slot]) if slot < cap else None
                if mine is not None and mine[1]:
                    ok = h_live[slot] and h_gen[slot] == mine[0]
                else:  # free here: free there too, at a generation a new handle of this table can claim
                    ok = not h_live[slot] and (mine is None or h_gen[slot] <= mine[0])
                blob.expect(_KIND, ok, f"{name} slot {slot} (generation {h_gen[slot]}, live {h_live[slot]}) "
                                       f"disagrees with the ModelCache handle table")
        if origin is not self._NO_ORIGIN:
            blob.expect(_KIND, isinstance(origin, list) and len(origin) == cap,
                        f"the PLE origins must list {cap} entries")
            for slot, (o, on) in enumerate(zip(origin, live)):
                blob.expect(_KIND, o is None or (on and type(o) is int and 0 <= o <= MAX_POSITION),
                            f"slot {slot} has PLE origin {blob.short(o)} (None, or a position of a live slot)")
        runs = None
        if "qsa" in parts:
            runs = (parts["qsa"]["seq_p0"].tolist(), parts["qsa"]["seq_n"].tolist())
        if origin is self._NO_ORIGIN:   # earlier builds: the run's p0 (what they took for the origin)
            origin = [runs[0][slot] if runs is not None and on and runs[1][slot] else None
                      for slot, on in enumerate(live)]
        elif runs is not None:
            for slot, o in enumerate(origin):
                blob.expect(_KIND, o is None or o <= runs[0][slot],
                            f"slot {slot} has PLE origin {o} inside its run (which starts at {runs[0][slot]})")
        for slot, (o, on) in enumerate(zip(origin, live)):
            if on and o is None:
                why = self._tokens_seen(
                    runs[1][slot] if runs is not None else 0,
                    (parts["ple"]["history"][:, slot], parts["ple"]["conv_state"][:, slot]) if "ple" in parts else None,
                    (parts["gdn"]["conv_state"][:, slot], parts["gdn"]["recurrent_state"][:, slot])
                    if "gdn" in parts else None)
                blob.expect(_KIND, why is None, f"slot {slot} has PLE origin None (a fresh sequence with no token "
                                                f"yet), but {why}")
        return parts, list(generation), list(live), origin

    def _prepare_candidate(self, candidate: tuple) -> tuple:
        """Everything that can fail (allocations, moves to the device, re-pooling) before anything is
        published: publishing is reference assignments only, so it cannot stop with one holder new and
        the other old."""
        parts, generation, live, origin = candidate
        prepared = {name: getattr(self, name)._prepare_state_dict(part) for name, part in parts.items()}
        return prepared, generation, live, origin

    def _swap_state_dict(self, prepared_all: tuple) -> None:
        prepared, generation, live, origin = prepared_all
        for name, prep in prepared.items():
            getattr(self, name)._swap_state_dict(prep)
        self.slots.assign(generation, live)
        self._snapshots = {}
        self._origin = {slot: o for slot, o in enumerate(origin) if o is not None}

    def _apply(self, fn, recurse: bool = True):
        # Both holders' refusals (inside a transaction, an unsupported dtype) before either moves.
        if self.in_transaction:
            raise HebrusError("ModelCache: cannot move or cast the cache inside a transaction")
        for holder in self.holders:
            holder._check_apply(fn)
        return super()._apply(fn, recurse)

    def state_dict(self, *args, **kwargs):
        """Both holders and the handle table (refused inside a transaction: nothing of it is published)."""
        if self.in_transaction:
            raise HebrusError("ModelCache.state_dict cannot run inside a transaction (its changes are not published)")
        return super().state_dict(*args, **kwargs)

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {}     # the holders' tensors are saved by their own modules (children of this one)

    def _extra_state_for(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        generation, live, origin = self.slots.generation.tolist(), self.slots.live.tolist(), self._origins()
        return {"format": _KIND, "version": blob.FORMAT_VERSION, "generation": generation, "live": live,
                "origin": origin, "checksum": self._table_checksum(generation, live, origin)}

    def set_extra_state(self, state: Any) -> None:
        raise HebrusError("ModelCache: load the whole cache with load_state_dict")

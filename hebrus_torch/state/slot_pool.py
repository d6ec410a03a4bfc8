"""What a holder that keeps each sequence's state in per-layer pools of slot rows does the same way,
whatever the pools hold (PLEState: n-gram histories and conv tails; GDNState: conv tails and recurrent
states): its slot table and the buffers mirroring it, the undo log of its in-place changes, the
one-sequence blobs (save / restore) and the whole-holder state dict, with every check of a loaded
state dict or blob (SPEC §4), written once.

A holder subclasses :class:`SlotPoolHolder` before ``torch.nn.Module`` (and ``Transactional`` after it)
and defines:

* ``_STATE_OWNER`` (its class name, in messages), ``_KIND`` (the format of its blobs and state dicts)
  and ``_SEQ_PARTS``: one :class:`SeqPart` per pool buffer ``[layers, S, ...]``, in the order of a
  snapshot's parts (``_snapshot_parts``, ``_write_slot``);
* ``_SNAPSHOT``, its snapshot dataclass (``handle``, ``position``, then a field per part named as the
  part's blob tensor), and ``_config_meta()`` (JSON-like, with ``max_sequences``);
* where it differs from the defaults: ``_fresh_value(pool)`` (what a fresh slot holds, 0),
  ``_check_seq_values(parts, error)`` / ``_check_state_values(sd)`` (value checks of a loaded
  sequence / state dict), ``_seq_meta(meta)`` (a blob's metadata as this build compares it),
  ``_apply_undo`` for undo entries of its own, and ``_drop_caches()`` (after a load).
"""

from __future__ import annotations

import weakref

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from ..errors import CorruptStateError, HebrusError
from . import blob
from .args import check_cast
from .handles import SeqHandle, SlotTable, generation_problem
from .protocol import StateDictProtocol
from .slot_lifecycle import SlotLifecycle
from .transaction import atomic

__all__ = ["SeqPart", "SlotPoolHolder", "SlotUndo", "RowsUndo", "PoolSavepoint"]


class SeqPart(NamedTuple):
    """One pool of a holder and what a sequence's share of it is called."""

    pool: str                # the buffer [layers, S, ...] (a state dict entry)
    blob: str                # the sequence's [layers, ...] in a one-sequence blob (save / restore)
    digest: str              # ... in ``digest(seq)``
    what: str                # ... in messages
    fixed_dtype: bool        # the pool keeps its dtype under ``.to(dtype)`` (messages name it short: int64)


@dataclass(frozen=True)
class PoolSavepoint:
    """A point inside an open transaction to return to (see ``SlotPoolHolder._txn_restore``)."""

    undo_len: int
    generation: list[int]
    live: list[bool]


@dataclass(frozen=True)
class SlotUndo:
    """A lifecycle op's undo: every layer's rows of one slot in each pool, as they were."""

    slot: int
    rows: dict[str, torch.Tensor]   # pool name -> [layers, ...] of the slot


@dataclass(frozen=True)
class RowsUndo:
    """A step's undo: the rows of one layer's pool that an in-place op overwrites."""

    name: str                  # the pool
    layer: int | None          # None: every layer's rows (rows [L, B, ...])
    slots: torch.Tensor        # [B] int32, the index the op runs with
    rows: torch.Tensor         # [B, ...] the pool rows before the op


class SlotPoolHolder(SlotLifecycle, StateDictProtocol):
    """Mixin: slot table buffers, undo log, one-sequence blobs and the state dict of a slot-pool holder
    (see the module docstring for what the holder defines)."""

    _KIND = "hebrus_torch.holder"
    _SNAPSHOT: type                    # the snapshot dataclass: handle, position, one field per SeqPart.blob
    _SEQ_PARTS: tuple[SeqPart, ...] = ()
    _STATE_NAMES: tuple[str, ...] = ("generation", "live")   # the state dict's tensors, checksummed in this order
    _undo: list
    _base: PoolSavepoint | None
    slots: SlotTable

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_SEQ_PARTS" in cls.__dict__:
            cls._STATE_NAMES = (*(p.pool for p in cls._SEQ_PARTS), "generation", "live")
            # the pool in the holder's dtype (it follows .to(dtype)): what a cast is checked against
            cls._CAST_POOL = next(p.pool for p in cls._SEQ_PARTS if not p.fixed_dtype)

    # ------------------------------------------------------------------ what a holder may override
    def _fresh_value(self, pool: str) -> int:
        """What every element of a fresh slot's rows in ``pool`` holds."""
        return 0

    def _check_seq_values(self, parts: tuple[torch.Tensor, ...], error: type) -> None:
        """Value checks of one sequence's parts, their shapes and dtypes already checked (none by default)."""

    def _check_state_values(self, sd: dict[str, Any]) -> None:
        """Value checks of a state dict, everything else already checked (none by default)."""

    def _seq_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """A blob's metadata as this build compares it with ``_seq_config_meta`` (as it is by default)."""
        return meta

    def _drop_caches(self) -> None:
        """Forget what was derived from the buffers (they were just replaced by a load)."""

    # ------------------------------------------------------------------ slot table and rows
    def _register_slot_buffers(self, device: torch.device | str | None) -> None:
        """The ``generation`` / ``live`` buffers of the slot table ``self.slots`` (registered after the pools,
        as the state dict lists them)."""
        self.register_buffer("generation", self.slots.generation.to(device))
        self.register_buffer("live", self.slots.live.to(device))

    def _sync_slot_buffers(self) -> None:
        self.generation.copy_(self.slots.generation)
        self.live.copy_(self.slots.live)

    def _log_slot(self, slot: int) -> None:
        """Lifecycle ops change published rows in place: record the slot's rows for an undo."""
        self._undo.append(SlotUndo(slot, {p.pool: getattr(self, p.pool)[:, slot].clone() for p in self._SEQ_PARTS}))

    def _clear_slot(self, slot: int) -> None:
        self._log_slot(slot)
        for p in self._SEQ_PARTS:
            getattr(self, p.pool)[:, slot] = self._fresh_value(p.pool)

    def _write_slot(self, slot: int, *parts: torch.Tensor) -> None:
        self._log_slot(slot)
        for p, part in zip(self._SEQ_PARTS, parts):
            pool = getattr(self, p.pool)
            pool[:, slot] = part.detach().to(pool.device, pool.dtype)

    # ------------------------------------------------------------------ transactions (an undo log)
    def _txn_begin(self) -> None:
        self._reset_staging()
        self._base = self._txn_savepoint()

    def _reset_staging(self) -> None:
        self._undo = []
        self._base = None

    def _txn_commit(self) -> None:
        """Nothing to publish: every change of the block is already in the buffers. Until ``_txn_finish``
        the undo log is kept, so a rollback (another holder's commit failing) still undoes the block."""

    def _txn_finish(self) -> None:
        self._reset_staging()

    def _txn_rollback(self) -> None:
        if self._base is not None:
            self._txn_restore(self._base)
        self._reset_staging()

    def _txn_savepoint(self) -> PoolSavepoint:
        generation, live = self.slots.lists()
        return PoolSavepoint(len(self._undo), generation, live)

    def _txn_restore(self, sp: PoolSavepoint) -> None:
        for entry in reversed(self._undo[sp.undo_len:]):
            self._apply_undo(entry)
        del self._undo[sp.undo_len:]
        self.slots.load(sp.generation, sp.live)
        self._sync_slot_buffers()

    def _apply_undo(self, entry: Any) -> None:
        with torch.no_grad():
            if isinstance(entry, SlotUndo):
                for name, rows in entry.rows.items():
                    getattr(self, name)[:, entry.slot] = rows
            else:
                pool = getattr(self, entry.name)
                if entry.layer is None:
                    pool.index_copy_(1, entry.slots.long(), entry.rows)
                else:
                    pool[entry.layer].index_copy_(0, entry.slots.long(), entry.rows)

    def _check_apply(self, fn) -> None:
        """What ``_apply`` refuses before anything changes (a ModelCache checks every holder first)."""
        if self.in_transaction:
            raise HebrusError(f"{self._STATE_OWNER}: cannot move or cast the state inside a transaction (its "
                              f"changes are staged)")
        pool = getattr(self, self._CAST_POOL)
        check_cast(self._STATE_OWNER, fn, pool.dtype, pool.device)

    # ------------------------------------------------------------------ one sequence
    def _snapshot_parts(self, snap: Any) -> tuple[torch.Tensor, ...]:
        """A snapshot's tensors in ``_SEQ_PARTS`` order (its fields are named as the blob's tensors)."""
        return tuple(getattr(snap, p.blob) for p in self._SEQ_PARTS)

    def snapshot(self, seq: SeqHandle, position: int | None = None) -> Any:
        """A cheap copy of one sequence's current state (an open transaction's changes included): the
        holder's ``_SNAPSHOT`` (``handle``, ``position``, then one ``[layers, ...]`` copy per pool).
        ``position`` is the caller's label for the next position the sequence would consume."""
        slot = self.slots.check(seq)
        snap = self._SNAPSHOT(seq, position, *(getattr(self, p.pool)[:, slot].clone() for p in self._SEQ_PARTS))
        self._own_snapshots()[id(snap)] = snap
        return snap

    def _own_snapshots(self) -> weakref.WeakValueDictionary:
        """The snapshots this holder took that are still alive, by id."""
        own = self.__dict__.get("_taken_snapshots")
        if own is None:
            own = weakref.WeakValueDictionary()
            object.__setattr__(self, "_taken_snapshots", own)
        return own

    def restore(self, seq: SeqHandle, state: Any) -> None:
        """Overwrite a live sequence's state with a snapshot or the bytes of :meth:`save`.

        Everything is validated first; a bad snapshot (HebrusError) or blob (CorruptStateError) changes nothing.
        """
        slot = self.slots.check(seq)
        if isinstance(state, self._SNAPSHOT):
            parts = self._snapshot_parts(state)
            taken_here = self._own_snapshots().get(id(state)) is state and all(
                isinstance(t, torch.Tensor) and t.device == getattr(self, p.pool).device
                for p, t in zip(self._SEQ_PARTS, parts))
            # (a snapshot this holder took holds values it held: checking them again would read the device)
            self._validate_seq_state(parts, HebrusError, values=not taken_here)
        else:
            parts = self._decode(state)
        with atomic(self):
            self._write_slot(slot, *parts)

    def write_layer_rows(self, pool: str, layer: int, seqs: Sequence[SeqHandle], rows: torch.Tensor) -> None:
        """Overwrite layer ``layer``'s rows of live ``seqs`` in ``pool`` with ``rows`` ``[len(seqs), ...]``, as
        one undo-logged scatter (unchecked values: the rows a step's op logged, ``state/replay.py``)."""
        slots = [self.slots.check(seq) for seq in seqs]
        target = getattr(self, pool)[layer]
        index = torch.tensor(slots, dtype=torch.int64).to(target.device)     # an upload: no wait
        with atomic(self):
            self._undo.append(RowsUndo(pool, layer, index, target.index_select(0, index)))
            target.index_copy_(0, index, rows.to(target.dtype))

    def save(self, seq: SeqHandle) -> bytes:
        """One sequence's state as bytes: JSON metadata + raw tensors + sha256, no pickle."""
        return self.save_unpacked(seq).pack()

    def save_unpacked(self, seq: SeqHandle) -> blob.Unpacked:
        """What :meth:`save` serialises, copied now; its ``pack()`` (the same bytes) may run on another thread."""
        parts = self._snapshot_parts(self.snapshot(seq))
        return blob.Unpacked.of(self._KIND, self._seq_config_meta(), {p.blob: t for p, t in zip(self._SEQ_PARTS, parts)})

    def _seq_config_meta(self) -> dict[str, Any]:
        """The config a one-sequence blob records: not the slot count, which a sequence's state does not
        depend on (as QSACache's blobs)."""
        meta = self._config_meta()
        del meta["max_sequences"]
        return meta

    def _decode(self, data: bytes) -> tuple[torch.Tensor, ...]:
        """The parts of a blob of :meth:`save`, validated (CorruptStateError)."""
        kind = self._KIND
        meta, tensors = blob.unpack(data, kind)
        meta = self._seq_meta(meta)
        blob.expect(kind, blob.same(meta, self._seq_config_meta()),
                    f"blob was saved with config {blob.short(meta)}, this holder has {self._seq_config_meta()!r}")
        blob.expect(kind, set(tensors) == {p.blob for p in self._SEQ_PARTS}, f"blob holds tensors {sorted(tensors)}")
        parts = tuple(tensors[p.blob] for p in self._SEQ_PARTS)
        self._validate_seq_state(parts, CorruptStateError)
        return parts

    def _validate_seq_state(self, parts: tuple, error: type, values: bool = True) -> None:
        """One sequence's parts (a snapshot's or a blob's): tensors of the pools' shapes without the slot
        dimension and of their dtypes, then their values; ``error`` names what is wrong."""
        for p, t in zip(self._SEQ_PARTS, parts):
            pool = getattr(self, p.pool)
            want = (pool.shape[0], *pool.shape[2:])
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != pool.dtype:
                got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                dtype = str(pool.dtype).removeprefix("torch.") if p.fixed_dtype else str(pool.dtype)
                raise error(f"{self._STATE_OWNER}: {p.what} must be {list(want)} {dtype}, got {got}")
        if values:
            self._check_seq_values(parts, error)

    def digest(self, seq: SeqHandle | None = None) -> str:
        """sha256 of the public state: config, every slot's generation and live flag (free slots' too: they
        decide the next handles), and each live sequence's rows (an open transaction's changes included).

        With ``seq``, of that sequence's rows only (not its slot), so two sequences with equal state have
        equal digests. Free slots' rows are not state.
        """
        if seq is not None:
            parts = self._snapshot_parts(self.snapshot(seq))
            return blob.digest_of([(p.digest, t) for p, t in zip(self._SEQ_PARTS, parts)])
        parts: list[tuple[str, Any]] = [("config", self._config_meta()), ("generation", self.slots.generation),
                                        ("live", self.slots.live)]
        for h in self.slots.live_handles():
            parts += [("handle", [h.slot, h.generation]), ("sequence", self.digest(h))]
        return blob.digest_of(parts)

    # ------------------------------------------------------------------ the state dict (StateDictProtocol)
    def _state_keys(self) -> set[str]:
        return {*self._STATE_NAMES, "_extra_state"}

    def _as_dict(self, state_dict: Any) -> dict[str, Any]:
        if self.in_transaction:
            raise HebrusError(f"{self._STATE_OWNER}.load_state_dict cannot run inside a transaction")
        return super()._as_dict(state_dict)

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        # Copies, as QSACache's: a state dict kept while decoding goes on stays what it was.
        if self.in_transaction:
            raise HebrusError(f"{self._STATE_OWNER}.state_dict cannot run inside a transaction (its changes are "
                              f"staged)")
        return {name: getattr(self, name).detach().clone() for name in self._STATE_NAMES}

    def _extra_state_for(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"format": self._KIND, "version": blob.FORMAT_VERSION, "config": self._config_meta(),
                "checksum": blob.digest_of([(n, tensors[n]) for n in self._STATE_NAMES])}

    def _validate_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Keys, format, version, config, entry types, shapes, dtypes, checksum, slot table, then the holder's
        value checks (CorruptStateError); the candidate is the state dict itself."""
        kind, owner = self._KIND, self._STATE_OWNER
        blob.known_entries(f"{owner}.load_state_dict", sd, self._state_keys(), strict=True)
        expect = blob.expect
        extra = sd.get("_extra_state")
        expect(kind, isinstance(extra, dict) and blob.same(extra.get("format"), kind),
               f"state dict lacks {owner} metadata")
        expect(kind, blob.same(extra.get("version"), blob.FORMAT_VERSION),
               f"unsupported version {blob.short(extra.get('version'))}")
        expect(kind, blob.same(extra.get("config"), self._config_meta()),
               f"state dict was saved with config {blob.short(extra.get('config'))}, this holder has "
               f"{self._config_meta()!r}")
        for name in self._STATE_NAMES:
            mine = getattr(self, name)
            t = sd.get(name)
            expect(kind, isinstance(t, torch.Tensor), f"state dict lacks tensor {name!r}")
            blob.check_tensors(kind, {name: t})
            expect(kind, t.shape == mine.shape and t.dtype == mine.dtype,
                   f"{name} has shape {tuple(t.shape)} {t.dtype}, expected {tuple(mine.shape)} {mine.dtype}")
        checksum = blob.digest_of([(n, sd[n]) for n in self._STATE_NAMES])
        expect(kind, extra.get("checksum") == checksum, "checksum mismatch: state dict was modified or truncated")
        problem = generation_problem(sd["generation"].tolist(), sd["live"].tolist())
        expect(kind, problem is None, f"the slot table is invalid: {problem}")
        self._check_state_values(sd)
        return sd

    def _prepare_candidate(self, state_dict: dict[str, Any]) -> tuple:
        """The fallible part of publishing a checked state dict: fresh buffers (laid out as the current
        ones) and the slot table, built before anything is published."""
        buffers = {name: torch.empty_like(getattr(self, name)).copy_(state_dict[name].detach())
                   for name in self._STATE_NAMES}
        generation = [int(g) for g in state_dict["generation"].tolist()]
        live = [bool(v) for v in state_dict["live"].tolist()]
        return buffers, generation, live

    def _swap_state_dict(self, prepared: tuple) -> None:
        """Publish what ``_prepare_candidate`` built: reference assignments only, nothing that can fail."""
        buffers, generation, live = prepared
        self._drop_caches()
        for name, tensor in buffers.items():
            setattr(self, name, tensor)
        self.slots.assign(generation, live)
        self._reset_staging()

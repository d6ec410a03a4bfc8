"""QSACache transactions: the undo log of every published change, savepoints, and the commit hooks.

Every mutation of a bookkeeping tensor or of content visible to ``digest()`` goes through ``_set`` /
``_log_content``, which record the old values, so a savepoint (``_Savepoint``: the log length, the runs,
the slot table and the tensor references) can be returned to bitwise. ``_txn_prepare`` does the fallible
part of a commit: settle pending window evictions, zero-fill cells never written for a layer (keys
Tensor[L, C, D], K/V Tensor[L, C, Hkv, Dh|Dv]) and pool every pending group (pooled Tensor[L, G, D]).
The decisions (which cells, which rows) are made on the host bookkeeping; a device tensor's entry in
the log holds the uploaded index, so undoing it needs no read of the device either.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..state.transaction import atomic
from .runs import _Run, _RunTable

_STATE_TENSORS = ("cell_pos", "cell_ref", "keys", "k_cache", "v_cache", "pooled", "group_ref",
                  "_unwritten", "_pending", "_pend_cells", "_pend_pos", "_freed_cells", "_freed_rows")


class _Txn:
    def __init__(self) -> None:
        self.token = object()
        self.log: list[tuple[torch.Tensor, Any, torch.Tensor]] = []
        self.new_cells: list[torch.Tensor] = []                 # cells reserved in this transaction
        self.pending: list[list[torch.Tensor]] = []             # per layer: rows that may be pending
        self.evict: dict[int, int] = {}                         # window: slot -> p0 once its chunk is planned
        self.written: dict[int, tuple] = {}     # layer -> (layout key,) of the chunk write cleared its flags for
        self.base: _Savepoint | None = None
        self.freed = False                      # whether a _freed_cells / _freed_rows flag may have been set
        self.prepared: tuple[torch.Tensor | None, list[tuple[int, torch.Tensor]]] = (None, [])


@dataclass
class _Savepoint:
    log_len: int
    runs: dict[int, _Run]
    generation: list[int]
    live: list[bool]
    heads: tuple[int, int]
    tensors: dict[str, torch.Tensor | None]
    new_cells: list[torch.Tensor]
    pending: list[list[torch.Tensor]]
    evict: dict[int, int]
    dtype: torch.dtype


def _index_line(tensor: torch.Tensor, idx: Any) -> tuple[torch.Tensor, int, torch.Tensor] | None:
    """``tensor[idx]`` as (view, dim, index) for ``view.index_select(dim, index)`` where ``idx`` is a 1-D int64 index,
    ``(i, index)`` or ``(:, index)`` (the bookkeeping's forms); None for any other index."""
    if isinstance(idx, torch.Tensor):
        view, dim, at = tensor, 0, idx
    elif isinstance(idx, tuple) and len(idx) == 2 and isinstance(idx[1], torch.Tensor) and tensor.dim() >= 2:
        head, at = idx
        if isinstance(head, int) and not isinstance(head, bool):
            view, dim = tensor.select(0, head), 0
        elif isinstance(head, slice) and head == slice(None):
            view, dim = tensor, 1
        else:
            return None
    else:
        return None
    if at.dim() != 1 or at.dtype != torch.int64 or at.device != tensor.device:
        return None
    return view, dim, at


_ABSENT = object()


class _WriteScope:
    """``write``'s atomicity inside an open transaction, lighter than a savepoint of the whole cache: what a write
    changes is only the undo-logged tensors (the flags, a rewrite's old content, re-pooled rows), the layer's pending
    rows and its written memo (fresh cells' content and pending rows' pooled keys are invisible until commit), so
    a failure undoes the log entries after its start and puts those two back, as ``_restore`` would."""

    __slots__ = ("cache", "layer", "log_len", "pending", "written")

    def __init__(self, cache: "_Transactions", layer: int) -> None:
        txn = cache._txn
        self.cache, self.layer = cache, layer
        self.log_len, self.pending, self.written = len(txn.log), list(txn.pending[layer]), \
            txn.written.get(layer, _ABSENT)

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            return False
        txn = self.cache._txn
        self.cache._undo_log_after(self.log_len)
        txn.pending[self.layer] = self.pending
        if self.written is _ABSENT:
            txn.written.pop(self.layer, None)
        else:
            txn.written[self.layer] = self.written
        return False


class _Transactions:
    """Undo log, savepoints and the ``Transactional`` hooks of :class:`QSACache`."""

    def _set(self, tensor: torch.Tensor, idx: Any, value: Any, old: torch.Tensor | None = None) -> None:
        """``tensor[idx] = value`` with the old values recorded in the undo log. ``idx`` and ``value`` are
        host data; for a device tensor their tensors are uploaded first. ``old``: the caller's copy of
        ``tensor[idx]`` as it is now, a tensor of its own (a host tensor's advanced-index gather), logged
        instead of gathering it again."""
        txn = self._txn
        assert txn is not None, "QSACache mutation outside a transaction"
        if not tensor.is_cpu:
            idx = tuple(self._dev(i) if isinstance(i, torch.Tensor) else i for i in idx) \
                if isinstance(idx, tuple) else (self._dev(idx) if isinstance(idx, torch.Tensor) else idx)
            if isinstance(value, torch.Tensor) and value.dim():
                value = self._dev(value)
        line = _index_line(tensor, idx)
        if line is None:
            txn.log.append((tensor, idx, tensor[idx].clone() if old is None else old))
            tensor[idx] = value
        else:       # the same values through index_select / index_fill_ / index_copy_ (no advanced-indexing pass)
            view, dim, at = line
            txn.log.append((tensor, idx, view.index_select(dim, at) if old is None else old))
            if isinstance(value, (bool, int, float)):
                view.index_fill_(dim, at, value)
            elif isinstance(value, torch.Tensor) and value.dtype == view.dtype \
                    and value.shape == view.shape[:dim] + at.shape + view.shape[dim + 1:]:
                view.index_copy_(dim, at, value)
            else:
                tensor[idx] = value
        self._wrote(tensor)

    def _wrote(self, tensor: torch.Tensor) -> None:
        """After a logged write of ``tensor``: count a change of the cell tables (``_layout_key``, the free count), or
        note that a freed flag may be set."""
        if tensor is self.cell_pos or tensor is self.cell_ref:
            self._cells_version += 1
            if tensor is self.cell_ref:
                self._ref_version += 1
        elif tensor is self._freed_cells or tensor is self._freed_rows:
            self._txn.freed = True

    def _log_content(self, cells: torch.Tensor) -> None:
        """Record every layer's content of ``cells`` (host int64; keys, K, V, unwritten flags) in the undo log."""
        if cells.numel() == 0:
            return
        txn = self._txn
        at = self._dev(cells)
        for name in ("keys", "k_cache", "v_cache"):
            t = getattr(self, name)
            if t is not None:
                txn.log.append((t, (slice(None), at), t[:, at].clone()))
        txn.log.append((self._unwritten, (slice(None), cells), self._unwritten[:, cells].clone()))

    def _savepoint(self) -> _Savepoint:
        txn = self._txn
        return _Savepoint(
            log_len=len(txn.log), runs=dict(self._runs), generation=list(self.slots._generation),
            live=list(self.slots._live), heads=(self._cell_head, self._row_head),
            tensors=self._undo_tensors(),
            new_cells=list(txn.new_cells), pending=[list(p) for p in txn.pending], evict=dict(txn.evict),
            dtype=self.dtype)

    def _undo_tensors(self) -> dict[str, torch.Tensor | None]:
        """The holder's state tensors by name (:data:`_STATE_TENSORS`, what a savepoint keeps), read from the
        module's buffers and the instance's dict (without ``Module.__getattr__``: four savepoints a decode step)."""
        buffers, plain = self._buffers, self.__dict__
        return {name: buffers[name] if name in buffers else plain.get(name) for name in _STATE_TENSORS}

    def _undo_log_after(self, log_len: int) -> None:
        """Undo the open transaction's log entries after its first ``log_len``, newest first, and drop them."""
        txn = self._txn
        for tensor, idx, old in reversed(txn.log[log_len:]):
            tensor[idx] = old
        del txn.log[log_len:]
        self._cells_version += 1          # (the undo wrote cell_pos / cell_ref directly)
        self._ref_version += 1

    def _restore(self, sp: _Savepoint) -> None:
        txn = self._txn
        self._undo_log_after(sp.log_len)
        self._runs = _RunTable(sp.runs)
        self.slots.load(sp.generation, sp.live)
        self._cell_head, self._row_head = sp.heads
        for name, t in sp.tensors.items():
            if getattr(self, name) is not t:
                setattr(self, name, t)
        self.dtype = sp.dtype
        txn.new_cells = list(sp.new_cells)
        txn.pending = [list(p) for p in sp.pending]
        txn.evict = dict(sp.evict)

    def _txn_begin(self) -> None:
        txn = _Txn()
        txn.pending = [[] for _ in range(self.num_layers)]
        self._txn = txn
        try:
            txn.base = self._savepoint()
        except BaseException:
            self._txn = None      # no transaction began: nothing may refuse work as "inside" one
            raise

    def _txn_prepare(self) -> None:
        """The fallible part of a commit, undoably: zero-fill cells never written for some layer and pool
        every pending group (a kernel may still refuse here; the block is then rolled back)."""
        txn = self._txn
        for slot in sorted(txn.evict):
            self._settle(slot)
        # One allocation's cells are distinct already (and only their set matters below): unique only merges.
        cells = (txn.new_cells[0] if len(txn.new_cells) == 1 else torch.unique(torch.cat(txn.new_cells))) \
            if txn.new_cells else None
        if cells is not None and self._chunk_written(txn):
            cells = None                    # (every flag of its cells is clear: nothing to fill, nothing to clear)
        if cells is not None:
            held = self.cell_ref.index_select(0, cells) > 0
            live = cells if bool(held.all()) else cells[held]     # (a mask gather only where some was released)
            unwritten = self._unwritten.index_select(1, live)     # [layers, cells]: one gather, one read for all layers
            if bool(unwritten.any()):
                # Every (layer, cell) pair in one index, whatever the layers (a layer whose writes wait, as the MTP
                # block's, costs no per-layer pass). No undo entry: a cell unwritten here was taken in this
                # transaction, so its old content is either a free cell's (no state: digest and save skip free
                # cells) or was logged when it was taken (_alloc_cells), as ``write`` relies on for the same cells.
                layers, at = unwritten.nonzero(as_tuple=True)
                miss = (self._dev(layers), self._dev(live[at]))
                for name in ("keys", "k_cache", "v_cache"):
                    t = getattr(self, name)
                    if t is not None:
                        t.index_put_(miss, self._zero_of(t))
        pooled: list[tuple[int, torch.Tensor]] = []
        for layer in range(self.num_layers):
            if txn.pending[layer]:
                rows = self._still_pending(layer)
                if rows.numel():
                    # No undo entry, as _resolve_pending: a pending row was given its group in this transaction
                    # (none is pending at its start), so its content is invisible until the commit clears the flag.
                    self.pooled[layer, self._dev(rows)] = self._pool(layer, self._pend_cells[rows],
                                                                     self._pend_pos[rows])
                    pooled.append((layer, rows))
        txn.prepared = (cells, pooled)

    def _chunk_written(self, txn: _Txn) -> bool:
        """Whether the transaction reserved one chunk, every layer wrote it (``write`` or ``settle_step_plan``: each
        left its written memo) and nothing those writes read has changed since (the memos still hold): its cells are
        then all referenced (each write checked the chunk under the same layout) and none is unwritten for any
        layer, what :meth:`_txn_prepare` would otherwise read back (a decode step's case)."""
        written = txn.written
        if len(txn.new_cells) != 1 or len(written) != self.num_layers:
            return False
        memo = written.get(0)
        chunk = None if memo is None else memo[0][0][0]
        if getattr(chunk, "_host_cells", None) is not txn.new_cells[0]:
            return False
        key = self._layout_key(chunk)
        return all(self._same_layout(written.get(layer), key) for layer in range(self.num_layers))

    def _zero_of(self, t: torch.Tensor) -> torch.Tensor:
        """A 0-dim zero of ``t``'s dtype on its device (made once per dtype and device: the fill's value)."""
        key = (t.dtype, t.device)
        zero = self._zeros.get(key)
        if zero is None:
            zero = self._zeros[key] = t.new_zeros(())
        return zero

    def _txn_commit(self) -> None:
        """Clear the transaction's flags. The undo log is kept until ``_txn_finish`` (every flag was set
        through it), so a rollback still undoes the whole block."""
        cells, pooled = self._txn.prepared
        if cells is not None:
            self._unwritten.index_fill_(1, cells, False)
        for layer, rows in pooled:
            self._pending[layer].index_fill_(0, rows, False)
        if self._txn.freed:           # (outside a transaction every flag is clear: set only inside one, through _set)
            self._freed_cells.zero_()
            self._freed_rows.zero_()

    def _txn_finish(self) -> None:
        """Drop the undo log (and what was derived from the transaction's chunks)."""
        txn, self._txn = self._txn, None
        del txn.log[:]
        self._chunk_checked = self._plan_rows_memo = None

    def _txn_rollback(self) -> None:
        txn = self._txn
        self._chunk_checked = self._plan_rows_memo = None
        try:
            if txn is not None and txn.base is not None:
                self._restore(txn.base)
        finally:
            self._txn = None

    def _txn_savepoint(self) -> _Savepoint:
        return self._savepoint()

    def _txn_restore(self, savepoint: _Savepoint) -> None:
        self._restore(savepoint)

    def _layout_key(self, chunk) -> tuple[tuple, tuple]:
        """What a reserved chunk's checks and plan rows read besides the chunk: the run table (its object and
        version) and the cells' positions and references (their tensors and how often they were written).
        Two equal keys (objects by identity, counts by value) mean nothing they read has changed."""
        runs = self._runs
        return (chunk, runs, self.cell_pos, self.cell_ref), (getattr(runs, "version", None), self._cells_version)

    def _same_layout(self, memo: tuple | None, key: tuple[tuple, tuple]) -> bool:
        """``memo`` (whose first item is a :meth:`_layout_key`) still holds: inside an open transaction only,
        the one place the memos live (they are dropped when it ends, so a chunk checked in one transaction is
        checked again, in full, by any later operation)."""
        if memo is None or self._txn is None or key[1][0] is None:
            return False
        objects, counts = memo[0]
        return counts == key[1] and all(map(operator.is_, objects, key[0]))

    def _op(self):
        """One atomic operation: its own transaction when none is open, else between savepoints."""
        return atomic(self)

    def _write_scope(self, layer: int):
        """:meth:`_op` for ``write`` of ``layer``: inside an open transaction a :class:`_WriteScope` (a write can change
        less than a whole savepoint keeps)."""
        return _WriteScope(self, layer) if self.in_transaction and self._txn is not None else atomic(self)

"""QSACache cell and group-row allocation with refcounts.

Cells: ``cell_pos`` Tensor[C] int64 (-1 when free), ``cell_ref`` Tensor[C] int32 (sequences referencing
the cell; shared after copy/fork). Group rows: ``group_ref`` Tensor[G] int32, the pooled row pool grows
on demand (derived state, never a reason for a CapacityError). Allocation prefers cells and rows whose
content no rollback may need back (``_freed_cells`` / ``_freed_rows`` Tensor bool), and records in the
undo log whatever it overwrites. Every one of these is host bookkeeping (CPU tensors whatever the
cache's device) and so is every cell or row index the allocator returns: it decides without waiting
for the device; only the logged content of device tensors (keys, K/V, pooled) takes an uploaded index.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import CapacityError
from .ops import qsa_claim_cells
from .runs import _Run

# The host tables _array may view (what the allocator and reserve read and write a few entries of).
_HOST_TABLES = ("cell_ref", "cell_pos", "group_ref", "_unwritten", "_freed_cells", "_freed_rows")


class _Allocator:
    """Cells and group rows of :class:`QSACache`: allocate, share, release (all through the undo log)."""

    def _array(self, table: torch.Tensor) -> np.ndarray:
        """The host bookkeeping tensor ``table`` as a numpy array over the same memory, kept while ``table`` is the
        same tensor object: a decode step's reads and writes of a few cells each cost a torch op otherwise (~2-5 us,
        more with the caches cold after a step's weights; a numpy element read ~0.3 us). Writes through it do not move
        the tensor's version counter: nothing reads the counters of these tables (their changes are counted by
        ``_cells_version`` / ``_ref_version``)."""
        arrays = self._arrays
        held = arrays.get(id(table))
        if held is not None and held[0] is table:
            return held[1]
        if len(arrays) > 2 * len(_HOST_TABLES):      # (tables replaced since, by a growth or a restore)
            arrays.clear()
        array = table.numpy()
        arrays[id(table)] = (table, array)
        return array

    def _head_free(self, ref: torch.Tensor, count: int, head: int, precious: torch.Tensor) -> bool:
        """Whether the ``count`` cells (rows) from ``head`` on are all free and none precious: what :meth:`_pick`
        would choose, found without scanning the whole table (a decode step allocates one cell per sequence, and the
        scan is O(capacity): 0.45 ms a step at 65536 cells)."""
        if self._alloc_generator is not None or head + count > ref.numel():
            return False
        if count == 1:          # (a decode's one cell: two element reads)
            return not (self._array(ref)[head] or self._array(precious)[head])
        return not (self._array(ref)[head:head + count].any() or self._array(precious)[head:head + count].any())

    def _at_head(self, ref: torch.Tensor, count: int, head: int, precious: torch.Tensor) -> torch.Tensor | None:
        """The ``count`` cells (rows) from ``head`` on where :meth:`_head_free`; None otherwise."""
        if not self._head_free(ref, count, head, precious):
            return None
        return torch.arange(head, head + count, dtype=torch.int64)

    def _claim_at_head(self, starts: list[int], counts: list[int], total: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A chunk's ``total`` > 0 cells taken at the head where :meth:`_head_free`, in one ``hebrus::qsa_claim_cells``
        call: referenced, given the rows' positions (row i: ``starts[i]`` on, ``counts[i]`` of them), flagged unwritten
        in every layer, each table's old values undo-logged by range (what :meth:`_alloc_cell_span` and ``reserve``'s
        writes of ``cell_pos`` and the flags leave, in one log entry per table). Returns (cells Tensor[T] int64,
        positions Tensor[T] int64, cu_seqlens Tensor[B + 1] int32), or None where the head's cells are not free."""
        head = self._cell_head
        if not self._head_free(self.cell_ref, total, head, self._freed_cells):
            return None
        free = self._free_count_known()
        cells, positions, cu, old_ref, old_pos, old_flags = qsa_claim_cells(
            self.cell_ref, self.cell_pos, self._unwritten, self._freed_cells, head, starts, counts)
        at = slice(head, head + total)
        self._txn.log += ((self.cell_ref, at, old_ref), (self.cell_pos, at, old_pos),
                          (self._unwritten, (slice(None), at), old_flags))
        self._wrote(self.cell_ref)
        self._wrote(self.cell_pos)
        self._keep_free_count(free, -total)         # (every taken cell was free)
        self._cell_head = (head + total) % self.capacity
        return cells, positions, cu

    def _set_cells(self, table: torch.Tensor, cells: torch.Tensor, span: int | None, value: Any,
                   along_cells: bool = False, old: torch.Tensor | None = None) -> None:
        """``_set`` of ``table`` at ``cells`` (along its second dimension, every layer's, where ``along_cells``). Where
        the cells are the range [span, span + len(cells)) (taken at the head), written and undo-logged by that range
        through the table's numpy view: the same values and undo. ``value``: a scalar or a tensor of len(cells);
        ``old``: as ``_set``'s (the entries' values now, known to the caller: logged without reading them)."""
        if span is None:
            self._set(table, (slice(None), cells) if along_cells else cells, value, old=old)
            return
        txn = self._txn
        assert txn is not None, "QSACache mutation outside a transaction"
        array = self._array(table)
        at = slice(span, span + len(cells))
        idx = (slice(None), at) if along_cells else at
        txn.log.append((table, idx, torch.from_numpy(array[idx].copy()) if old is None else old))
        array[idx] = value.numpy() if isinstance(value, torch.Tensor) else value
        self._wrote(table)

    def _pick(self, free: torch.Tensor, count: int, head: int, precious: torch.Tensor) -> torch.Tensor:
        idx = torch.nonzero(free).flatten()
        if self._alloc_generator is not None:
            perm = torch.randperm(idx.numel(), generator=self._alloc_generator)
            idx = idx[perm]
        else:
            idx = torch.cat((idx[idx >= head], idx[idx < head]))
        p = precious[idx]
        if bool(p.any()):  # prefer cells whose content nobody may need back on rollback
            idx = torch.cat((idx[~p], idx[p]))
        return idx[:count]

    def _alloc_cells(self, count: int) -> torch.Tensor:
        return self._alloc_cell_span(count)[0]

    def _alloc_cell_span(self, count: int) -> tuple[torch.Tensor, int | None]:
        """``count`` free cells, referenced once (undo-logged), and where they are the range [start, start + count)
        (taken at the head), that start: (cells Tensor[count] int64, start or None)."""
        if count == 0:
            return torch.empty(0, dtype=torch.int64), None
        start = self._cell_head
        chosen = self._at_head(self.cell_ref, count, start, self._freed_cells)
        span: int | None = start
        if chosen is None:
            free = self.cell_ref == 0
            nfree = int(free.sum())
            if nfree < count:
                raise CapacityError(f"QSACache: {count} cells needed but only {nfree} of {self.capacity} are free "
                                    f"(cell capacity exhausted)")
            chosen = self._pick(free, count, self._cell_head, self._freed_cells)
            freed = self._freed_cells[chosen]
            if bool(freed.any()):                   # (a mask gather only where some cell was freed in this block)
                self._log_content(chosen[freed])
            span, last = None, int(chosen[-1])
        else:               # (the head's cells, none freed in this block: _at_head checked; no read of chosen)
            last = start + count - 1
        self._cell_head = (last + 1) % self.capacity
        free = self._free_count_known()
        self._set_cells(self.cell_ref, chosen, span, 1)
        self._keep_free_count(free, -count)         # (every chosen cell was free)
        unwritten = bool(self._unwritten.index_select(1, chosen).any()) if span is None \
            else self._array(self._unwritten)[:, span:span + count].any()
        if unwritten:
            self._set_cells(self._unwritten, chosen, span, False, along_cells=True)
        return chosen, span

    def _grow_rows(self, needed: int) -> None:
        old = self.group_capacity
        new = max(2 * old, old + needed)

        def grown(t: torch.Tensor, dim: int, fill: Any) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = new - old
            pad = torch.full(shape, fill, dtype=t.dtype, device=t.device)
            return torch.cat((t, pad), dim=dim)

        self.pooled = grown(self.pooled, 1, 0)
        self.group_ref = grown(self.group_ref, 0, 0)
        self._pending = grown(self._pending, 1, False)
        self._pend_cells = grown(self._pend_cells, 0, 0)
        self._pend_pos = grown(self._pend_pos, 0, 0)
        self._freed_rows = grown(self._freed_rows, 0, False)

    def _alloc_rows(self, count: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=torch.int64)
        start = self._row_head
        chosen = self._at_head(self.group_ref, count, start, self._freed_rows)
        span: int | None = start
        if chosen is None:
            free = self.group_ref == 0
            nfree = int(free.sum())
            if nfree < count:
                self._grow_rows(count - nfree)
                free = self.group_ref == 0
            chosen = self._pick(free, count, self._row_head, self._freed_rows)
            pre = chosen[self._freed_rows[chosen]]
            if pre.numel():
                txn = self._txn
                at = self._dev(pre)
                txn.log.append((self.pooled, (slice(None), at), self.pooled[:, at].clone()))
                txn.log.append((self._pending, (slice(None), pre), self._pending[:, pre].clone()))
            span, last = None, int(chosen[-1])
        else:               # (the head's rows, none freed in this block: _at_head checked; no read of chosen)
            last = start + count - 1
        self._row_head = (last + 1) % self.group_capacity
        self._set_cells(self.group_ref, chosen, span, 1)
        return chosen

    def _release_cells(self, cells: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Drop one reference to each of ``cells`` (distinct), or ``counts[i]`` to ``cells[i]``."""
        if cells.numel() == 0:
            return
        free = self._free_count_known()
        self._set(self.cell_ref, cells, self.cell_ref[cells] - (1 if counts is None else counts.to(torch.int32)))
        dead = cells[self.cell_ref[cells] == 0]
        self._keep_free_count(free, dead.numel())   # (each cell was referenced: those at 0 now are the new free ones)
        if dead.numel():
            self._set(self.cell_pos, dead, -1)
            self._set(self._freed_cells, dead, True)
            self._set(self._unwritten, (slice(None), dead), False)

    def _release_rows(self, rows: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Drop one reference to each of ``rows`` (distinct), or ``counts[i]`` to ``rows[i]``."""
        if rows.numel() == 0:
            return
        self._set(self.group_ref, rows, self.group_ref[rows] - (1 if counts is None else counts.to(torch.int32)))
        dead = rows[self.group_ref[rows] == 0]
        if dead.numel():
            self._set(self._freed_rows, dead, True)
            self._set(self._pending, (slice(None), dead), False)

    def _release_run(self, run: _Run) -> None:
        self._release_rows(run.groups.tensor())
        self._release_cells(run.cells.tensor())

    def _share_run(self, run: _Run) -> None:
        cells, rows = run.cells.tensor(), run.groups.tensor()
        if cells.numel():
            free = self._free_count_known()
            self._set(self.cell_ref, cells, self.cell_ref[cells] + 1)
            self._keep_free_count(free, 0)          # (a run's cells are referenced already: none was free)
        if rows.numel():
            self._set(self.group_ref, rows, self.group_ref[rows] + 1)

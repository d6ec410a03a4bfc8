"""QSACache pooled groups: which rows hold which groups, pending groups, rebuilds at a new anchor.

Group g of a run anchored at p0 is the r cells of positions ``[p0 + r*g, p0 + r*g + r)``; its pooled key
(row ``pooled[l, row]``, Tensor[D] per layer) is ``hebrus::qsa_pool`` of those raw keys (``QSACache._pool``).
``_pend_cells`` Tensor[G, r] int64 and ``_pend_pos`` Tensor[G] int64 define each row's group; a group with
a cell not written yet for a layer is pending for that layer (``_pending`` Tensor[L, G] bool) and pooled
by the ``write`` that completes it. Those four are host bookkeeping: which groups are ready or pending
is decided on the host, and only the pooled rows (device) take an uploaded row index.
"""

from __future__ import annotations

import torch

from .runs import _Run, _Vec


class _Pooling:
    """Group rows of :class:`QSACache` runs: define, pool when written, rebuild."""

    def _define_groups(self, rows: torch.Tensor, gcells: torch.Tensor, gpos: torch.Tensor,
                       fresh: bool = False) -> None:
        """Give fresh rows their groups; pool at once for every layer whose cells are all written,
        leave the others pending for that layer. ``fresh``: every group holds a cell no layer has written
        (one of the chunk just reserved), so it is pending for every layer, decided without reading the flags."""
        if rows.numel() == 0:
            return
        self._set(self._pend_cells, rows, gcells)
        self._set(self._pend_pos, rows, gpos)
        txn = self._txn
        if fresh:
            self._set(self._pending, (slice(None), rows), True)
            for layer in range(self.num_layers):
                txn.pending[layer].append(rows)
            return
        for layer in range(self.num_layers):
            unwritten = self._unwritten[layer].index_select(0, gcells.flatten()).view(gcells.shape).any(dim=1)
            ready = ~unwritten
            if bool(ready.any()):
                r_rows = rows[ready]
                self.pooled[layer, self._dev(r_rows)] = self._pool(layer, gcells[ready], gpos[ready])
            if bool(unwritten.any()):
                p_rows = rows if bool(unwritten.all()) else rows[unwritten]   # (a decode's new group: every row)
                self._set(self._pending, (layer, p_rows), True)
                txn.pending[layer].append(p_rows)

    def _still_pending(self, layer: int) -> torch.Tensor:
        """The rows the open transaction lists for ``layer`` (``txn.pending``, not empty) that are still pending: host
        int64. (One list entry holds distinct rows already, and only their set matters; a boolean-mask gather, a
        nonzero pass, runs only where the mask drops some rows.)"""
        listed = self._txn.pending[layer]
        rows = listed[0] if len(listed) == 1 else torch.unique(torch.cat(listed))
        still = self._pending[layer].index_select(0, rows)
        return rows if bool(still.all()) else rows[still]

    def _resolve_pending(self, layer: int) -> None:
        """Pool this layer's pending groups whose cells are now all written."""
        txn = self._txn
        if not txn.pending[layer]:
            return
        rows = self._still_pending(layer)
        if rows.numel() == 0:
            txn.pending[layer] = []
            return
        group_cells = self._pend_cells.index_select(0, rows)                                       # [n, r]
        ready = ~self._unwritten[layer].index_select(0, group_cells.flatten()).view(group_cells.shape).any(dim=1)
        all_ready = bool(ready.all())
        r_rows = rows if all_ready else rows[ready]
        if r_rows.numel():
            pooled = self._pool(layer, group_cells if all_ready else self._pend_cells[r_rows],
                                self._pend_pos.index_select(0, r_rows))
            self.pooled[layer, self._dev(r_rows)] = pooled        # pending rows: content invisible, no undo needed
            self._set(self._pending, (layer, r_rows), False)
        txn.pending[layer] = [] if all_ready else [rows[~ready]]

    def _groups_for(self, run: _Run, g0: int, g1: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.compress_ratio
        gcells = run.cells.tensor()[r * g0:r * g1].reshape(-1, r)
        gpos = run.p0 + r * torch.arange(g0, g1, dtype=torch.int64)
        return gcells, gpos

    def _rebuild(self, run: _Run) -> _Run:
        """Fresh group rows for the whole run (anchored at its p0); the old rows are released."""
        self._release_rows(run.groups.tensor())
        g = run.n // self.compress_ratio
        rows = self._alloc_rows(g)
        gcells, gpos = self._groups_for(run, 0, g)
        self._define_groups(rows, gcells, gpos)
        return _Run(run.p0, run.n, run.cells, _Vec.of(rows))

    def _repool_touching(self, layer: int, cells: torch.Tensor) -> None:
        """After a rewrite of already written cells, re-pool (with undo) every live group of this layer
        that contains one of them."""
        mark = torch.zeros(self.capacity, dtype=torch.bool)
        mark[cells] = True
        rows = []
        for run in self._runs.values():
            g = run.groups.tensor()
            if g.numel():
                gc = run.cells.tensor()[:g.numel() * self.compress_ratio].reshape(-1, self.compress_ratio)
                rows.append(g[mark[gc].any(dim=1)])
        if not rows:
            return
        rows = torch.unique(torch.cat(rows))
        rows = rows[~self._pending[layer, rows]]
        if rows.numel():
            self._set(self.pooled, (layer, rows), self._pool(layer, self._pend_cells_of(rows), self._pend_pos[rows]))

    def _pend_cells_of(self, rows: torch.Tensor) -> torch.Tensor:
        return self._pend_cells[rows]

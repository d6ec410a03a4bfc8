"""QSACache runs and lifecycle: reserve/write (appends under the successor rule), window eviction,
remove/rewind/shift/copy/fork/keep, and the read accessors of one sequence's run.

A run is positions ``[p0, p0 + n)`` over cells (Tensor[n] int64, position order) with ``n // r`` group
rows (Tensor[n // r] int64) anchored at p0 (:class:`hebrus_torch.qsa.runs._Run`). Every operation builds
the new run first and publishes it only when it is one contiguous run (SPEC §3, §4). Runs, positions and
every check live on the host (the cache's bookkeeping); the device gets the chunk's cells and positions
uploaded once per ``reserve`` and the keys written into them.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from ..errors import HebrusError, HoleError, NonSuccessorError
from ..state.args import as_int
from ..state.handles import SeqHandle
from ..state.host_mirror import mirror
from .planning import ReservedChunk
from .runs import MAX_POSITION, _Run, _Vec, first_hole, window_start


_LISTED_POSITIONS = 64
"""Up to this many tokens, ``reserve`` lists the chunk's positions on the host (a decode step's rows); a longer
chunk computes them with tensor ops (faster than a Python list there). The same tensor either way."""


class _Lifecycle:
    """Per-sequence runs of :class:`QSACache` and the operations on them."""

    def _drop_prefix(self, run: _Run, k: int) -> _Run:
        """Remove the first k positions; keep the surviving groups when k is a multiple of r."""
        if k <= 0:
            return run
        r = self.compress_ratio
        if k >= run.n:
            self._release_run(run)
            return _Run(run.p0 + run.n, 0, _Vec.empty(), _Vec.empty())
        self._release_cells(run.cells.tensor()[:k])
        cells = run.cells.drop_front(k)
        if k % r == 0:
            self._release_rows(run.groups.tensor()[:k // r])
            return _Run(run.p0 + k, run.n - k, cells, run.groups.drop_front(k // r))
        moved = _Run(run.p0 + k, run.n - k, cells, run.groups)
        return self._rebuild(moved)

    def _suffix_cut(self, run: _Run, keep: int) -> tuple[_Run, torch.Tensor, torch.Tensor]:
        """The run's first ``keep`` (< n) positions (the anchor does not move: no rebuild), and the cells and
        group rows past them (still referenced: the caller releases them)."""
        if keep <= 0:
            return _Run(run.p0, 0, _Vec.empty(), _Vec.empty()), run.cells.tensor(), run.groups.tensor()
        g = keep // self.compress_ratio
        return (_Run(run.p0, keep, run.cells.truncate(keep), run.groups.truncate(g)), run.cells.tensor()[keep:],
                run.groups.tensor()[g:])

    def _drop_suffix(self, run: _Run, keep: int) -> _Run:
        """Keep the first ``keep`` positions (the anchor does not move: no rebuild)."""
        if keep >= run.n:
            return run
        cut, cells, rows = self._suffix_cut(run, keep)
        self._release_rows(rows)
        self._release_cells(cells)
        return cut

    def _start_empty_run_at(self, seq: SeqHandle, p: int) -> None:
        """Make ``p`` the default first position of an empty sequence (ModelCache: after a rewind to a
        PLE snapshot before the run's first position)."""
        with self._op():
            slot = self._slot(seq)
            self._settle(slot)
            run = self._runs[slot]
            if run.n:
                raise HebrusError(f"QSACache: {seq} is not empty (holds [{run.p0}, {run.p0 + run.n - 1}])")
            self._runs[slot] = _Run(as_int("QSACache: p", p), 0, run.cells, run.groups)

    def _window_start(self, p0: int, p: int) -> int:
        """The first visible position of a query at ``p`` over a run anchored at ``p0`` (SPEC §3): with a
        window, whole groups are evicted from the front until at most ``window`` positions remain."""
        return window_start(p0, p, self.window, self.compress_ratio)

    def _settle(self, slot: int) -> None:
        """Apply the window eviction a planned chunk left for this slot (see ``reserve``)."""
        txn = self._txn
        if txn is None or slot not in txn.evict:
            return
        target = txn.evict.pop(slot)
        run = self._runs[slot]
        self._runs[slot] = self._drop_prefix(run, target - run.p0)

    def _view(self, slot: int) -> _Run:
        """The slot's run as the cache holds it after its chunks: a pending window eviction applied to the
        view only (the cells stay held for the chunk's queries until the eviction is settled)."""
        run = self._runs[slot]
        txn = self._txn
        if txn is None or slot not in txn.evict:
            return run
        k = txn.evict[slot] - run.p0
        return _Run(run.p0 + k, run.n - k, run.cells.drop_front(k), run.groups.drop_front(k // self.compress_ratio))

    def new_sequence(self, handle: SeqHandle | None = None) -> SeqHandle:
        """Claim a slot for an empty sequence (run ``(0, 0)``). With ``handle``, adopt exactly that slot
        and generation (how a ModelCache makes its holders share handles)."""
        with self._op():
            handle = self.slots.claim(handle)
            self._runs[handle.slot] = _Run(0, 0, _Vec.empty(), _Vec.empty())
            return handle

    def free(self, seq: SeqHandle) -> None:
        """Release the sequence's cells and groups and its slot; ``seq`` is stale afterwards."""
        with self._op():
            slot = self._slot(seq)
            self._settle(slot)
            self._release_run(self._runs.pop(slot))
            self.slots.release(seq)

    def reset(self, seq: SeqHandle) -> SeqHandle:
        """Empty the sequence and bump its generation; returns the new handle (the old one is stale)."""
        with self._op():
            slot = self._slot(seq)
            self._settle(slot)
            self._release_run(self._runs[slot])
            self.slots.release(seq)
            handle = self.slots.claim(SeqHandle(slot, int(self.slots.generation[slot])))
            self._runs[slot] = _Run(0, 0, _Vec.empty(), _Vec.empty())
            return handle

    def run(self, seq: SeqHandle) -> tuple[int, int]:
        """``(p0, n)``: the sequence holds positions ``[p0, p0 + n)``. For an empty sequence p0 is the
        default first position of its next append."""
        r = self._view(self._slot(seq))
        return r.p0, r.n

    def cells_of(self, seq: SeqHandle) -> torch.Tensor:
        """Tensor[n] int64 (on the cache's device): the physical cell of each position of the run, in position
        order."""
        return self._dev(self._view(self._slot(seq)).cells.tensor().clone())

    def groups_of(self, seq: SeqHandle) -> torch.Tensor:
        """Tensor[n // r] int64 (on the cache's device): the pooled row (in ``pooled[layer]``) of each complete
        group, in order."""
        return self._dev(self._view(self._slot(seq)).groups.tensor().clone())

    def pooled_of(self, seq: SeqHandle, layer: int) -> torch.Tensor:
        """Tensor[n // r, D]: the pooled keys of the sequence's complete groups for ``layer``."""
        return self.pooled[self._layer(layer)][self._dev(self._view(self._slot(seq)).groups.tensor())].clone()

    def keys_of(self, seq: SeqHandle, layer: int) -> torch.Tensor:
        """Tensor[n, D]: the raw keys of the run for ``layer`` in position order."""
        return self.keys[self._layer(layer)][self._dev(self._view(self._slot(seq)).cells.tensor())].clone()

    def sequences(self) -> list[SeqHandle]:
        """Live handles, in slot order."""
        return self.slots.live_handles()

    def reserve(self, seqs: Sequence[SeqHandle], counts: Sequence[int],
                first_positions: Sequence[int | None] | None = None) -> ReservedChunk:
        """Take cells for a packed chunk: row i holds ``counts[i]`` new tokens of ``seqs[i]``.

        Row i's positions are ``frontier + 1, ...`` of its sequence; for an empty sequence they start at
        ``first_positions[i]`` when given (any position >= 0: left padding, an evicted prefix) else at
        its run's p0. A first position given for a non-empty sequence must be ``frontier + 1``
        (``NonSuccessorError``). With a ``window``, each query of the chunk sees the window of its own
        position (SPEC §3): positions no query of the chunk sees are evicted first (their cells can hold
        the new tokens); the rest of the eviction takes effect once the chunk's queries are planned (at
        commit, or at the next lifecycle operation on the sequence). ``CapacityError``
        when the pool has too few free cells. Keys are written per layer with :meth:`write` inside the
        same transaction (cells never written are zero at commit).

        Returns:
            ReservedChunk with cu_seqlens [B+1] int32, cells [T] int64 and positions [T] int64.
        """
        seqs = list(seqs)
        counts = [int(c) for c in counts]
        if len(counts) != len(seqs):
            raise HebrusError(f"QSACache.reserve: {len(seqs)} sequences but {len(counts)} counts")
        if first_positions is not None and len(first_positions) != len(seqs):
            raise HebrusError(f"QSACache.reserve: {len(seqs)} sequences but {len(first_positions)} first positions")
        with self._op():
            slots = [self._slot(s) for s in seqs]
            if len(set(slots)) != len(slots):
                raise HebrusError(f"QSACache.reserve: a sequence appears twice in one chunk: {seqs}")
            for slot in slots:
                self._settle(slot)
            r = self.compress_ratio
            evict: dict[int, int] = {}
            starts: list[int] = []
            anchors: list[int] = []
            runs: list[_Run] = []
            for i, (seq, slot, count) in enumerate(zip(seqs, slots, counts)):
                if count < 0:
                    raise HebrusError(f"QSACache.reserve: negative count {count} for {seq}")
                run = self._runs[slot]
                first = None if first_positions is None else first_positions[i]
                if first is not None and type(first) is not int:     # (the message only where it may be needed)
                    first = as_int(f"QSACache.reserve: the first position of {seq}", first)
                if run.n > 0:
                    start = run.p0 + run.n
                    if first is not None and count > 0 and int(first) != start:
                        raise NonSuccessorError(
                            f"QSACache.reserve: {seq} holds positions [{run.p0}, {start - 1}]; its next token must "
                            f"be at position {start} (frontier + 1), got positions [{int(first)}, "
                            f"{int(first) + count - 1}] (successor rule)")
                else:
                    start = run.p0 if first is None else int(first)
                    if start < 0:
                        raise HebrusError(f"QSACache.reserve: {seq} first position {start} is negative")
                if start + count - 1 > MAX_POSITION:
                    raise HebrusError(f"QSACache.reserve: {count} tokens of {seq} from position {start} would pass "
                                      f"the largest position {MAX_POSITION} (int64)")
                if self.window is not None and count > 0:
                    if count > self.window:
                        raise HebrusError(f"QSACache.reserve: {count} tokens for {seq} exceed the window of "
                                          f"{self.window} positions")
                    base = run.p0 if run.n else start
                    first_p0 = self._window_start(base, start)
                    last_p0 = self._window_start(base, start + count - 1)
                    if run.n and first_p0 > run.p0:        # no query of the chunk sees these
                        run = self._drop_prefix(run, first_p0 - run.p0)
                        self._runs[slot] = run
                    if last_p0 > first_p0:
                        evict[slot] = last_p0
                if run.n == 0 and count > 0:
                    run = _Run(start, 0, run.cells, run.groups)
                starts.append(start)
                runs.append(run)
                anchors.append(run.p0)
            total = sum(counts)
            bounds = [0]
            for c in counts:
                bounds.append(bounds[-1] + c)      # the row boundaries (cu_seqlens), from the host's counts
            # (a row of 0 tokens after a run that ends at the largest position starts past int64: any start will do)
            span = self._cell_head
            claimed = self._claim_at_head(starts if max(starts) <= MAX_POSITION else
                                          [min(x, MAX_POSITION) for x in starts], counts, total) if total else None
            if claimed is not None:
                cells, positions, cu32 = claimed
                self._txn.new_cells.append(cells)
            else:
                span = None
                cells, positions, cu32 = self._alloc_chunk_cells(starts, counts, bounds, total)
            # New complete groups of every row, allocated and defined in one go.
            new_runs: list[_Run] = []
            n_groups: list[int] = []
            one_row = len(slots) == 1
            for i, (slot, run) in enumerate(zip(slots, runs)):
                new_cells = cells if one_row else cells[bounds[i]:bounds[i + 1]]
                grown = _Run(run.p0, run.n + counts[i], run.cells.extend(new_cells), run.groups)
                new_runs.append(grown)
                n_groups.append(grown.n // r - run.n // r)
            new_groups = sum(n_groups)
            rows = self._alloc_rows(new_groups) if new_groups else None      # (most decode steps complete none)
            gcells, gpos, at = [], [], 0
            for i, (slot, run) in enumerate(zip(slots, new_runs)):
                if not n_groups[i]:             # (most decode tokens complete no group)
                    self._runs[slot] = run
                    continue
                g0 = run.n // r - n_groups[i]
                c, p = self._groups_for(run, g0, g0 + n_groups[i])
                gcells.append(c)
                gpos.append(p)
                self._runs[slot] = _Run(run.p0, run.n, run.cells, run.groups.extend(rows[at:at + n_groups[i]]))
                at += n_groups[i]
            if rows is not None:
                # (each new group ends at or past its run's old end: it holds a cell of this chunk)
                self._define_groups(rows, torch.cat(gcells), torch.cat(gpos), fresh=True)
            self._txn.evict.update(evict)
            dev_cells, dev_positions, dev_cu = self._upload(cells, positions, cu32)
            chunk = ReservedChunk(tuple(seqs), mirror(dev_cu, bounds), dev_cells, dev_positions, id(self),
                                  self._txn.token, tuple(starts), tuple(anchors), cells, positions, span)
            # Its cells hold its positions with a reference each, by construction: what _check_chunk reads, under
            # the layout key as it is now (any later change of runs or cells makes the first check read them).
            self._chunk_checked = (self._layout_key(chunk), tuple(slots))
            return chunk

    def _alloc_chunk_cells(self, starts: list[int], counts: list[int], bounds: list[int], total: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``reserve``'s cells where they are not taken at the head in one call (:meth:`_claim_at_head`): allocated
        anywhere, given the rows' positions and flagged unwritten in every layer (undo-logged). Returns (cells Tensor[T]
        int64, positions Tensor[T] int64, cu_seqlens Tensor[B + 1] int32)."""
        cells, span = self._alloc_cell_span(total)
        cu32 = torch.tensor(bounds, dtype=torch.int32)
        if total <= _LISTED_POSITIONS:
            # A decode's few tokens: positions listed on the host, one tensor instead of six ops (each row's
            # start + 0, 1, ...; a row with tokens ends by MAX_POSITION, checked above).
            positions = torch.tensor([s + j for s, c in zip(starts, counts) for j in range(c)], dtype=torch.int64)
        else:
            cu = torch.tensor(bounds, dtype=torch.int64)
            counts_t = torch.tensor(counts, dtype=torch.int64)
            # (a row of 0 tokens after a run that ends at the largest position starts past it: it gives
            # no position, so any start in range will do)
            starts_t = torch.tensor([min(x, MAX_POSITION) for x in starts], dtype=torch.int64)
            offs = self._arange(total) - torch.repeat_interleave(cu[:-1], counts_t, output_size=total)
            positions = torch.repeat_interleave(starts_t, counts_t, output_size=total) + offs
        if total:
            self._set_cells(self.cell_pos, cells, span, positions)
            self._set_cells(self._unwritten, cells, span, True, along_cells=True)
            self._txn.new_cells.append(cells)
        return cells, positions, cu32

    def held_chunk(self, seqs: Sequence[SeqHandle], positions: Sequence[Sequence[int]]) -> ReservedChunk:
        """A chunk over positions the sequences already hold (row i: ``positions[i]`` of ``seqs[i]``, in any order,
        each held by its run), for :meth:`write` to rewrite one layer's entries there inside the current
        transaction (the old content undo-logged, the groups that contain them re-pooled): what a layer whose
        writes were deferred (the MTP block's, ``engine/mtp.py``) catches up with. Nothing is reserved."""
        if self._txn is None:
            raise HebrusError("QSACache.held_chunk: only inside a transaction (the rewrite is undo-logged)")
        seqs = list(seqs)
        if len(positions) != len(seqs):
            raise HebrusError(f"QSACache.held_chunk: {len(seqs)} sequences but {len(positions)} position lists")
        cells, pos, bounds = [], [], [0]
        for seq, ps in zip(seqs, positions):
            run = self._view(self._slot(seq))
            ps_t = torch.tensor([as_int("QSACache.held_chunk: a position", p) for p in ps], dtype=torch.int64)
            if ps_t.numel() and (int(ps_t.min()) < run.p0 or int(ps_t.max()) >= run.p0 + run.n):
                raise HebrusError(f"QSACache.held_chunk: {seq} holds positions [{run.p0}, {run.p0 + run.n - 1}], "
                                  f"not all of {sorted(int(p) for p in ps)}")
            cells.append(run.cells.tensor()[ps_t - run.p0])
            pos.append(ps_t)
            bounds.append(bounds[-1] + ps_t.numel())
        if len({self._slot(s) for s in seqs}) != len(seqs):
            raise HebrusError(f"QSACache.held_chunk: a sequence appears twice in one chunk: {seqs}")
        cells_t = torch.cat(cells) if cells else torch.empty(0, dtype=torch.int64)
        pos_t = torch.cat(pos) if pos else torch.empty(0, dtype=torch.int64)
        cu = torch.tensor(bounds, dtype=torch.int32)
        dev_cells, dev_positions, dev_cu = self._upload(cells_t, pos_t, cu)
        return ReservedChunk(tuple(seqs), mirror(dev_cu, bounds), dev_cells, dev_positions, id(self), self._txn.token,
                             None, None, cells_t, pos_t)

    def _check_run(self, seq: SeqHandle, run: _Run, what: str) -> None:
        """HoleError unless the run's cells hold exactly positions p0, p0+1, ... (vectorised)."""
        cells = run.cells.tensor()
        got = self.cell_pos[cells]
        j = first_hole(got, run.p0)
        if j is not None:
            raise HoleError(f"QSACache.{what}: {seq} run [{run.p0}, {run.p0 + run.n - 1}] has cell {int(cells[j])} at "
                            f"position {int(got[j])} where {run.p0 + j} is required (a hole inside the run is not "
                            f"padding)")

    def _check_chunk(self, chunk: ReservedChunk, what: str) -> list[int]:
        if not isinstance(chunk, ReservedChunk) or chunk._owner != id(self):
            raise HebrusError(f"QSACache.{what}: the chunk was not reserved by this cache")
        key = self._layout_key(chunk)
        if self._same_layout(self._chunk_checked, key):
            return list(self._chunk_checked[1])      # checked since, and nothing it read has changed
        slots = [self._slot(h) for h in chunk.handles]
        if chunk.num_tokens:
            cells, positions = chunk._host()
            pos_now = self.cell_pos[cells]
            bad = (pos_now != positions) | (self.cell_ref[cells] <= 0)
            if bool(bad.any()):
                i = int(torch.nonzero(bad)[0])
                raise HoleError(f"QSACache.{what}: chunk token {i} (position {int(positions[i])}) is no longer "
                                f"held by cell {int(cells[i])} (cell holds {int(pos_now[i])}): the run changed "
                                f"since reserve")
        if self._txn is not None:
            self._chunk_checked = (key, tuple(slots))
        return slots

    def write(self, layer: int, chunk: ReservedChunk, keys: torch.Tensor, k: torch.Tensor | None = None,
              v: torch.Tensor | None = None) -> None:
        """Write one layer's raw indexer keys (and K/V when configured) into the chunk's cells and pool
        the groups this chunk completes for that layer (O(new groups) pooled work).

        Args:
            layer: cache layer index.
            chunk: a chunk reserved in the current transaction.
            keys: Tensor[T, D] raw indexer keys (projection output: no norm, no RoPE), packed like the chunk.
            k: Tensor[T, Hkv, Dh] main attention keys (required iff the cache keeps K/V).
            v: Tensor[T, Hkv, Dv] main attention values (required iff the cache keeps K/V).
        """
        layer = self._layer(layer)
        with self._write_scope(layer):
            if self._txn.token is not chunk._txn:
                raise HebrusError("QSACache.write: the chunk was reserved in another transaction (already "
                                  "committed or rolled back); reserve and write inside one transaction, or use append")
            self._check_chunk(chunk, "write")
            t = chunk.num_tokens
            if keys.shape != (t, self.head_dim):
                raise HebrusError(f"QSACache.write: keys must be [T={t}, D={self.head_dim}], got {list(keys.shape)}")
            if self.has_kv:
                if k is None or v is None:
                    raise HebrusError("QSACache.write: this cache keeps K/V planes; pass k and v")
                if k.shape != (t, self.kv_heads, self.kv_head_dim) or v.shape != (t, self.kv_heads, self.v_head_dim):
                    raise HebrusError(f"QSACache.write: k must be [{t}, {self.kv_heads}, {self.kv_head_dim}] and v "
                                      f"[{t}, {self.kv_heads}, {self.v_head_dim}], got {list(k.shape)} and "
                                      f"{list(v.shape)}")
            elif k is not None or v is not None:
                raise HebrusError("QSACache.write: this cache keeps no K/V planes (construct it with kv_heads)")
            if t == 0:
                return
            cells, dev_cells = chunk._host()[0], chunk.cells
            # A rewrite keeps the old content for undo. (A boolean-mask gather costs a nonzero pass, several times
            # an any(): it runs only where some cell was written before.) The flags read here (a copy) are also
            # the undo entry of clearing them below: nothing between changes them.
            unwritten_before = self._unwritten[layer].index_select(0, cells)
            written = cells[:0] if bool(unwritten_before.all()) else cells[~unwritten_before]
            if written.numel():
                txn = self._txn
                at = self._dev(written)
                for name in ("keys", "k_cache", "v_cache"):
                    tt = getattr(self, name)
                    if tt is not None:
                        txn.log.append((tt, (layer, at), tt[layer, at].clone()))
            device = self.device
            self.keys[layer].index_copy_(0, dev_cells, self._as_stored(keys, device))
            if self.has_kv:
                self.k_cache[layer].index_copy_(0, dev_cells, self._as_stored(k, device))
                self.v_cache[layer].index_copy_(0, dev_cells, self._as_stored(v, device))
            if written.numel():
                self._repool_touching(layer, written)
            self._set(self._unwritten, (layer, cells), False, old=unwritten_before)
            # (plan's "keys written" check of this chunk and layer needs no read while nothing it reads changes:
            # flags are set again only for cells taken afresh, or by an undo, both of which change the layout key)
            self._txn.written[layer] = (self._layout_key(chunk),)
            self._resolve_pending(layer)

    def _as_stored(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """x as the cache stores it: detached (the cache carries no autograd history: activations that require grad
        are stored detached), on the cache's device, in its dtype; x itself where it already is (no op)."""
        if x.requires_grad or x.dtype != self.dtype or x.device != device:
            return x.detach().to(device=device, dtype=self.dtype)
        return x

    def append(self, seq: SeqHandle, keys_per_layer: Sequence[torch.Tensor], first_position: int | None = None,
               k: Sequence[torch.Tensor] | None = None, v: Sequence[torch.Tensor] | None = None) -> ReservedChunk:
        """Reserve ``n`` positions for one sequence and write every layer: ``keys_per_layer[l]`` is
        Tensor[n, D]; ``k[l]`` / ``v[l]`` Tensor[n, Hkv, Dh] / [n, Hkv, Dv] when K/V are kept."""
        if len(keys_per_layer) != self.num_layers:
            raise HebrusError(f"QSACache.append: {len(keys_per_layer)} key tensors for {self.num_layers} layers")
        if self.has_kv and (k is None or v is None or len(k) != self.num_layers or len(v) != self.num_layers):
            raise HebrusError("QSACache.append: this cache keeps K/V planes; pass k and v for every layer")
        n = int(keys_per_layer[0].shape[0])
        with self._op():
            chunk = self.reserve([seq], [n], [first_position])
            for layer in range(self.num_layers):
                self.write(layer, chunk, keys_per_layer[layer], None if k is None else k[layer],
                           None if v is None else v[layer])
            return chunk

    def _range_of(self, seq: SeqHandle, p0: int, p1: int) -> tuple[int, _Run, tuple[int, float], tuple[int, int]]:
        """For ``remove`` / ``shift``: the sequence's slot and settled run, the range ``[a, b)`` asked (``p0 < 0``:
        from 0, ``p1 < 0``: to the end, b infinite) and the run's own ``[s, e)``."""
        slot = self._slot(seq)
        self._settle(slot)
        run = self._runs[slot]
        return slot, run, (max(p0, 0), math.inf if p1 < 0 else p1), (run.p0, run.p0 + run.n)

    def remove(self, seq: SeqHandle, p0: int, p1: int) -> None:
        """llama.cpp ``seq_rm``: drop positions ``[p0, p1)`` (``p0 < 0`` means 0, ``p1 < 0`` means "to the
        end"). Only a prefix, a suffix or the whole run may go; a middle range would leave a hole and
        raises ``HoleError``. Removing a prefix moves the anchor: groups are rebuilt (kept as they are
        when the prefix length is a multiple of r)."""
        p0, p1 = as_int("QSACache.remove: p0", p0), as_int("QSACache.remove: p1", p1)
        with self._op():
            slot, run, (a, b), (s, e) = self._range_of(seq, p0, p1)
            if run.n == 0 or b <= a or b <= s or a >= e:
                return
            if a <= s and b >= e:
                self._runs[slot] = self._drop_suffix(run, 0)
            elif a <= s:
                self._runs[slot] = self._drop_prefix(run, int(b) - s)
            elif b >= e:
                self._runs[slot] = self._drop_suffix(run, a - s)
            else:
                raise HoleError(f"QSACache.remove: {seq} holds positions [{s}, {e - 1}]; removing [{a}, {int(b) - 1}] "
                                f"would leave a hole inside the run (only a prefix, a suffix or all may be removed)")

    def rewind(self, seq: SeqHandle, p: int) -> None:
        """Drop positions >= p (``remove(seq, p, -1)``)."""
        self.remove(seq, max(as_int("QSACache.rewind: p", p), 0), -1)

    def rewind_many(self, positions: Mapping[SeqHandle, int]) -> None:
        """``rewind(seq, p)`` of every ``seq: p`` as one atomic operation, the cells and group rows they drop
        released together (one undo-logged update per table rather than per sequence: a speculative
        verification step cuts many rows back at once)."""
        with self._op():
            cells: list[torch.Tensor] = []
            rows: list[torch.Tensor] = []
            for seq, p in positions.items():
                p = max(as_int("QSACache.rewind: p", p), 0)
                slot = self._slot(seq)
                self._settle(slot)
                run = self._runs[slot]
                keep = max(p - run.p0, 0)
                if keep >= run.n:
                    continue
                self._runs[slot], dropped, dropped_rows = self._suffix_cut(run, keep)
                cells.append(dropped)
                rows.append(dropped_rows)
            if cells:       # (runs may share cells and rows after a fork: each holder drops its reference)
                self._release_rows(*torch.cat(rows).unique(return_counts=True))
                self._release_cells(*torch.cat(cells).unique(return_counts=True))

    def shift(self, seq: SeqHandle, p0: int, p1: int, delta: int) -> None:
        """llama.cpp ``seq_add``: add ``delta`` to positions in ``[p0, p1)`` (``p1 < 0``: to the end). Only a
        range covering the whole run keeps it contiguous; a partial shift raises ``HoleError``. The
        groups are re-roped, i.e. rebuilt at the new positions. Cells shared with another sequence are
        copied first (copy on write)."""
        p0, p1 = as_int("QSACache.shift: p0", p0), as_int("QSACache.shift: p1", p1)
        delta = as_int("QSACache.shift: delta", delta)
        with self._op():
            slot, run, (a, b), (s, e) = self._range_of(seq, p0, p1)
            if run.n == 0 or delta == 0 or b <= a or b <= s or a >= e:
                return
            if not (a <= s and b >= e):
                raise HoleError(f"QSACache.shift: {seq} holds positions [{s}, {e - 1}]; shifting only [{max(a, s)}, "
                                f"{min(int(b) if b != math.inf else e, e) - 1}] by {delta} would break the run "
                                f"(only whole-run shifts keep it contiguous)")
            if s + delta < 0:
                raise HebrusError(f"QSACache.shift: {seq} shifted by {delta} would start at position {s + delta} < 0")
            if e - 1 + delta > MAX_POSITION:
                raise HebrusError(f"QSACache.shift: {seq} shifted by {delta} would end at position {e - 1 + delta}, "
                                  f"past the largest position {MAX_POSITION} (int64)")
            self._check_run(seq, run, "shift")
            cells = run.cells.tensor()
            positions = s + delta + self._arange(run.n)
            if bool((self.cell_ref[cells] > 1).any()):
                fresh = self._alloc_cells(run.n)
                to, frm = self._dev(fresh), self._dev(cells)
                for name in ("keys", "k_cache", "v_cache"):
                    t = getattr(self, name)
                    if t is not None:
                        t[:, to] = t[:, frm]            # fresh cells: invisible until published below
                self._set(self._unwritten, (slice(None), fresh), self._unwritten[:, cells])
                self._txn.new_cells.append(fresh)
                self._release_cells(cells)
                cells_vec = _Vec.of(fresh)
                cells = fresh
            else:
                cells_vec = run.cells
            self._set(self.cell_pos, cells, positions)
            self._runs[slot] = self._rebuild(_Run(s + delta, run.n, cells_vec, run.groups))

    def copy(self, src: SeqHandle, dst: SeqHandle) -> None:
        """llama.cpp ``seq_cp``: ``dst``'s run becomes ``src``'s, sharing its cells and groups (each side
        gets fresh cells for what it appends later)."""
        with self._op():
            s_slot, d_slot = self._slot(src), self._slot(dst)
            if s_slot == d_slot:
                return
            self._settle(s_slot)
            self._settle(d_slot)
            self._release_run(self._runs[d_slot])
            run = self._runs[s_slot]
            self._share_run(run)
            self._runs[d_slot] = run

    def fork(self, src: SeqHandle) -> SeqHandle:
        """A new sequence sharing ``src``'s run."""
        with self._op():
            self._slot(src)
            handle = self.new_sequence()
            self.copy(src, handle)
            return handle

    def keep(self, seq: SeqHandle) -> None:
        """llama.cpp ``seq_keep``: free every other sequence."""
        with self._op():
            slot = self._slot(seq)
            for h in self.slots.live_handles():
                if h.slot != slot:
                    self.free(h)

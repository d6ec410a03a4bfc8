"""QSACache planning: the selection of one chunk's queries (``hebrus::qsa_select``) as cells to attend.

:class:`ReservedChunk` is what ``reserve`` returns (cells Tensor[T] int64, positions Tensor[T] int64,
cu_seqlens Tensor[B+1] int32); :class:`QSAPlan` is what ``plan`` returns (selected groups Tensor[T, top_k]
int32, token cells Tensor[T, top_k*r + r - 1] int32 and their positions int64, -1 padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import HebrusError, HoleError
from ..state.handles import SeqHandle
from ..state.host_mirror import host_ints
from .ops import qsa_plan_one_row, qsa_select, qsa_token_cells
from .runs import first_hole, window_starts

_ONE_ROW_TOKENS = 64
"""Up to this many tokens, a reserved one-row chunk's plan rows are built from host integers (``_plan_one_row``)."""


@dataclass(frozen=True, eq=False)
class ReservedChunk:
    """Cells reserved for one packed chunk (rows = sequences, in the order given to ``reserve``).

    Attributes:
        handles: the sequence of each row.
        cu_seqlens: Tensor[B+1] int32, row boundaries in the packed token order.
        cells: Tensor[T] int64, physical cell of each packed token.
        positions: Tensor[T] int64, logical position of each packed token.
    """

    handles: tuple[SeqHandle, ...]
    cu_seqlens: torch.Tensor
    cells: torch.Tensor
    positions: torch.Tensor
    _owner: int = field(default=0, repr=False, compare=False)
    _txn: object = field(default=None, repr=False, compare=False)
    _starts: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    _anchors: tuple[int, ...] | None = field(default=None, repr=False, compare=False)   # row p0 at reserve
    # The host copies of cells and positions (the same tensors on a CPU cache): what the checks read.
    _host_cells: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _host_positions: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # Where its cells are the range [_span, _span + T), taken at the allocator's head: the first (else None).
    _span: int | None = field(default=None, repr=False, compare=False)

    def _host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cells, positions) on the host: reserve's copies; a chunk built by hand has none and is read
        back from the device."""
        if self._host_cells is not None and self._host_positions is not None:
            return self._host_cells, self._host_positions
        return self.cells.cpu(), self.positions.cpu()

    @property
    def num_tokens(self) -> int:
        return int(self.cells.shape[0])

    @property
    def counts(self) -> list[int]:
        cu = host_ints(self.cu_seqlens)      # reserve's host copy: no read back
        return [b - a for a, b in zip(cu[:-1], cu[1:])]


@dataclass(frozen=True, eq=False)
class QSAPlan:
    """The selection of one chunk's queries for one layer (SPEC §3).

    Attributes:
        selected_groups: Tensor[T, top_k] int32, selected group indices within each query's sequence,
            ascending, -1 padded.
        q_groups: Tensor[T] int32, complete groups visible to each query.
        token_cells: Tensor[T, W] int32, W = top_k*r + r - 1: physical cells of the selected groups'
            tokens in ascending group (position) order, then the raw tail, then -1 padding.
        token_offsets: Tensor[T, W] int64, the offset of each entry of token_cells within its query's
            visible run (-1 pad).
        run_starts: Tensor[T] int64, the first position of each query's visible run.
        positions: Tensor[T] int64, the position of each query.
        q_rows: Tensor[T] int64, the chunk row (sequence) of each query.
        token_positions (property): Tensor[T, W] int64, the logical position of each entry of
            token_cells (-1 pad), computed when asked (the kernels never need it).
    """

    selected_groups: torch.Tensor
    q_groups: torch.Tensor
    token_cells: torch.Tensor
    token_offsets: torch.Tensor
    run_starts: torch.Tensor
    positions: torch.Tensor
    q_rows: torch.Tensor
    compress_ratio: int
    top_k: int

    @property
    def token_positions(self) -> torch.Tensor:
        return torch.where(self.token_offsets >= 0, self.token_offsets + self.run_starts[:, None], -1)

    @property
    def cells(self) -> torch.Tensor:
        """Alias of ``token_cells``."""
        return self.token_cells

    def mask(self, key_cells: torch.Tensor, key_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The selection as a boolean mask over a key layout.

        Args:
            key_cells: Tensor[Tk] int64, the physical cell held by each key column (-1 for a column
                that holds no cell, e.g. padding).
            key_rows: optional Tensor[Tk] int, the chunk row each key column belongs to. Give it when
                the layout packs several sequences that share cells (fork/copy): a query then matches
                only columns of its own row.

        Returns:
            Tensor[T, Tk] bool: ``mask[t, j]`` is True when query t attends to key column j.
        """
        key_cells = key_cells.to(device=self.token_cells.device, dtype=torch.int64)
        t, tk = self.token_cells.shape[0], key_cells.shape[0]
        if t == 0 or tk == 0:
            return torch.zeros((t, tk), dtype=torch.bool, device=key_cells.device)
        table = torch.sort(self.token_cells.to(torch.int64), dim=1).values.contiguous()       # [T, W]
        values = key_cells[None, :].expand(t, tk).contiguous()
        idx = torch.searchsorted(table, values).clamp(max=table.shape[1] - 1)
        hit = (table.gather(1, idx) == values) & (values >= 0)
        if key_rows is not None:
            key_rows = key_rows.to(device=hit.device, dtype=torch.int64)
            hit &= key_rows[None, :] == self.q_rows[:, None]
        return hit


@dataclass(frozen=True, eq=False)
class _PlanRows:
    """What :meth:`QSACache.plan` derives from a chunk and the runs, the same for every layer: the rows'
    visible groups (``flat``, host), the selection rows of ``qsa_select`` (``sel_groups``, ``sel_row``,
    ``q_groups``), the visible cells with a -1 appended (``cells32``) and per query its run (``nvis_q``,
    ``first``, ``q_p0``, ``q_rows``), uploaded; ``num_visible``: the visible cells' count (the -1's index)."""

    flat: torch.Tensor
    sel_groups: torch.Tensor
    sel_row: torch.Tensor
    q_groups: torch.Tensor
    cells32: torch.Tensor
    nvis_q: torch.Tensor
    first: torch.Tensor
    q_p0: torch.Tensor
    q_rows: torch.Tensor
    num_visible: int


@dataclass(eq=False)
class StepPlan:
    """What :meth:`QSACache.step_plan` decided once for every layer of a step: each indexed layer's write, pooling,
    selection and attention of the chunk as one ``hebrus::decode_attention_layer`` call (:meth:`layer_args`), its
    host bookkeeping then settled by :meth:`QSACache.settle_step_plan`.

    ``plan``: the op's plan list (cells [T] int64, the groups the chunk completes: pool_cells [P, r] int32,
    pool_pos [P] int64, pool_rows [P] int64, then ``qsa_select``'s and ``qsa_token_cells``' index tensors);
    ``sizes``: [top_k, r]; ``cells``: the chunk's cells (host int64); ``pool_rows``: the rows pooled, None when the
    chunk completes no group; ``key``: the chunk's layout key; ``fresh``: Tensor[T] bool of True, the flags' old
    value in the undo log; ``span``: where the chunk's cells are the range [span, span + T), its first (else None)."""

    cache: "_Planning"
    plan: list
    sizes: list
    cells: torch.Tensor
    pool_rows: torch.Tensor | None
    key: tuple
    fresh: torch.Tensor
    span: int | None = None

    def layer_args(self, layer: int) -> tuple[list, list, list, list, float]:
        """``(planes, qsa, plan, sizes, qsa_eps)`` of ``decode_attention_layer`` for cache layer ``layer``."""
        c = self.cache
        buffers = c._buffers
        keys, k, v, pooled, norm = c._layer_views.views((buffers["keys"], buffers["k_cache"], buffers["v_cache"],
                                                         buffers["pooled"], buffers["norm_weight"]), layer)
        return [keys, k, v, pooled], [c.cell_pos, norm, buffers["inv_freq"]], self.plan, self.sizes, c.eps


class _Planning:
    """``plan`` of :class:`QSACache`."""

    def step_plan(self, chunk: ReservedChunk, top_k: int) -> StepPlan | None:
        """The chunk's write, pooling and selection decided once for every layer, on the host, where each layer's
        :meth:`write` then :meth:`plan` would only write fresh cells, pool the same groups and select from the same
        rows: inside the transaction that reserved the chunk, on a CPU cache keeping K/V, every cell of the chunk
        not written yet for any layer, and every layer's pending groups the same ones (those the chunk completes:
        their other cells written). None otherwise (each layer then writes and plans on its own).

        Raises what :meth:`plan` raises for a chunk whose runs changed (its checks run here)."""
        txn = self._txn
        if txn is None or not isinstance(chunk, ReservedChunk) or chunk._txn is not txn.token \
                or chunk._owner != id(self) or top_k < 1 or not self.has_kv or self.device.type != "cpu":
            return None
        t = chunk.num_tokens
        pending = txn.pending
        listed = pending[0] if pending else []
        if t == 0 or len(listed) > 1 or any(len(p) != len(listed) or (listed and p[0] is not listed[0])
                                            for p in pending):
            return None
        slots = self._check_chunk(chunk, "plan")
        cells_h, pos_h = chunk._host()
        # The chunk's reserve (in this transaction) set its flags for every layer; only a write clears them, and
        # each write leaves its layer's memo in txn.written: with none, no read is needed.
        if txn.written and not bool(self._unwritten.index_select(1, cells_h).all()):
            return None
        r = self.compress_ratio
        if listed:
            pool_rows = listed[0]
            group_cells = self._pend_cells.index_select(0, pool_rows)                   # [P, r]
            flat = group_cells.flatten()
            outside = self._unwritten.index_select(1, flat) & ~torch.isin(flat, cells_h)
            if not bool(self._pending.index_select(1, pool_rows).all()) or bool(outside.any()):
                return None
            pool = [group_cells.to(torch.int32), self._pend_pos.index_select(0, pool_rows), pool_rows]
        else:
            pool_rows = None
            pool = self._no_pool.get(r)
            if pool is None:        # (inputs only: one empty set per ratio, never written)
                pool = self._no_pool[r] = [torch.empty((0, r), dtype=torch.int32), torch.empty(0, dtype=torch.int64),
                                           torch.empty(0, dtype=torch.int64)]
        key = self._layout_key(chunk)
        rows = self._memo_plan_rows(chunk, slots, cells_h, pos_h, key)
        plan = [chunk.cells, *pool, rows.sel_groups, rows.sel_row, rows.q_groups, rows.nvis_q, rows.first,
                rows.cells32]
        fresh = self._fresh_flags.get(t)
        if fresh is None:                   # (read only: the flags' old values in settle's undo entries)
            fresh = torch.ones(t, dtype=torch.bool)
            if t <= _ONE_ROW_TOKENS:        # (a decode's or a verify's few tokens: kept)
                self._fresh_flags[t] = fresh
        return StepPlan(self, plan, [int(top_k), r], cells_h, pool_rows, key, fresh, chunk._span)

    def settle_step_plan(self, step_plan: StepPlan, layers: Sequence[int]) -> None:
        """After ``decode_attention_layer`` wrote, pooled and attended each of ``layers`` over ``step_plan``: what
        :meth:`write` leaves in the host bookkeeping (the chunk's flags cleared, undo-logged; its pooled groups no
        longer pending; each layer's written memo). Where ``layers`` are every layer of the cache (a step whose
        indexed layers all ran as one call each), each flag table is cleared by one logged write for all of them."""
        txn = self._txn
        layers = list(layers)
        rows = step_plan.pool_rows
        # (the flags' old values are known: all set, as step_plan checked)
        if len(layers) > 1 and sorted(layers) == list(range(self.num_layers)):
            fresh = step_plan.fresh.expand(len(layers), -1)
            # (by range where the chunk's cells were taken at the head)
            self._set_cells(self._unwritten, step_plan.cells, step_plan.span, False, along_cells=True, old=fresh)
            if rows is not None:
                self._set(self._pending, (slice(None), rows), False, old=fresh.new_ones((len(layers), rows.numel())))
        else:
            for layer in layers:
                self._set(self._unwritten, (layer, step_plan.cells), False, old=step_plan.fresh)
                if rows is not None:
                    self._set(self._pending, (layer, rows), False, old=step_plan.fresh.new_ones(rows.shape))
        for layer in layers:
            txn.pending[layer] = []
            txn.written[layer] = (step_plan.key,)

    def plan(self, layer: int, chunk: ReservedChunk, q: torch.Tensor, top_k: int) -> QSAPlan:
        """Select, for each chunk token as a query at its position p, the top-k groups of the visible run
        ``[p0, p]`` and return them with the tail as physical cells (one ``qsa_select`` call).

        With a window, each query's visible run starts at its own position's window start (SPEC §3),
        and its groups (``q_groups``, ``selected_groups``) are anchored there.

        Args:
            layer: cache layer index (its keys for this chunk must have been written).
            chunk: the chunk whose tokens are the queries (reserved in this or an earlier transaction;
                the runs must still hold its tokens).
            q: Tensor[T, Hq, D] indexer queries, normed and roped by the model.
            top_k: groups to keep per query (budget / r).

        Raises:
            HoleError when a visible run is not contiguous (checked over every cell before selecting).
        """
        layer = self._layer(layer)
        if top_k < 1:
            raise HebrusError(f"QSACache.plan: top_k must be >= 1, got {top_k}")
        slots = self._check_chunk(chunk, "plan")
        t = chunk.num_tokens
        if q.dim() != 3 or q.shape[0] != t or q.shape[2] != self.head_dim:
            raise HebrusError(f"QSACache.plan: q must be [T={t}, Hq, D={self.head_dim}], got {list(q.shape)}")
        r = self.compress_ratio
        dev = self.device
        # Everything up to the selection is decided on the host bookkeeping (runs, cell_pos, the chunk's
        # host cells and positions); the kernels get their index tensors uploaded, none read back.
        cells_h, pos_h = chunk._host()
        written = self._txn is not None and self._same_layout(self._txn.written.get(layer), self._layout_key(chunk))
        if not written and bool(self._unwritten[layer, cells_h].any()):
            raise HebrusError(f"QSACache.plan: layer {layer} keys of this chunk are not written yet; call write first")
        if t == 0:
            self._visible_runs(chunk, slots)                 # (its checks)
            empty = torch.empty((0, top_k * r + r - 1), dtype=torch.int64, device=dev)
            none = torch.empty(0, dtype=torch.int64, device=dev)
            return QSAPlan(torch.empty((0, top_k), dtype=torch.int32, device=dev),
                           torch.empty(0, dtype=torch.int32, device=dev), empty.to(torch.int32), empty, none,
                           chunk.positions.clone(), none, r, int(top_k))
        rows = self._memo_plan_rows(chunk, slots, cells_h, pos_h, self._layout_key(chunk))
        # Inside a transaction a pending row is one of txn.pending[layer] (none is left pending at commit), so an
        # empty list means nothing of this layer is pending: the check needs no ops then.
        if rows.flat.numel() and (self._txn is None or self._txn.pending[layer]) \
                and bool(self._pending[layer].index_select(0, rows.flat).any()):
            raise HebrusError(f"QSACache.plan: some groups of layer {layer} are not pooled yet (keys of an "
                              f"earlier chunk not written for this layer)")
        selected = qsa_select(q, self.pooled[layer], rows.sel_groups, rows.sel_row, rows.q_groups, int(top_k))
        # Token offsets within the query's run (selected groups' tokens, then the tail, then -1 padding) and
        # the cells at them: one hebrus::qsa_token_cells dispatch.
        token_cells, offs = qsa_token_cells(selected, rows.nvis_q, rows.first, rows.cells32, r)
        return QSAPlan(selected_groups=selected, q_groups=rows.q_groups, token_cells=token_cells,
                       token_offsets=offs, run_starts=rows.q_p0, positions=chunk.positions.clone(),
                       q_rows=rows.q_rows, compress_ratio=r, top_k=int(top_k))

    def _memo_plan_rows(self, chunk: ReservedChunk, slots: list[int], cells_h: torch.Tensor, pos_h: torch.Tensor,
                        key: tuple) -> "_PlanRows":
        """:meth:`_plan_rows` of a chunk of T > 0 tokens, kept for the open transaction under the chunk's layout key:
        the rows of the selection do not depend on the layer (every layer of a step plans the same chunk over the
        same runs), so they are derived once, and again only if the runs or cells changed."""
        memo = self._plan_rows_memo
        if self._same_layout(memo, key):
            return memo[1]
        rows = self._plan_rows(chunk, slots, cells_h, pos_h)
        if self._txn is not None:
            self._plan_rows_memo = (key, rows)
        return rows

    def _visible_runs(self, chunk: ReservedChunk, slots: list[int]):
        """Per row of the chunk: its run's p0, the positions its queries see, its visible cells and groups
        (HoleError where the run no longer holds the chunk's positions)."""
        counts = chunk.counts
        starts = list(chunk._starts) if chunk._starts is not None else \
            [int(chunk._host()[1][o]) if c else 0 for o, c in zip(host_ints(chunk.cu_seqlens)[:-1], counts)]
        p0_list, nvis_list, vis, grp = [], [], [], []
        for i, slot in enumerate(slots):
            run = self._runs[slot]
            nvis = starts[i] + counts[i] - run.p0 if counts[i] else 0
            if counts[i] and (starts[i] < run.p0 or nvis > run.n):
                raise HoleError(f"QSACache.plan: {chunk.handles[i]} holds [{run.p0}, {run.p0 + run.n - 1}] but the "
                                f"chunk queries positions [{starts[i]}, {starts[i] + counts[i] - 1}]")
            p0_list.append(run.p0)
            nvis_list.append(nvis)
            vis.append(run.cells.tensor()[:nvis])
            grp.append(run.groups.tensor()[:nvis // self.compress_ratio])
        return counts, p0_list, nvis_list, vis, grp

    @staticmethod
    def _row_pairs(seq_groups: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection rows where every query's anchor is its row's p0: seq_groups Tensor[B, G] int64 of the rows
        with a query, and per query its selection row Tensor[T] int64 (what ``torch.unique(q_rows * (G + 1),
        return_inverse=True)`` gives, from the host counts)."""
        rows = [i for i, c in enumerate(counts) if c]
        sel_row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([counts[i] for i in rows]),
                                          output_size=sum(counts))
        if len(rows) == len(counts):
            return seq_groups, sel_row
        return seq_groups[torch.tensor(rows, dtype=torch.int64)], sel_row

    def _plan_one_row(self, start: int, t: int, p0: int, nvis: int, run_cells: torch.Tensor, groups: torch.Tensor,
                      cells_h: torch.Tensor) -> "_PlanRows | None":
        """:meth:`_plan_rows` of a reserved chunk of one row (positions ``start .. start + t - 1``, no window: one
        person's decode, a speculative verify) over its run's cells from ``p0`` (at least ``nvis``) and its visible
        groups: the checks and the tensors in one ``hebrus::qsa_plan_one_row`` call over the host tables (about 20
        torch ops otherwise). None where a check fails (the general path then names the hole)."""
        try:
            planned = qsa_plan_one_row(self.cell_pos, run_cells, groups, cells_h, p0, start, self.compress_ratio)
        except HoleError:
            return None
        sel_groups, sel_row, q_groups, cells32, nvis_q, first, q_p0, q_rows = self._upload(*planned)
        return _PlanRows(groups, sel_groups, sel_row, q_groups, cells32, nvis_q, first, q_p0, q_rows, nvis)

    def _plan_rows(self, chunk: ReservedChunk, slots: list[int], cells_h: torch.Tensor,
                   pos_h: torch.Tensor) -> "_PlanRows":
        """The layer-independent part of :meth:`plan` for a chunk of T > 0 tokens (its hole and window checks
        included): each query's visible run and the selection rows of ``qsa_select``, uploaded."""
        t = chunk.num_tokens
        r = self.compress_ratio
        b = len(slots)
        if b == 1 and self.window is None and chunk._starts is not None and t <= _ONE_ROW_TOKENS:
            run, start = self._runs[slots[0]], chunk._starts[0]
            nvis = start + t - run.p0
            if run.p0 <= start and nvis <= run.n:       # (else the general path names the hole)
                groups = run.groups.tensor()            # (the op reads the visible part of the run's tables)
                rows = self._plan_one_row(start, t, run.p0, nvis, run.cells.tensor(),
                                          groups if groups.numel() == nvis // r else groups[:nvis // r], cells_h)
                if rows is not None:
                    return rows
        counts, p0_list, nvis_list, vis, grp = self._visible_runs(chunk, slots)
        # Contiguity of every visible run, all rows at once.
        vis_cells = torch.cat(vis)
        nv = torch.tensor(nvis_list, dtype=torch.int64)
        p0s = torch.tensor(p0_list, dtype=torch.int64)
        base = torch.cumsum(nv, 0) - nv
        got = self.cell_pos[vis_cells]
        j = first_hole(got, p0s, nv)
        if j is not None:
            i = int(torch.searchsorted(base, torch.tensor([j]), right=True)[0]) - 1
            raise HoleError(f"QSACache.plan: {chunk.handles[i]} run starting at {p0_list[i]} has cell "
                            f"{int(vis_cells[j])} at position {int(got[j])} where {p0_list[i] + j - int(base[i])} is "
                            f"required (a hole inside the run is not padding)")
        counts_t = torch.tensor(counts, dtype=torch.int64)
        q_rows = torch.repeat_interleave(torch.arange(b), counts_t, output_size=t)
        q_base, row_p0 = base[q_rows], p0s[q_rows]
        if bool((vis_cells[q_base + pos_h - row_p0] != cells_h).any()):
            raise HoleError("QSACache.plan: the chunk's cells no longer match its sequences' runs")
        # Each query's own visible run [q_p0, p] (SPEC §3): with a window, whole groups past the row's
        # anchor are evicted until at most `window` positions remain.
        if self.window is None:
            q_p0 = row_p0
        else:
            anchors = list(chunk._anchors) if chunk._anchors is not None else p0_list
            anchor = torch.tensor(anchors, dtype=torch.int64)[q_rows]
            q_p0 = window_starts(anchor, pos_h, self.window, r)
            lost = (q_p0 < row_p0) | ((q_p0 - row_p0) % r != 0)
            if bool(lost.any()):
                j = int(torch.nonzero(lost)[0])
                i = int(q_rows[j])
                raise HoleError(f"QSACache.plan: the query of {chunk.handles[i]} at position "
                                f"{int(pos_h[j])} sees [{int(q_p0[j])}, {int(pos_h[j])}] but the "
                                f"run now starts at {p0_list[i]} (evicted or moved since reserve: plan a windowed "
                                f"chunk in the transaction that reserved it)")
        # Pooled rows of each row's visible groups, -1 past the end.
        gcounts = [g.numel() for g in grp]
        flat = torch.cat(grp)
        max_g = max(gcounts + [1])
        if b == 1 and flat.numel():
            seq_groups = flat.view(1, -1)       # one row (one person's decode): its groups are the table as they are
        else:
            seq_groups = torch.full((b, max_g), -1, dtype=torch.int64)
            if flat.numel():
                gc = torch.tensor(gcounts, dtype=torch.int64)
                g_rows = torch.repeat_interleave(torch.arange(b), gc, output_size=flat.numel())
                g_cols = self._arange(flat.numel()) - torch.repeat_interleave(torch.cumsum(gc, 0) - gc, gc,
                                                                              output_size=flat.numel())
                seq_groups[g_rows, g_cols] = flat
        # One selection row per (row, anchor) pair: the row's groups from the query's anchor on.
        if self.window is None:
            # Every query's anchor is its row's p0 (q_skip = 0): one pair per row with queries, in row order.
            sel_groups, sel_row = self._row_pairs(seq_groups, counts)
        else:
            q_skip = (q_p0 - row_p0) // r           # the row's groups before the query's anchor
            key = q_rows * (max_g + 1) + q_skip
            pairs, sel_row = torch.unique(key, return_inverse=True)
            cols = (pairs % (max_g + 1))[:, None] + self._arange(max_g)[None, :]
            sel_groups = torch.where(cols < max_g,
                                     seq_groups[(pairs // (max_g + 1))[:, None], cols.clamp(max=max_g - 1)], -1)
        nvis_q = pos_h - q_p0 + 1
        q_groups = (nvis_q // r).to(torch.int32)
        # Padding reads a -1 appended to the visible cells: one gather, no masking pass after it.
        cells32 = torch.cat((vis_cells.to(torch.int32), torch.full((1,), -1, dtype=torch.int32)))
        first = q_base + q_p0 - row_p0          # where each query's visible run starts in vis_cells
        sel_groups, sel_row, q_groups, cells32, nvis_q, first, q_p0, q_rows = self._upload(
            sel_groups.to(torch.int32), sel_row.to(torch.int32), q_groups, cells32, nvis_q, first, q_p0, q_rows)
        return _PlanRows(flat, sel_groups, sel_row, q_groups, cells32, nvis_q, first, q_p0, q_rows,
                         vis_cells.numel())

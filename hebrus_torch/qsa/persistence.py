"""QSACache saved state: one sequence as a blob (``save``/``restore``), the whole holder as a state dict
(validated completely before publishing), and ``digest``.

A sequence blob holds positions Tensor[n] int64, keys Tensor[L, n, D] and, with K/V, k Tensor[L, n, Hkv, Dh]
and v Tensor[L, n, Hkv, Dv]; pooled groups are derived state, rebuilt where they are published. The state
dict holds the holder's tensors (cell_pos, cell_ref, keys, k_cache, v_cache, pooled, group_ref,
generation, live, seq_p0, seq_n, seq_cells, seq_groups, norm_weight, inv_freq) plus JSON-like
``_extra_state`` with a sha256 of them; no pickle.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import HebrusError
from ..state import blob as _blob
from ..state.handles import SeqHandle, generation_problem
from ..state.protocol import StateDictProtocol
from .runs import MAX_POSITION, HoleInSavedStateError, _Run, _RunTable, _Vec, first_hole

_SEQ_KIND = "hebrus_torch.QSACache.sequence"
_HOLDER_FORMAT = "hebrus_torch.QSACache"
_HOLDER_VERSION = 1


class _Persistence(StateDictProtocol):
    """save/restore, state_dict/load_state_dict (the shared :class:`StateDictProtocol`) and digest of
    :class:`QSACache`."""

    _STATE_OWNER = "QSACache"

    def _check_clean(self, what: str, runs: Sequence[_Run]) -> None:
        if self._txn is None:
            return
        for run in runs:
            cells, rows = run.cells.tensor(), run.groups.tensor()
            if bool(self._unwritten[:, cells].any()) or bool(self._pending[:, rows].any()):
                raise HebrusError(f"QSACache.{what}: the transaction has cells not written yet; write every layer "
                                  f"of the reserved chunks first")

    def save(self, seq: SeqHandle) -> bytes:
        """The sequence's run, raw keys and K/V as a checksummed blob (no pickle). Pooled groups are
        derived state: ``restore`` rebuilds them."""
        return self.save_unpacked(seq).pack()

    def save_unpacked(self, seq: SeqHandle) -> _blob.Unpacked:
        """What :meth:`save` serialises, copied now (gathers of the run's cells); its ``pack()`` (the same
        bytes) may run on another thread."""
        run = self._view(self._slot(seq))
        self._check_clean("save", [run])
        self._check_run(seq, run, "save")
        cells = run.cells.tensor()
        at = self._dev(cells)
        tensors = {"positions": self._dev(self.cell_pos[cells]), "keys": self.keys[:, at]}
        if self.has_kv:
            tensors["k"] = self.k_cache[:, at]
            tensors["v"] = self.v_cache[:, at]
        meta = {"config": self._seq_config(), "p0": run.p0, "n": run.n}
        return _blob.Unpacked.of(_SEQ_KIND, meta, tensors)

    def restore(self, seq: SeqHandle | None, blob: bytes) -> SeqHandle:
        """Restore a blob of :meth:`save`. ``seq=None`` restores into a new sequence; a free slot's handle
        (e.g. one a ModelCache issued) is claimed via ``new_sequence(handle)``; a live handle has its run
        replaced. Everything (format, checksum, config, shapes, dtypes, contiguity) is validated
        before anything changes: ``CorruptStateError`` (``HoleInSavedStateError`` for a hole)."""
        return self._restore_decoded(seq, self._decode_seq(blob))

    def _decode_seq(self, blob: bytes) -> tuple[int, int, dict[str, torch.Tensor]]:
        """``(p0, n, tensors)`` of a blob of :meth:`save`, completely validated (CorruptStateError)."""
        meta, tensors = _blob.unpack(blob, _SEQ_KIND)
        kind = "QSACache.restore"
        _blob.expect(kind, _blob.same(meta.get("config"), self._seq_config()),
                     f"blob was saved by a cache configured {_blob.short(meta.get('config'))}, this one is "
                     f"{self._seq_config()}")
        p0, n = meta.get("p0"), meta.get("n")
        _blob.expect(kind, type(p0) is int and type(n) is int and p0 >= 0 and 0 <= n <= self.capacity
                     and p0 + n - 1 <= MAX_POSITION, f"bad run p0={_blob.short(p0)} n={_blob.short(n)} (integers, "
                                                     f"0 <= n <= capacity, p0 >= 0, p0 + n - 1 <= {MAX_POSITION})")
        want = {"positions": ((n,), torch.int64), "keys": ((self.num_layers, n, self.head_dim), self.dtype)}
        if self.has_kv:
            want["k"] = ((self.num_layers, n, self.kv_heads, self.kv_head_dim), self.dtype)
            want["v"] = ((self.num_layers, n, self.kv_heads, self.v_head_dim), self.dtype)
        _blob.expect(kind, set(tensors) == set(want), f"tensors {sorted(tensors)} != {sorted(want)}")
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            _blob.expect(kind, tuple(t.shape) == shape and t.dtype == dtype,
                         f"tensor {name} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
        j = first_hole(tensors["positions"], p0)
        if j is not None:
            raise HoleInSavedStateError(f"{kind}: saved run [{p0}, {p0 + n - 1}] holds position "
                                        f"{int(tensors['positions'][j])} where {p0 + j} is required (a hole)")
        return p0, n, tensors

    def _restore_decoded(self, seq: SeqHandle | None, decoded: tuple[int, int, dict[str, torch.Tensor]]) -> SeqHandle:
        """Publish what :meth:`_decode_seq` validated (see :meth:`restore`)."""
        p0, n, tensors = decoded
        expected = p0 + torch.arange(n, dtype=torch.int64)
        with self._op():
            if seq is None:
                seq = self.new_sequence()
            else:
                if not isinstance(seq, SeqHandle):
                    raise HebrusError(f"QSACache.restore: expected a SeqHandle or None, got {type(seq).__name__}")
                if 0 <= seq.slot < self.max_sequences and bool(self.slots.live[seq.slot]):
                    self._slot(seq)
                    self._settle(seq.slot)
                    run = self._runs[seq.slot]
                    self._release_run(run)
                    self._runs[seq.slot] = _Run(0, 0, _Vec.empty(), _Vec.empty())
                else:
                    seq = self.new_sequence(seq)
            cells = self._alloc_cells(n)
            dev = self.device
            if n:
                self._set(self.cell_pos, cells, expected)
                at = self._dev(cells)
                self.keys[:, at] = tensors["keys"].to(dev)
                if self.has_kv:
                    self.k_cache[:, at] = tensors["k"].to(dev)
                    self.v_cache[:, at] = tensors["v"].to(dev)
            run = _Run(p0, n, _Vec.of(cells), _Vec.empty())
            self._runs[seq.slot] = self._rebuild(run)
            return seq

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        if self._txn is not None:
            raise HebrusError("QSACache.state_dict cannot run inside a transaction (its changes are not published)")
        self._check_clean("state_dict", list(self._runs.values()))
        live_slots = sorted(self._runs)
        seq_p0 = torch.zeros(self.max_sequences, dtype=torch.int64)
        seq_n = torch.zeros(self.max_sequences, dtype=torch.int64)
        cells, rows = [], []
        for slot in live_slots:
            run = self._runs[slot]
            seq_p0[slot], seq_n[slot] = run.p0, run.n
            cells.append(run.cells.tensor().cpu())
            rows.append(run.groups.tensor().cpu())
        # (the bookkeeping entries on the cache's device, as they were when it lived there)
        free = self._dev(torch.nonzero(self.cell_ref == 0).flatten())
        keys = self.keys.clone()
        keys[:, free] = 0
        out = {"cell_pos": self._dev(self.cell_pos.clone()), "cell_ref": self._dev(self.cell_ref.clone()), "keys": keys}
        if self.has_kv:
            k, v = self.k_cache.clone(), self.v_cache.clone()
            k[:, free] = 0
            v[:, free] = 0
            out["k_cache"], out["v_cache"] = k, v
        pooled = self.pooled.clone()
        pooled[:, self._dev(torch.nonzero(self.group_ref == 0).flatten())] = 0
        out.update({
            "pooled": pooled, "group_ref": self._dev(self.group_ref.clone()),
            "generation": self.slots.generation.clone(), "live": self.slots.live.clone(),
            "seq_p0": seq_p0, "seq_n": seq_n,
            "seq_cells": torch.cat(cells) if cells else torch.empty(0, dtype=torch.int64),
            "seq_groups": torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64),
            "norm_weight": self.norm_weight.clone(), "inv_freq": self.inv_freq.clone(),
        })
        return out

    @staticmethod
    def _checksum(tensors: dict[str, torch.Tensor]) -> str:
        return _blob.digest_of(sorted(tensors.items()))

    def _extra_state_for(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"format": _HOLDER_FORMAT, "version": _HOLDER_VERSION, "config": self._config(),
                "heads": [self._cell_head, self._row_head], "checksum": self._checksum(tensors)}

    def _state_keys(self) -> set[str]:
        """The keys of this holder's state dict."""
        names = ["cell_pos", "cell_ref", "keys", "pooled", "group_ref", "generation", "live", "seq_p0",
                 "seq_n", "seq_cells", "seq_groups", "norm_weight", "inv_freq"]
        if self.has_kv:
            names += ["k_cache", "v_cache"]
        return {*names, "_extra_state"}

    def _validate_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The candidate of a state dict, completely validated (CorruptStateError otherwise)."""
        kind = "QSACache.load_state_dict"
        expect = _blob.expect
        extra = sd.get("_extra_state")
        expect(kind, isinstance(extra, dict), "missing or malformed _extra_state")
        expect(kind, _blob.same(extra.get("format"), _HOLDER_FORMAT)
               and _blob.same(extra.get("version"), _HOLDER_VERSION),
               f"format {_blob.short(extra.get('format'))} version {_blob.short(extra.get('version'))}, expected "
               f"{_HOLDER_FORMAT!r} version {_HOLDER_VERSION}")
        expect(kind, _blob.same(extra.get("config"), self._config()),
               f"state of a cache configured {_blob.short(extra.get('config'))}, this one is {self._config()}")
        names = self._state_keys() - {"_extra_state"}
        _blob.known_entries(kind, sd, self._state_keys(), strict=True)
        tensors = {k: v for k, v in sd.items() if k != "_extra_state"}
        expect(kind, set(tensors) == names, f"the state dict lacks {sorted(names - set(tensors))}")
        _blob.check_tensors(kind, tensors)
        C, L, D, S, r = self.capacity, self.num_layers, self.head_dim, self.max_sequences, self.compress_ratio
        gcap = tensors["group_ref"].shape[0] if tensors["group_ref"].dim() == 1 else -1
        want = {"cell_pos": ((C,), torch.int64), "cell_ref": ((C,), torch.int32), "keys": ((L, C, D), self.dtype),
                "pooled": ((L, gcap, D), self.dtype), "group_ref": ((gcap,), torch.int32),
                "generation": ((S,), torch.int64), "live": ((S,), torch.bool),
                "seq_p0": ((S,), torch.int64), "seq_n": ((S,), torch.int64),
                "norm_weight": (tuple(self.norm_weight.shape), torch.float32),
                "inv_freq": (tuple(self.inv_freq.shape), torch.float32)}
        if self.has_kv:
            want["k_cache"] = ((L, C, self.kv_heads, self.kv_head_dim), self.dtype)
            want["v_cache"] = ((L, C, self.kv_heads, self.v_head_dim), self.dtype)
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            expect(kind, tuple(t.shape) == shape and t.dtype == dtype,
                   f"{name} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
        expect(kind, gcap >= 1, "group_ref must have at least one row")
        for name in ("seq_cells", "seq_groups"):
            expect(kind, tensors[name].dim() == 1 and tensors[name].dtype == torch.int64, f"{name} must be int64 [N]")
        # Shapes, dtypes and devices are known good: now the bytes can be read.
        tensors = {k: v.detach().cpu() for k, v in tensors.items()}
        expect(kind, extra.get("checksum") == self._checksum(tensors), "checksum mismatch: modified or truncated")
        expect(kind, torch.equal(tensors["norm_weight"], self.norm_weight.cpu())
               and torch.equal(tensors["inv_freq"], self.inv_freq.cpu()),
               "norm_weight / inv_freq differ from this cache's (state of another model)")
        gen, live = tensors["generation"], tensors["live"]
        p0s, ns = tensors["seq_p0"], tensors["seq_n"]
        problem = generation_problem(gen.tolist(), live.tolist())
        expect(kind, problem is None, f"the slot table is invalid: {problem}")
        expect(kind, bool((p0s >= 0).all()) and bool((ns >= 0).all()), "negative p0 or n")
        expect(kind, bool((p0s - 1 <= MAX_POSITION - ns).all()), f"a run passes the largest position {MAX_POSITION}")
        expect(kind, bool((ns[~live] == 0).all()) and bool((p0s[~live] == 0).all()), "a free slot holds a run")
        live_slots = torch.nonzero(live).flatten().tolist()
        seq_cells, seq_groups = tensors["seq_cells"], tensors["seq_groups"]
        expect(kind, seq_cells.numel() == int(ns.sum()), f"seq_cells has {seq_cells.numel()} entries for "
                                                         f"{int(ns.sum())} positions")
        expect(kind, seq_groups.numel() == int((ns // r).sum()), "seq_groups does not match the runs' group counts")
        expect(kind, bool(((seq_cells >= 0) & (seq_cells < C)).all()), "seq_cells outside [0, capacity)")
        expect(kind, bool(((seq_groups >= 0) & (seq_groups < gcap)).all()), "seq_groups outside the row pool")
        cell_pos, cell_ref, group_ref = tensors["cell_pos"], tensors["cell_ref"], tensors["group_ref"]
        expect(kind, torch.equal(torch.bincount(seq_cells, minlength=C).to(torch.int32), cell_ref),
               "cell_ref does not count the runs' references")
        expect(kind, torch.equal(torch.bincount(seq_groups, minlength=gcap).to(torch.int32), group_ref),
               "group_ref does not count the runs' group rows")
        expect(kind, bool((cell_pos[cell_ref == 0] == -1).all()), "a free cell holds a position")
        runs: dict[int, tuple[int, int, torch.Tensor, torch.Tensor]] = {}
        row_def_cells = torch.full((gcap, r), -1, dtype=torch.int64)
        row_def_pos = torch.full((gcap,), -1, dtype=torch.int64)
        at_c = at_g = 0
        for slot in live_slots:
            p0, n = int(p0s[slot]), int(ns[slot])
            cells = seq_cells[at_c:at_c + n]
            rows = seq_groups[at_g:at_g + n // r]
            at_c += n
            at_g += n // r
            expect(kind, torch.unique(cells).numel() == n, f"slot {slot} lists a cell twice")
            # Rows shared with other slots are checked against their definition below; one slot naming the
            # same row for two of its groups would make both groups read one pooled key.
            expect(kind, torch.unique(rows).numel() == rows.numel(), f"slot {slot} lists a pooled group row twice")
            j = first_hole(cell_pos[cells], p0)
            if j is not None:
                raise HoleInSavedStateError(f"{kind}: slot {slot} run [{p0}, {p0 + n - 1}] has cell {int(cells[j])} "
                                            f"at position {int(cell_pos[cells[j]])} where {p0 + j} is required")
            g = n // r
            gcells = cells[:g * r].reshape(g, r)
            gpos = p0 + r * torch.arange(g)
            known = row_def_pos[rows] >= 0
            expect(kind, bool((row_def_cells[rows][known] == gcells[known]).all())
                   and bool((row_def_pos[rows][known] == gpos[known]).all()),
                   f"slot {slot} shares a group row with a sequence whose group differs")
            row_def_cells[rows] = gcells
            row_def_pos[rows] = gpos
            runs[slot] = (p0, n, cells, rows)
        heads = extra.get("heads", [0, 0])
        expect(kind, isinstance(heads, list) and len(heads) == 2 and all(type(h) is int for h in heads),
               f"bad allocation heads {_blob.short(heads)} (two integers)")
        return {"tensors": tensors, "gen": gen, "live": live, "runs": runs, "row_def_cells": row_def_cells,
                "row_def_pos": row_def_pos, "heads": heads, "gcap": gcap}

    def _prepare_candidate(self, cand: dict[str, Any]) -> dict[str, Any]:
        """The fallible part of publishing a validated candidate, before anything is published: every
        tensor on this cache's device, the runs, the slot table and the pooled groups re-derived."""
        tensors, gen, live, runs = cand["tensors"], cand["gen"], cand["live"], cand["runs"]
        row_def_cells, row_def_pos = cand["row_def_cells"], cand["row_def_pos"]
        heads, gcap = cand["heads"], cand["gcap"]
        L, C = self.num_layers, self.capacity
        dev = self.device

        def fresh(t: torch.Tensor, where: torch.device) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device=where).copy_(t)

        host = torch.device("cpu")
        new = {name: fresh(tensors[name], dev) for name in ("keys", "pooled")}
        new.update({name: fresh(tensors[name], host) for name in ("cell_pos", "cell_ref", "group_ref")})
        if self.has_kv:
            new["k_cache"], new["v_cache"] = fresh(tensors["k_cache"], dev), fresh(tensors["v_cache"], dev)
        new["_pending"] = torch.zeros((L, gcap), dtype=torch.bool)
        new["_pend_cells"] = row_def_cells.clamp(min=0)
        new["_pend_pos"] = row_def_pos.clamp(min=0)
        new["_freed_rows"] = torch.zeros(gcap, dtype=torch.bool)
        new["_unwritten"] = torch.zeros((L, C), dtype=torch.bool)
        new["_freed_cells"] = torch.zeros(C, dtype=torch.bool)
        used = torch.nonzero(row_def_pos >= 0).flatten()
        if used.numel():
            new["pooled"][:, self._dev(used)] = torch.stack(
                [self._pool(layer, new["_pend_cells"][used], new["_pend_pos"][used], keys=new["keys"][layer],
                            cell_pos=new["cell_pos"]) for layer in range(L)])
        return {"tensors": new, "generation": [int(g) for g in gen.tolist()], "live": [bool(v) for v in live.tolist()],
                "runs": {slot: _Run(p0, n, _Vec.of(cells), _Vec.of(rows))
                         for slot, (p0, n, cells, rows) in runs.items()},
                "heads": (heads[0] % C, heads[1] % gcap)}

    def _swap_state_dict(self, prepared: dict[str, Any]) -> None:
        """Publish what ``_prepare_candidate`` built: reference assignments only, nothing that can fail. Inside
        an open transaction its rollback restores the previous references (its savepoints keep them)."""
        for name, tensor in prepared["tensors"].items():
            setattr(self, name, tensor)
        self.slots.assign(prepared["generation"], prepared["live"])
        self._runs = _RunTable(prepared["runs"])
        self._cells_version += 1
        self._ref_version += 1
        self._cell_head, self._row_head = prepared["heads"]
        if self._txn is not None:   # what the open transaction staged refers to the state just replaced
            self._txn.new_cells = []
            self._txn.pending = [[] for _ in range(self.num_layers)]
            self._txn.evict = {}

    def _run_parts(self, tag: str, run: _Run) -> list[tuple[str, Any]]:
        cells, rows = run.cells.tensor(), run.groups.tensor()
        parts: list[tuple[str, Any]] = [(f"{tag}.run", [run.p0, run.n]), (f"{tag}.pos", self.cell_pos[cells])]
        at, unwritten = self._dev(cells), self._dev(self._unwritten[:, cells])
        for name in ("keys", "k_cache", "v_cache"):
            t = getattr(self, name)
            if t is not None:
                c = t[:, at]
                mask = unwritten.reshape(*unwritten.shape, *([1] * (c.dim() - 2)))
                parts.append((f"{tag}.{name}", torch.where(mask, torch.zeros((), dtype=c.dtype), c)))
        pooled = self.pooled[:, self._dev(rows)]
        pending = self._dev(self._pending[:, rows])[..., None]
        parts.append((f"{tag}.pooled", torch.where(pending, torch.zeros((), dtype=pooled.dtype), pooled)))
        return parts

    def digest(self, seq: SeqHandle | None = None) -> str:
        """sha256 of public state. ``seq=None``: the whole holder (config, every slot's generation and live
        flag, every live run with its positions, raw keys, K/V and pooled groups in logical order).
        With ``seq``: that sequence's content only (run, positions, keys, K/V, pooled), independent of
        its slot, so a restored copy digests like the original. Physical cell and row indices and free
        cells' contents are excluded."""
        if seq is not None:
            return _blob.digest_of(self._run_parts("seq", self._view(self._slot(seq))))
        parts: list[tuple[str, Any]] = [("config", self._config()), ("generation", self.slots.generation),
                                        ("live", self.slots.live)]
        for slot in sorted(self._runs):
            parts += self._run_parts(f"slot{slot}", self._view(slot))
        return _blob.digest_of(parts)

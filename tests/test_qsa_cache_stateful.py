"""Random lifecycle sequences on a QSACache against a plain-Python model of runs and shared cells.

After every step: the live handles, every run (p0, n), every raw key and the pooled groups (against a
full rebuild) match the model; failed operations leave ``digest()`` unchanged; save/restore round-trips.
"""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from hebrus_torch.errors import (CapacityError, HebrusError, HoleError, NonSuccessorError,  # noqa: E402
                                 StaleHandleError)
from hebrus_torch.state.transaction import transaction  # noqa: E402
from test_qsa_cache import D, L, R, check_invariants, make_cache  # noqa: E402

TABLE = torch.randn(1024, L, D, generator=torch.Generator().manual_seed(1234))   # keys of token id t


class _Seq:
    """Model of one run: p0, token ids (their keys) and cell ids (shared between runs after copy/fork)."""

    def __init__(self, p0: int = 0, ids: list[int] | None = None, cells: list[int] | None = None):
        self.p0, self.ids, self.cells = p0, list(ids or []), list(cells or [])

    def copy(self) -> "_Seq":
        return _Seq(self.p0, self.ids, self.cells)

    @property
    def n(self) -> int:
        return len(self.ids)


def window_start(p0: int, p: int, window: int) -> int:
    """The first position a query at p sees over a run anchored at p0 (SPEC §3)."""
    over = p - p0 + 1 - window
    return p0 if over <= 0 else p0 + R * -(-over // R)


class QSAMachine(RuleBasedStateMachine):
    CAPACITY = 40
    MAX_SEQUENCES = 4
    WINDOW: int | None = None

    def __init__(self):
        super().__init__()
        self.cache = make_cache(capacity=self.CAPACITY, max_sequences=self.MAX_SEQUENCES, window=self.WINDOW,
                                scrambled=7)
        self.model: dict = {}
        self.dead: list = []
        self.next_token = 0
        self.next_cell = 0

    # ---- model helpers -------------------------------------------------------------------------

    def used_cells(self, model=None) -> set[int]:
        model = self.model if model is None else model
        return {c for s in model.values() for c in s.cells}

    def free_cells(self, model=None) -> int:
        return self.CAPACITY - len(self.used_cells(model))

    def fresh_cells(self, k: int) -> list[int]:
        out = list(range(self.next_cell, self.next_cell + k))
        self.next_cell += k
        return out

    def fresh_tokens(self, k: int) -> list[int]:
        out = [(self.next_token + i) % TABLE.shape[0] for i in range(k)]
        self.next_token += k
        return out

    def expect_failure(self, exc, fn, *args):
        """fn(*args) must raise exc and leave the holder bitwise unchanged."""
        before = self.cache.digest()
        with pytest.raises(exc):
            fn(*args)
        assert self.cache.digest() == before
        event(f"refused with {exc.__name__}")

    def handles(self):
        return sorted(self.model)

    def model_reserve(self, model: dict, rows: list[tuple]) -> type | None:
        """Apply a reserve of rows ``(handle, ids, first)`` to ``model`` as the cache does (per row: successor
        rule, window limit, eviction; then one allocation for all rows). Returns the exception class the
        cache must raise (``model`` then holds junk), or None."""
        starts = []
        for h, ids, first in rows:
            s = model[h]
            k = len(ids)
            if s.n:
                start = s.p0 + s.n
                if first is not None and k and first != start:
                    return NonSuccessorError
            else:
                start = s.p0 if first is None else first
            if self.WINDOW is not None and k > self.WINDOW:
                return HebrusError
            t = s.copy()
            target = None
            if self.WINDOW is not None and k:
                # SPEC §3: each query sees the window of its own position; what no query of the chunk sees
                # goes before the allocation, the rest once the chunk is planned (at commit).
                base = s.p0 if s.n else start
                first_p0, target = window_start(base, start, self.WINDOW), window_start(base, start + k - 1,
                                                                                        self.WINDOW)
                if s.n:
                    evict = first_p0 - s.p0
                    t.p0, t.ids, t.cells = t.p0 + evict, t.ids[evict:], t.cells[evict:]
            model[h] = t
            starts.append((start, target))
        if self.free_cells(model) < sum(len(ids) for _, ids, _ in rows):
            return CapacityError
        for (h, ids, _), (start, target) in zip(rows, starts):
            t = model[h]
            if not t.ids:
                t.p0 = start
            t.ids = t.ids + ids
            t.cells = t.cells + self.fresh_cells(len(ids))
            if target is not None:
                evict = target - t.p0
                t.p0, t.ids, t.cells = target, t.ids[evict:], t.cells[evict:]
        return None

    # ---- rules ---------------------------------------------------------------------------------

    @initialize(first=st.integers(0, 6))
    def two_sequences(self, first):
        a, b = self.cache.new_sequence(), self.cache.new_sequence()
        self.model[a], self.model[b] = _Seq(), _Seq()
        ids = self.fresh_tokens(6)
        self.cache.append(a, [TABLE[ids, layer] for layer in range(L)], first)
        self.model[a] = _Seq(first, ids, self.fresh_cells(6))

    @rule()
    def new(self):
        event("rule new")
        if len(self.model) == self.MAX_SEQUENCES:
            self.expect_failure(CapacityError, self.cache.new_sequence)
            return
        h = self.cache.new_sequence()
        assert h not in self.model
        self.model[h] = _Seq()

    @precondition(lambda self: len(self.model) >= 2)       # keep one live sequence: most rules need one
    @rule(data=st.data())
    def free(self, data):
        event("rule free")
        h = data.draw(st.sampled_from(self.handles()))
        self.cache.free(h)
        del self.model[h]
        self.dead.append(h)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def reset(self, data):
        event("rule reset")
        h = data.draw(st.sampled_from(self.handles()))
        new = self.cache.reset(h)
        assert new.slot == h.slot and new.generation == h.generation + 1
        del self.model[h]
        self.model[new] = _Seq()
        self.dead.append(h)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), k=st.integers(1, 7), first=st.one_of(st.none(), st.integers(0, 12)))
    def append(self, data, k, first):
        event("rule append")
        h = data.draw(st.sampled_from(self.handles()))
        s = self.model[h]
        if first is not None and s.n and data.draw(st.booleans()):
            first = s.p0 + s.n                       # often the right successor
        ids = self.fresh_tokens(k)
        keys = [TABLE[ids, layer] for layer in range(L)]
        trial = dict(self.model)
        err = self.model_reserve(trial, [(h, ids, first)])
        if err is not None:
            self.expect_failure(err, self.cache.append, h, keys, first)
            return
        chunks = data.draw(st.sampled_from(["one", "split"]))
        if chunks == "split" and k > 1 and first is None and self.WINDOW is None:
            cut = data.draw(st.integers(1, k - 1))
            self.cache.append(h, [x[:cut] for x in keys])
            self.cache.append(h, [x[cut:] for x in keys])
        else:
            self.cache.append(h, keys, first)
        self.model = trial

    @precondition(lambda self: len(self.model) >= 1)
    @rule(data=st.data())
    def packed_append(self, data):
        """One reserve for several sequences, written layer by layer in one transaction."""
        event("rule packed_append")
        hs = data.draw(st.lists(st.sampled_from(self.handles()), min_size=1, max_size=3, unique=True))
        counts = [data.draw(st.integers(0, 5)) for _ in hs]
        trial = dict(self.model)
        ids_rows = [self.fresh_tokens(k) for k in counts]
        err = self.model_reserve(trial, [(h, ids, None) for h, ids in zip(hs, ids_rows)])
        keys = [torch.cat([TABLE[ids, layer] for ids in ids_rows]) for layer in range(L)]

        def go():
            with transaction(self.cache):
                chunk = self.cache.reserve(hs, counts)
                for layer in reversed(range(L)):
                    self.cache.write(layer, chunk, keys[layer])

        if err is not None:
            self.expect_failure(err, go)
            return
        go()
        self.model = trial

    def _range(self, data, s: _Seq) -> tuple[int, int]:
        a = data.draw(st.integers(-1, s.p0 + s.n + 2))
        b = data.draw(st.one_of(st.just(-1), st.integers(0, s.p0 + s.n + 3)))
        return a, b

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        event("rule remove")
        h = data.draw(st.sampled_from(self.handles()))
        s = self.model[h]
        kind = data.draw(st.sampled_from(["prefix", "suffix", "middle", "all", "random"]))
        start, end = s.p0, s.p0 + s.n
        if kind == "prefix":
            a, b = -1, data.draw(st.integers(start, end))
        elif kind == "suffix":
            a, b = data.draw(st.integers(start, end)), -1
        elif kind == "middle" and s.n >= 3:
            a = data.draw(st.integers(start + 1, end - 2))
            b = data.draw(st.integers(a + 1, end - 1))
        elif kind == "all":
            a, b = 0, -1
        else:
            a, b = self._range(data, s)
        lo, hi = max(a, 0), (math.inf if b < 0 else b)
        if s.n == 0 or hi <= lo or hi <= start or lo >= end:
            before = self.cache.digest()
            self.cache.remove(h, a, b)
            assert self.cache.digest() == before
            return
        if lo > start and hi < end:
            self.expect_failure(HoleError, self.cache.remove, h, a, b)
            return
        self.cache.remove(h, a, b)
        t = s.copy()
        if lo <= start and hi >= end:
            t.ids, t.cells = [], []
        elif lo <= start:
            k = int(hi) - start
            t.p0, t.ids, t.cells = int(hi), t.ids[k:], t.cells[k:]
        else:
            t.ids, t.cells = t.ids[:lo - start], t.cells[:lo - start]
        self.model[h] = t

    @precondition(lambda self: self.model)
    @rule(data=st.data(), p=st.integers(-2, 30))
    def rewind(self, data, p):
        event("rule rewind")
        h = data.draw(st.sampled_from(self.handles()))
        s = self.model[h]
        self.cache.rewind(h, p)
        t = s.copy()
        keep = min(max(p, 0) - s.p0, s.n)
        if keep <= 0:
            t.ids, t.cells = [], []
        else:
            t.ids, t.cells = t.ids[:keep], t.cells[:keep]
        self.model[h] = t

    @precondition(lambda self: self.model)
    @rule(data=st.data(), delta=st.integers(-6, 6))
    def shift(self, data, delta):
        event("rule shift")
        h = data.draw(st.sampled_from(self.handles()))
        s = self.model[h]
        start, end = s.p0, s.p0 + s.n
        if data.draw(st.booleans()):
            a, b = data.draw(st.integers(-1, start)), data.draw(st.sampled_from([-1, end, end + 3]))
        else:
            a, b = self._range(data, s)
        lo, hi = max(a, 0), (math.inf if b < 0 else b)
        if s.n == 0 or delta == 0 or hi <= lo or hi <= start or lo >= end:
            before = self.cache.digest()
            self.cache.shift(h, a, b, delta)
            assert self.cache.digest() == before
            return
        if not (lo <= start and hi >= end):
            self.expect_failure(HoleError, self.cache.shift, h, a, b, delta)
            return
        if start + delta < 0:
            self.expect_failure(HebrusError, self.cache.shift, h, a, b, delta)
            return
        others = {c for g, o in self.model.items() if g != h for c in o.cells}
        shared = bool(others & set(s.cells))
        t = s.copy()
        t.p0 = start + delta
        if shared:
            if self.free_cells() < s.n:              # fresh cells are taken before the old ones are let go
                self.expect_failure(CapacityError, self.cache.shift, h, a, b, delta)
                return
            t.cells = self.fresh_cells(s.n)
        self.cache.shift(h, a, b, delta)
        self.model[h] = t

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def copy(self, data):
        event("rule copy")
        src, dst = data.draw(st.lists(st.sampled_from(self.handles()), min_size=2, max_size=2, unique=True))
        self.cache.copy(src, dst)
        self.model[dst] = self.model[src].copy()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        event("rule fork")
        src = data.draw(st.sampled_from(self.handles()))
        if len(self.model) == self.MAX_SEQUENCES:
            self.expect_failure(CapacityError, self.cache.fork, src)
            return
        h = self.cache.fork(src)
        self.model[h] = self.model[src].copy()
        assert self.cache.digest(h) == self.cache.digest(src)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def keep(self, data):
        event("rule keep")
        h = data.draw(st.sampled_from(self.handles()))
        self.cache.keep(h)
        self.dead += [g for g in self.model if g != h]
        self.model = {h: self.model[h]}

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def save_restore(self, data):
        event("rule save_restore")
        h = data.draw(st.sampled_from(self.handles()))
        s = self.model[h]
        blob = self.cache.save(h)
        into_self = data.draw(st.booleans())
        if into_self:                                   # replace the live run with its own copy
            trial = dict(self.model)
            trial[h] = _Seq()
            if self.free_cells(trial) < s.n:
                self.expect_failure(CapacityError, self.cache.restore, h, blob)
                return
            digest = self.cache.digest(h)
            assert self.cache.restore(h, blob) == h
            assert self.cache.digest(h) == digest
            self.model[h] = _Seq(s.p0, s.ids, self.fresh_cells(s.n))
            return
        if len(self.model) == self.MAX_SEQUENCES or self.free_cells() < s.n:
            self.expect_failure(CapacityError, self.cache.restore, None, blob)
            return
        g = self.cache.restore(None, blob)
        assert self.cache.digest(g) == self.cache.digest(h)
        self.model[g] = _Seq(s.p0, s.ids, self.fresh_cells(s.n))

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def stale(self, data):
        event("rule stale")
        h = data.draw(st.sampled_from(self.dead))
        op = data.draw(st.sampled_from(["run", "append", "remove", "shift", "free", "reset", "save", "fork"]))
        one = [TABLE[:1, x] for x in range(L)]
        calls = {"run": lambda: self.cache.run(h), "append": lambda: self.cache.append(h, one),
                 "remove": lambda: self.cache.remove(h, 0, -1), "shift": lambda: self.cache.shift(h, 0, -1, 1),
                 "free": lambda: self.cache.free(h), "reset": lambda: self.cache.reset(h),
                 "save": lambda: self.cache.save(h), "fork": lambda: self.cache.fork(h)}
        self.expect_failure(StaleHandleError, calls[op])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def rolled_back_block(self, data):
        """Random work inside a transaction that then raises: nothing changes."""
        event("rule rolled_back_block")
        before = self.cache.digest()
        hs = self.handles()
        with pytest.raises(KeyError):
            with transaction(self.cache):
                for _ in range(data.draw(st.integers(1, 4))):
                    h = data.draw(st.sampled_from(hs))
                    what = data.draw(st.sampled_from(["append", "rewind", "prefix", "fork", "free", "shift"]))
                    try:
                        if what == "append":
                            k = data.draw(st.integers(1, 6))
                            self.cache.append(h, [TABLE[:k, x] for x in range(L)])
                        elif what == "rewind":
                            self.cache.rewind(h, data.draw(st.integers(0, 20)))
                        elif what == "prefix":
                            self.cache.remove(h, 0, data.draw(st.integers(0, 20)))
                        elif what == "fork":
                            self.cache.fork(h)
                        elif what == "free":
                            self.cache.free(h)
                        else:
                            self.cache.shift(h, 0, -1, data.draw(st.integers(0, 5)))
                    except HebrusError:
                        pass
                raise KeyError("roll back")
        assert self.cache.digest() == before

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def matches_model(self):
        cache = self.cache
        assert cache.sequences() == self.handles()
        for h, s in self.model.items():
            assert cache.run(h) == (s.p0, s.n), h
            if s.n:
                for layer in range(L):
                    assert torch.equal(cache.keys_of(h, layer), TABLE[s.ids, layer])
        assert int((cache.cell_ref > 0).sum()) == len(self.used_cells())
        check_invariants(cache)


class WindowMachine(QSAMachine):
    CAPACITY = 24
    WINDOW = 10


TestQSACacheStateful = QSAMachine.TestCase
TestQSACacheStateful.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestQSACacheWindowStateful = WindowMachine.TestCase
TestQSACacheWindowStateful.settings = settings(max_examples=50, stateful_step_count=30, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.filter_too_much])

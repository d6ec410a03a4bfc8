"""QSACache: contiguous runs, lifecycle, incremental pooling, planning, saved state, transactions."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hebrus_torch import reference
from hebrus_torch.errors import (CapacityError, CorruptStateError, HebrusError, HoleError, NonSuccessorError,
                                 StaleHandleError)
from hebrus_torch.qsa import ops
from hebrus_torch.model_cache import ModelCache
from hebrus_torch.qsa.cache import HoleInSavedStateError, QSACache, QSAPlan, ReservedChunk
from hebrus_torch.state import blob as blob_mod
from hebrus_torch.state.handles import MAX_GENERATION, SeqHandle
from hebrus_torch.state.transaction import Transactional, transaction

L, D, R, HQ = 2, 8, 4, 2


def make_cache(capacity: int = 64, *, num_layers: int = L, dtype=torch.float32, kv: bool = False,
               window: int | None = None, max_sequences: int = 8, seed: int = 0, scrambled: int | None = None,
               rot: int = 4, device: str = "cpu") -> QSACache:
    g = torch.Generator().manual_seed(seed)
    norm = 0.2 * torch.randn(num_layers, D, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))   # R = rot < D
    kw = dict(kv_heads=2, kv_head_dim=3, v_head_dim=5) if kv else {}
    cache = QSACache(capacity, num_layers=num_layers, head_dim=D, norm_weight=norm, eps=1e-6, inv_freq=inv_freq,
                     compress_ratio=R, max_sequences=max_sequences, dtype=dtype, window=window, device=device, **kw)
    if scrambled is not None:
        cache._alloc_generator = torch.Generator().manual_seed(scrambled)
    return cache


def stream(n: int, *, seed: int = 1, num_layers: int = L, dtype=torch.float32, kv: bool = False):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, D, generator=g).to(dtype) for _ in range(num_layers)]
    if not kv:
        return keys, None, None
    k = [torch.randn(n, 2, 3, generator=g).to(dtype) for _ in range(num_layers)]
    v = [torch.randn(n, 2, 5, generator=g).to(dtype) for _ in range(num_layers)]
    return keys, k, v


def queries(n: int, *, seed: int = 7, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HQ, D, generator=g).to(dtype)


def append_chunks(cache, seq, keys, sizes, *, first_position=None, k=None, v=None, q=None, top_k=2, layer=0):
    """Append ``keys`` in chunks of ``sizes``; returns the concatenated plans for ``layer`` when q is given."""
    at, plans = 0, []
    for i, size in enumerate(sizes):
        sl = slice(at, at + size)
        chunk = cache.append(seq, [kk[sl] for kk in keys], first_position=first_position if i == 0 else None,
                             k=None if k is None else [x[sl] for x in k], v=None if v is None else [x[sl] for x in v])
        if q is not None:
            plans.append(cache.plan(layer, chunk, q[sl], top_k))
        at += size
    assert at == keys[0].shape[0]
    return plans


def random_sizes(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while n:
        s = rng.randint(1, min(n, 7))
        sizes.append(s)
        n -= s
    return sizes


def rebuild(cache: QSACache, seq: SeqHandle, layer: int, *, use_reference: bool = False) -> torch.Tensor:
    """Pooled keys of the run rebuilt from scratch (all groups at once, anchored at p0)."""
    p0, n = cache.run(seq)
    g = n // R
    cells = cache.cells_of(seq)
    gcells = cells[:g * R].reshape(g, R).to(torch.int32)
    gpos = p0 + R * torch.arange(g, dtype=torch.int64, device=cells.device)
    fn = reference.qsa_pool if use_reference else ops.qsa_pool
    return fn(cache.keys[layer], cache.cell_pos.to(cache.device), gcells, gpos, cache.norm_weight[layer], cache.eps,
              cache.inv_freq)


def check_invariants(cache: QSACache) -> None:
    """Every run contiguous, pooled groups equal a full rebuild, refcounts and free cells consistent."""
    cell_count = torch.zeros(cache.capacity, dtype=torch.int32)
    row_count = torch.zeros(cache.group_capacity, dtype=torch.int32)
    for h in cache.sequences():
        p0, n = cache.run(h)
        cells = cache.cells_of(h)
        assert cells.numel() == n
        assert torch.equal(cache.cell_pos[cells.cpu()], p0 + torch.arange(n))     # (bookkeeping: on the host)
        cell_count[cells.cpu()] += 1
        row_count[cache.groups_of(h).cpu()] += 1
        for layer in range(cache.num_layers):
            got = cache.pooled_of(h, layer)
            assert torch.equal(got, rebuild(cache, h, layer)), (h, layer)
            torch.testing.assert_close(got, rebuild(cache, h, layer, use_reference=True), rtol=1e-5, atol=1e-5)
    assert cache.cell_pos.device.type == cache.cell_ref.device.type == cache.group_ref.device.type == "cpu"
    assert torch.equal(cell_count, cache.cell_ref)
    assert torch.equal(row_count, cache.group_ref)
    assert bool((cache.cell_pos[cache.cell_ref == 0] == -1).all())
    assert cache.free_cells() == int((cache.cell_ref == 0).sum())      # the count the allocator keeps


@pytest.fixture
def cache() -> QSACache:
    return make_cache()


# ------------------------------------------------------------------------------------------------
# Runs, left padding, pooling
# ------------------------------------------------------------------------------------------------

def test_new_sequence_is_empty(cache):
    a = cache.new_sequence()
    assert a == SeqHandle(0, 0)
    assert cache.run(a) == (0, 0)
    assert cache.cells_of(a).numel() == 0
    assert cache.groups_of(a).numel() == 0


def test_append_pools_groups_anchored_at_left_padding(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(11)
    chunk = cache.append(a, keys, first_position=5)
    assert isinstance(chunk, ReservedChunk)
    assert cache.run(a) == (5, 11)
    assert torch.equal(chunk.positions, torch.arange(5, 16))
    assert chunk.cu_seqlens.dtype == torch.int32 and chunk.cu_seqlens.tolist() == [0, 11]
    assert chunk.cells.dtype == torch.int64
    for layer in range(L):
        assert torch.equal(cache.keys_of(a, layer), keys[layer])
        # groups [5..8] and [9..12], roped at 5 and 9; tail 13..15
        expect = reference.qsa_pool(keys[layer], torch.arange(5, 16), torch.arange(8, dtype=torch.int32).reshape(2, 4),
                                    torch.tensor([5, 9]), cache.norm_weight[layer], cache.eps, cache.inv_freq)
        torch.testing.assert_close(cache.pooled_of(a, layer), expect, rtol=1e-6, atol=1e-6)
    check_invariants(cache)


def test_left_padding_anchor_differs_from_position_zero():
    keys, _, _ = stream(8)
    c1, c2 = make_cache(), make_cache()
    a1, a2 = c1.new_sequence(), c2.new_sequence()
    c1.append(a1, keys, first_position=0)
    c2.append(a2, keys, first_position=3)
    assert not torch.equal(c1.pooled_of(a1, 0), c2.pooled_of(a2, 0))       # roped at 3, 7 instead of 0, 4
    assert c1.digest(a1) != c2.digest(a2)


def test_successor_appends_continue_the_run(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(9)
    cache.append(a, [k[:3] for k in keys], first_position=2)
    cache.append(a, [k[3:4] for k in keys])                    # default: frontier + 1
    cache.append(a, [k[4:] for k in keys], first_position=6)  # explicit frontier + 1
    assert cache.run(a) == (2, 9)
    assert torch.equal(cache.keys_of(a, 1), keys[1])
    check_invariants(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_invariance_pooled_plans_and_digest(dtype):
    n = 37
    keys, _, _ = stream(n, dtype=dtype)
    q = queries(n, dtype=dtype)
    rng = random.Random(3)
    partitions = [[n], [1, 2, 1] * 9 + [1], random_sizes(n, rng), random_sizes(n, rng)]
    results = []
    for i, sizes in enumerate(partitions):
        for scrambled in (None, 11 + i):
            cache = make_cache(dtype=dtype, scrambled=scrambled)
            # fragment the pool first so that cells wrap and are reused out of order
            junk = cache.new_sequence()
            cache.append(junk, stream(13, seed=99, dtype=dtype)[0])
            cache.remove(junk, 0, 5)
            a = cache.new_sequence()
            cache.free(junk)
            plans = append_chunks(cache, a, keys, sizes, first_position=6, q=q, top_k=2)
            assert cache.run(a) == (6, n)
            check_invariants(cache)
            pooled = [cache.pooled_of(a, layer) for layer in range(L)]
            sel = torch.cat([p.selected_groups for p in plans])
            qg = torch.cat([p.q_groups for p in plans])
            tpos = torch.cat([p.token_positions for p in plans])
            # token_cells point at the right positions whatever the physical layout
            for p in plans:
                ok = p.token_cells >= 0
                assert torch.equal(cache.cell_pos[p.token_cells.long().clamp(min=0)][ok], p.token_positions[ok])
            results.append((pooled, sel, qg, tpos, cache.digest(a)))
    first = results[0]
    for other in results[1:]:
        for x, y in zip(first[0], other[0]):
            assert torch.equal(x, y)
        assert torch.equal(first[1], other[1])
        assert torch.equal(first[2], other[2])
        assert torch.equal(first[3], other[3])
        assert first[4] == other[4]


def test_pooled_work_is_incremental(monkeypatch, cache):
    """Each append pools only the groups it completes."""
    import hebrus_torch.qsa.cache as cache_mod
    calls = []
    real = cache_mod.qsa_pool

    def spy(keys, cell_pos, group_cells, group_pos, *rest):
        calls.append(group_cells.shape[0])
        return real(keys, cell_pos, group_cells, group_pos, *rest)

    monkeypatch.setattr(cache_mod, "qsa_pool", spy)
    a = cache.new_sequence()
    keys, _, _ = stream(40)
    for i in range(40):
        calls.clear()
        cache.append(a, [k[i:i + 1] for k in keys])
        assert sum(calls) == (L if (i + 1) % R == 0 else 0)
    check_invariants(cache)


def test_packed_reserve_isolation_and_plan():
    """Rows of one packed chunk are independent: same result as appending each sequence alone."""
    na, nb = 9, 14
    ka, _, _ = stream(na, seed=1)
    kb, _, _ = stream(nb, seed=2)
    qa, qb = queries(na, seed=3), queries(nb, seed=4)
    solo = make_cache()
    sa, sb = solo.new_sequence(), solo.new_sequence()
    pa = append_chunks(solo, sa, ka, [na], first_position=2, q=qa)[0]
    pb = append_chunks(solo, sb, kb, [nb], q=qb)[0]

    packed = make_cache(scrambled=5)
    a, b, c = packed.new_sequence(), packed.new_sequence(), packed.new_sequence()
    bystander = packed.digest(c)
    with transaction(packed):
        chunk = packed.reserve([b, a], [nb, na], [None, 2])
        for layer in range(L):
            packed.write(layer, chunk, torch.cat([kb[layer], ka[layer]]))
        plan = packed.plan(0, chunk, torch.cat([qb, qa]), 2)
    assert chunk.cu_seqlens.tolist() == [0, nb, nb + na]
    assert packed.digest(a) == solo.digest(sa) and packed.digest(b) == solo.digest(sb)
    assert packed.digest(c) == bystander
    assert torch.equal(plan.selected_groups, torch.cat([pb.selected_groups, pa.selected_groups]))
    assert torch.equal(plan.token_positions, torch.cat([pb.token_positions, pa.token_positions]))
    assert plan.q_rows.tolist() == [0] * nb + [1] * na
    check_invariants(packed)


def test_plan_small_runs_select_everything(cache):
    """While n <= budget + r - 1 every visible token is selected (budget = top_k * r)."""
    a = cache.new_sequence()
    n = 2 * R + R - 1
    keys, _, _ = stream(n)
    chunk = cache.append(a, keys, first_position=1)
    plan = cache.plan(1, chunk, queries(n), top_k=2)
    assert plan.token_cells.shape == (n, 2 * R + R - 1)
    for t in range(n):
        assert plan.token_positions[t, :t + 1].tolist() == list(range(1, t + 2))
        assert bool((plan.token_positions[t, t + 1:] == -1).all())
    assert torch.equal(plan.mask(cache.cells_of(a)), torch.ones(n, n, dtype=torch.bool).tril())


def test_plan_matches_reference_selection_and_mask(cache):
    a = cache.new_sequence()
    n = 30
    keys, _, _ = stream(n)
    q = queries(n)
    chunk = cache.append(a, keys, first_position=3)
    plan = cache.plan(1, chunk, q, top_k=2)
    pooled = rebuild(cache, a, 1, use_reference=True)
    p0 = 3
    cells = cache.cells_of(a)
    for t in range(n):
        ng = (t + 1) // R
        if ng:
            scores = torch.relu(q[t].float() @ pooled[:ng].float().T).sum(0) / D ** 0.5
            order = torch.sort(scores, descending=True, stable=True).indices[:2]
            expect = sorted(order.tolist())
        else:
            expect = []
        sel = [g for g in plan.selected_groups[t].tolist() if g >= 0]
        assert sel == expect
        want_pos = [p0 + R * g + j for g in expect for j in range(R)] + list(range(p0 + R * ng, p0 + t + 1))
        assert [p for p in plan.token_positions[t].tolist() if p >= 0] == want_pos
        assert plan.token_positions[t, len(want_pos):].eq(-1).all()
        assert [c for c in plan.token_cells[t].tolist() if c >= 0] == cells[[p - p0 for p in want_pos]].tolist()
    mask = plan.mask(cells)
    for t in range(n):
        assert set(torch.nonzero(mask[t]).flatten().tolist()) == {p - p0 for p in plan.token_positions[t].tolist()
                                                                  if p >= 0}
    # A layout with padding columns and a foreign row.
    layout = torch.cat([torch.tensor([-1, -1]), cells])
    rows = torch.tensor([0, 0] + [0] * n)
    assert torch.equal(plan.mask(layout, rows)[:, 2:], mask)
    assert not plan.mask(layout, rows)[:, :2].any()
    assert not plan.mask(layout, torch.ones_like(rows)).any()


PLAN_FIELDS = ("selected_groups", "q_groups", "token_cells", "token_offsets", "run_starts", "positions", "q_rows")


@pytest.mark.parametrize("scrambled", [None, 3])
def test_one_row_plan_rows_equal_the_general_path(monkeypatch, scrambled):
    """A reserved chunk of one row (one person's decode, a verify of a few tokens) plans from host integers
    (``_plan_one_row``): every field of its plan, dtypes included, equals the general path's, for chunks of 1 to 64
    tokens over runs anchored anywhere (left padding, a removed prefix that re-anchors), with other sequences in the
    pool."""
    from hebrus_torch.qsa import planning

    rng = random.Random(11)
    n = 150
    keys, _, _ = stream(n, seed=5)
    q = queries(n, seed=6)
    cache = make_cache(capacity=256, scrambled=scrambled)
    other = cache.new_sequence()
    cache.append(other, [k[:7] for k in keys])
    a = cache.new_sequence()
    at, first, removed = 0, 3, False
    while at < n:
        size = min(n - at, rng.choice([1, 1, 1, 2, 5, 64]))
        sl = slice(at, at + size)
        with transaction(cache):
            chunk = cache.reserve([a], [size], [first if at == 0 else None])
            for layer in range(L):
                cache.write(layer, chunk, keys[layer][sl])
            plans = {}
            for one_row in (64, 0):
                monkeypatch.setattr(planning, "_ONE_ROW_TOKENS", one_row)
                cache._plan_rows_memo = None
                plans[one_row] = [cache.plan(layer, chunk, q[sl], top_k=2) for layer in range(L)]
        for fast, general in zip(plans[64], plans[0]):
            for name in PLAN_FIELDS:
                x, y = getattr(fast, name), getattr(general, name)
                assert x.dtype == y.dtype and torch.equal(x, y), name
        at += size
        if not removed and at >= 40:
            p0 = cache.run(a)[0]
            cache.remove(a, p0, p0 + 2)             # a prefix of 2: re-anchored (not a multiple of r)
            removed = True
    assert removed and cache.run(a)[0] == first + 2


def test_one_row_plan_falls_back_to_name_a_hole(monkeypatch, cache):
    """Where the one-row path's check fails, the general path names the hole (the same error either way)."""
    a = cache.new_sequence()
    keys, _, _ = stream(9)
    with transaction(cache):
        chunk = cache.reserve([a], [9], [0])
        for layer in range(L):
            cache.write(layer, chunk, keys[layer])
        cache.cell_pos[chunk.cells[4]] = 77                 # a hole at position 4
        with pytest.raises(HoleError, match="at position 77 where 4 is required"):
            cache.plan(0, chunk, queries(9), 2)
        cache.cell_pos[chunk.cells[4]] = 4


def test_a_write_that_fails_after_its_flags_undoes_itself_inside_the_transaction(monkeypatch):
    """``write`` inside an open transaction is atomic through its light scope (``_WriteScope``): a write that fails
    after clearing its flags (here: pooling the groups it completes) leaves the flags, the pending rows, the written
    memo and the undo log as they were; written again, the transaction commits the state a clean run commits."""
    keys, _, _ = stream(8)
    clean, cache = make_cache(), make_cache()
    for c in (clean, cache):
        seq = c.new_sequence()
        with transaction(c):
            chunk = c.reserve([seq], [8], [0])          # two whole groups, pending for both layers
            c.write(0, chunk, keys[0])
            if c is cache:
                txn = c._txn
                log_len, written = len(txn.log), dict(txn.written)
                pending = [[p.clone() for p in rows] for rows in txn.pending]
                flags, pending_flags = c._unwritten.clone(), c._pending.clone()
                with monkeypatch.context() as m:
                    m.setattr(c, "_pool", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("pool failed")))
                    with pytest.raises(RuntimeError, match="pool failed"):
                        c.write(1, chunk, keys[1])
                assert len(txn.log) == log_len and txn.written == written
                assert torch.equal(c._unwritten, flags) and torch.equal(c._pending, pending_flags)
                assert [[p.tolist() for p in rows] for rows in txn.pending] == \
                    [[p.tolist() for p in rows] for rows in pending]
            c.write(1, chunk, keys[1])
        check_invariants(c)
    assert cache.digest() == clean.digest()


@pytest.mark.parametrize("form", ["index", "row", "column", "other"])
def test_set_through_index_ops_equals_the_indexing_assignment(cache, form):
    """The undo log's ``_set`` writes a 1-D index, ``(i, index)`` or ``(:, index)`` through index_select /
    index_fill_ / index_copy_ (any other index as ``tensor[idx] = value``): the tensor and the logged old values
    equal those of the indexing assignment, for scalars and tensors of values, and a rollback gives it back."""
    g = torch.Generator().manual_seed(2)
    at = torch.tensor([5, 1, 7], dtype=torch.int64)
    base = torch.randint(0, 9, (10,) if form == "index" else (3, 10), generator=g, dtype=torch.int32)
    idx = {"index": at, "row": (2, at), "column": (slice(None), at), "other": (slice(1, 3), at)}[form]
    shape = base[idx].shape
    for value in (4, torch.randint(0, 9, shape, generator=g, dtype=torch.int32), torch.tensor(6, dtype=torch.int32)):
        t = base.clone()
        want = base.clone()
        want[idx] = value
        with pytest.raises(RuntimeError, match="roll back"):
            with transaction(cache):
                cache._set(t, idx, value)
                logged = cache._txn.log[-1][2]
                assert torch.equal(t, want)
                assert logged.dtype == base.dtype and torch.equal(logged, base[idx])
                raise RuntimeError("roll back")
        assert torch.equal(t, base)


@pytest.mark.parametrize("kv", [False, True])
def test_savepoints_keep_the_holders_own_tensors(kv):
    """A savepoint reads the state tensors from the module's buffers and the instance's dict: the very objects
    ``getattr`` gives, K/V planes absent or not, also after the row pool grew (its tensors replaced)."""
    from hebrus_torch.qsa.transactions import _STATE_TENSORS

    cache = make_cache(kv=kv)
    a = cache.new_sequence()
    keys, k, v = stream(20, kv=kv)
    cache.append(a, keys, k=k, v=v)
    before = cache._undo_tensors()
    cache._grow_rows(4)
    for tensors in (before, cache._undo_tensors()):
        assert set(tensors) == set(_STATE_TENSORS)
    assert cache._undo_tensors()["pooled"] is cache.pooled and before["pooled"] is not cache.pooled
    assert all(t is getattr(cache, name) for name, t in cache._undo_tensors().items())


def test_the_free_cell_count_is_kept_through_appends_releases_shares_and_rollbacks():
    """``free_cells`` counts once, then the allocator keeps the count (cells taken, released, shared); any other write
    of the reference counts (a rollback's undo, a loaded state) makes the next call count again. It always equals a
    count of the table."""
    cache = make_cache(capacity=64)
    keys, _, _ = stream(30)
    a, b = cache.new_sequence(), cache.new_sequence()

    def agrees() -> None:
        assert cache.free_cells() == int((cache.cell_ref == 0).sum())

    agrees()
    cache.append(a, [k[:9] for k in keys])
    agrees()
    kept = cache._free_count
    assert kept is not None and kept[1] == cache._ref_version       # kept through the allocation, not recounted
    c = cache.fork(a)
    agrees()
    cache.append(b, [k[9:20] for k in keys])
    agrees()
    with pytest.raises(RuntimeError, match="undo"):
        with transaction(cache):
            cache.append(b, [k[20:30] for k in keys])
            agrees()
            raise RuntimeError("undo")
    agrees()
    cache.free(c)
    agrees()
    cache.rewind(a, 4)
    agrees()
    state = cache.state_dict()
    cache.load_state_dict(state)
    agrees()


def test_no_freed_flag_outlives_its_transaction():
    """Cells and rows freed in a transaction are preferred last by its later allocations (``_freed_cells`` /
    ``_freed_rows``); a commit clears the flags only where the transaction set one, so every way of setting them
    (a release, a rewind, a free inside a block, a rollback) must leave them all clear once it ends."""
    cache = make_cache(capacity=64)
    keys, _, _ = stream(40)
    a, b = cache.new_sequence(), cache.new_sequence()

    def clear() -> None:
        assert not cache.in_transaction
        assert not bool(cache._freed_cells.any()) and not bool(cache._freed_rows.any())

    cache.append(a, [k[:13] for k in keys])
    cache.append(b, [k[13:22] for k in keys])
    clear()
    cache.rewind(a, 5)                   # frees cells and whole groups' rows
    clear()
    with transaction(cache):
        cache.free(b)
        assert bool(cache._freed_cells.any()) and bool(cache._freed_rows.any())
        cache.append(a, [k[22:30] for k in keys])
    clear()
    with pytest.raises(RuntimeError, match="undo"):
        with transaction(cache):
            cache.rewind(a, 2)
            raise RuntimeError("undo")
    clear()


def test_plan_requires_written_layer(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(6)
    with transaction(cache):
        chunk = cache.reserve([a], [6])
        cache.write(0, chunk, keys[0])
        cache.plan(0, chunk, queries(6), 2)
        with pytest.raises(HebrusError, match="not written"):
            cache.plan(1, chunk, queries(6), 2)
        cache.write(1, chunk, keys[1])
        cache.plan(1, chunk, queries(6), 2)


def test_layers_written_in_any_order_across_chunks(cache):
    """Groups completed by a later chunk are pooled once all their cells are written, whatever the order."""
    keys, _, _ = stream(10)
    ref = make_cache()
    r = ref.new_sequence()
    ref.append(r, keys)
    a = cache.new_sequence()
    with transaction(cache):
        c1 = cache.reserve([a], [3])
        c2 = cache.reserve([a], [7])           # continues from the staged frontier
        assert c2.positions.tolist() == list(range(3, 10))
        cache.write(0, c2, keys[0][3:])
        cache.write(1, c1, keys[1][:3])
        cache.write(1, c2, keys[1][3:])
        cache.write(0, c1, keys[0][:3])
    assert cache.digest(a) == ref.digest(r)
    check_invariants(cache)


def test_unwritten_layer_is_zero_at_commit(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(8)
    with transaction(cache):
        chunk = cache.reserve([a], [8])
        cache.write(0, chunk, keys[0])
    assert torch.equal(cache.keys_of(a, 1), torch.zeros(8, D))
    check_invariants(cache)


def test_only_a_chunk_every_layer_wrote_since_commits_without_reading_its_flags():
    """The commit reads the new cells' references and unwritten flags back unless the transaction reserved one chunk
    that every layer then wrote, nothing those writes read changed since (a decode step): one layer short, or a
    reference written after the writes, and it reads them."""
    cache = make_cache(capacity=32)
    a, b = cache.new_sequence(), cache.new_sequence()
    keys, _, _ = stream(12)
    cache.append(b, [k[:4] for k in keys])
    with transaction(cache):
        chunk = cache.reserve([a], [5])
        cache.write(0, chunk, keys[0][4:9])
        assert not cache._chunk_written(cache._txn)          # layer 1 still unwritten
        cache.write(1, chunk, keys[1][4:9])
        assert cache._chunk_written(cache._txn)
        cache.free(b)                                        # references written since
        assert not cache._chunk_written(cache._txn)
    for layer in range(L):
        assert torch.equal(cache.keys_of(a, layer), keys[layer][4:9])
    check_invariants(cache)


def test_cells_left_unwritten_are_zero_at_commit_in_every_layer_and_plane():
    """A commit zero-fills every (layer, cell) pair never written, in keys and K/V (one indexed fill for all layers,
    as the MTP block's deferred layer leaves one per decode step), on cells that held another sequence's content;
    written pairs keep theirs, and the groups pool as a rebuild does."""
    cache = make_cache(16, num_layers=3, kv=True)
    old = cache.new_sequence()
    ko, k_o, v_o = stream(12, seed=4, num_layers=3, kv=True)
    cache.append(old, ko, k=k_o, v=v_o)
    cache.free(old)                                     # (its cells keep its content: the next run reuses them)
    a = cache.new_sequence()
    keys, k, v = stream(10, seed=5, num_layers=3, kv=True)
    with transaction(cache):
        first = cache.reserve([a], [4])
        rest = cache.reserve([a], [6])
        for layer in range(3):
            cache.write(layer, first, keys[layer][:4], k[layer][:4], v[layer][:4])
        cache.write(1, rest, keys[1][4:], k[1][4:], v[1][4:])
    cells = cache.cells_of(a)
    assert set(cells.tolist()) & set(range(12))          # (some cells held the freed sequence's content)
    for layer in range(3):
        n = 10 if layer == 1 else 4
        for plane, want in ((cache.keys, keys), (cache.k_cache, k), (cache.v_cache, v)):
            got = plane[layer, cells]
            assert torch.equal(got[:n], want[layer][:n]), (layer, plane.shape)
            assert not got[n:].any(), (layer, plane.shape)
    check_invariants(cache)


def test_a_commit_refused_after_the_zero_fill_gives_freed_cells_their_content_back(monkeypatch):
    """The zero-fill of cells left unwritten keeps no undo entry of its own: a cell freed and taken again in the
    same block had its content logged when it was taken, so a commit refused after the fill (the pooling kernel
    here) restores it bitwise, and the holder digests as before."""
    cache = make_cache(8, kv=True)
    b = cache.new_sequence()
    kb, k_b, v_b = stream(8, seed=6, kv=True)
    cache.append(b, kb, k=k_b, v=v_b)
    a = cache.new_sequence()
    before = cache.digest()
    keys, k, v = stream(6, seed=7, kv=True)

    def refuse(*args, **kwargs):
        raise HoleError("injected refusal of the pooling kernel")

    with pytest.raises(HoleError, match="injected"):
        with transaction(cache):
            cache.free(b)
            chunk = cache.reserve([a], [6])               # (b's cells: no other is free)
            cache.write(0, chunk, keys[0], k[0], v[0])    # layer 1 left unwritten: zero-filled, its groups pending
            monkeypatch.setattr(cache, "_pool", refuse)
    assert cache.digest() == before
    assert torch.equal(cache.keys_of(b, 1), kb[1])
    cells = cache.cells_of(b)
    assert torch.equal(cache.k_cache[1, cells], k_b[1]) and torch.equal(cache.v_cache[1, cells], v_b[1])
    monkeypatch.undo()
    check_invariants(cache)


def test_rewrite_replaces_keys_and_groups(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(8)
    other, _, _ = stream(8, seed=5)
    with transaction(cache):
        chunk = cache.reserve([a], [8])
        for layer in range(L):
            cache.write(layer, chunk, keys[layer])
        cache.write(0, chunk, other[0])
    assert torch.equal(cache.keys_of(a, 0), other[0])
    check_invariants(cache)


def test_a_held_chunk_writes_a_layer_late_as_if_written_with_its_chunks(cache):
    """``held_chunk``: a layer left unwritten (zero) at some committed positions is written there later, at any
    positions the runs hold, in one chunk over several sequences: then the cache digests as one whose every chunk
    wrote that layer; a rollback undoes it; outside a transaction, or at positions not held, it is refused."""
    a, b = cache.new_sequence(), cache.new_sequence()
    ka, _, _ = stream(9, seed=2)
    kb, _, _ = stream(6, seed=3)
    ref = make_cache()
    ra, rb = ref.new_sequence(), ref.new_sequence()
    append_chunks(ref, ra, ka, [9])
    append_chunks(ref, rb, kb, [6])
    with transaction(cache):             # layer 1 written for a's first 5 positions and nowhere else
        chunk = cache.reserve([a, b], [9, 6])
        cache.write(0, chunk, torch.cat([ka[0], kb[0]]))
        cache.write(1, cache.held_chunk([a], [range(5)]), ka[1][:5])
    assert torch.equal(cache.keys_of(a, 1)[5:], torch.zeros(4, D)) and cache.digest() != ref.digest()
    with pytest.raises(HebrusError, match="inside a transaction"):
        cache.held_chunk([a], [[5]])
    before = cache.digest()
    with pytest.raises(HebrusError, match="holds positions"):
        with transaction(cache):
            cache.held_chunk([b], [[2, 6]])
    with pytest.raises(RuntimeError, match="undone"):
        with transaction(cache):
            cache.write(1, cache.held_chunk([b, a], [[5, 0, 3, 1, 2, 4], [8, 6, 5, 7]]),
                        torch.cat([kb[1][[5, 0, 3, 1, 2, 4]], ka[1][[8, 6, 5, 7]]]))
            raise RuntimeError("undone")
    assert cache.digest() == before
    with transaction(cache):
        cache.write(1, cache.held_chunk([b, a], [[5, 0, 3, 1, 2, 4], [8, 6, 5, 7]]),
                    torch.cat([kb[1][[5, 0, 3, 1, 2, 4]], ka[1][[8, 6, 5, 7]]]))
    assert cache.digest() == ref.digest()
    check_invariants(cache)


def test_write_needs_the_reserving_transaction(cache):
    a = cache.new_sequence()
    chunk = cache.reserve([a], [4])          # autocommitted: zeros
    before = cache.digest()
    with pytest.raises(HebrusError, match="another transaction"):
        cache.write(0, chunk, torch.ones(4, D))
    assert cache.digest() == before
    cache.plan(0, chunk, queries(4), 2)      # planning a committed chunk is fine


def test_cache_keeps_no_autograd_history():
    cache = make_cache(kv=True)
    a = cache.new_sequence()
    keys, k, v = stream(9, kv=True)
    cache.append(a, [t.requires_grad_() for t in keys], k=[t.requires_grad_() for t in k],
                 v=[t.requires_grad_() for t in v])
    for name in ("keys", "k_cache", "v_cache", "pooled"):
        assert not getattr(cache, name).requires_grad, name
    check_invariants(cache)


def test_write_and_plan_shape_errors_change_nothing(cache):
    a = cache.new_sequence()
    with transaction(cache):
        chunk = cache.reserve([a], [4])
        d = cache.digest()
        with pytest.raises(HebrusError):
            cache.write(0, chunk, torch.ones(3, D))
        with pytest.raises(HebrusError):
            cache.write(0, chunk, torch.ones(4, D), k=torch.ones(4, 2, 3))
        with pytest.raises(HebrusError):
            cache.write(5, chunk, torch.ones(4, D))
        assert cache.digest() == d
        cache.write(0, chunk, torch.ones(4, D))
        cache.write(1, chunk, torch.ones(4, D))
        with pytest.raises(HebrusError):
            cache.plan(0, chunk, torch.ones(4, HQ, D + 1), 2)
        with pytest.raises(HebrusError):
            cache.plan(0, chunk, torch.ones(4, HQ, D), 0)


def test_kv_planes_follow_cells():
    cache = make_cache(kv=True)
    a = cache.new_sequence()
    keys, k, v = stream(9, kv=True)
    cache.append(a, keys, k=k, v=v)
    cells = cache.cells_of(a)
    for layer in range(L):
        assert torch.equal(cache.k_cache[layer, cells], k[layer])
        assert torch.equal(cache.v_cache[layer, cells], v[layer])
    b = cache.fork(a)
    cache.shift(b, 0, -1, 4)                  # copy on write: K/V copied to fresh cells
    assert not set(cache.cells_of(b).tolist()) & set(cells.tolist())
    assert torch.equal(cache.v_cache[1, cache.cells_of(b)], v[1])
    with pytest.raises(HebrusError, match="K/V"):
        cache.append(a, keys)
    d = cache.digest()
    blob = cache.save(a)
    c = cache.restore(None, blob)
    assert cache.digest(c) == cache.digest(a)
    other = make_cache(kv=True)
    other.load_state_dict(cache.state_dict())
    assert other.digest() == cache.digest() != d
    check_invariants(cache)


def lifecycle(device: str) -> tuple[QSACache, list[str]]:
    """The whole lifecycle on ``device``; returns the cache and the digests it went through."""
    cache = make_cache(device=device, kv=True)
    keys, k, v = stream(14, kv=True)
    keys, k, v = ([x.to(device) for x in t] for t in (keys, k, v))
    a = cache.new_sequence()
    plans = append_chunks(cache, a, keys, [5, 1, 8], first_position=3, k=k, v=v, q=queries(14).to(device))
    digests = [cache.digest()]
    b = cache.fork(a)
    cache.shift(b, 0, -1, 2)
    cache.remove(a, 0, 5)
    cache.rewind(b, 12)
    e = cache.new_sequence()
    digests.append(cache.digest())
    with pytest.raises(HoleError):
        cache.remove(b, 6, 8)
    with pytest.raises(CapacityError):
        cache.append(e, [x[:1].expand(cache.capacity, -1) for x in keys], k=[x[:1].expand(
            cache.capacity, -1, -1) for x in k], v=[x[:1].expand(cache.capacity, -1, -1) for x in v])
    assert cache.digest() == digests[-1]
    c = cache.restore(None, cache.save(a))
    assert cache.digest(c) == cache.digest(a)
    with pytest.raises(RuntimeError):
        with transaction(cache):
            cache.append(c, [x[:3] for x in keys], k=[x[:3] for x in k], v=[x[:3] for x in v])
            raise RuntimeError("roll back")
    digests.append(cache.digest())
    other = make_cache(device=device, kv=True)
    other.load_state_dict(cache.state_dict())
    assert other.digest() == cache.digest()
    digests += [str([p.token_cells.tolist() for p in plans])]
    return cache, digests


def test_lifecycle_on_the_emulated_mps_device():
    """The lifecycle on an emulated MPS device (hebrus_torch._emulate: every MPS branch, host data mixed
    with device data raises) gives what it gives on the CPU; the bookkeeping stays on the host."""
    from hebrus_torch import _emulate

    want = lifecycle("cpu")[1]
    with _emulate.emulate("mps"):
        cache, got = lifecycle("mps")
        assert cache.device.type == "mps" and cache.cell_ref.device.type == "cpu"
        assert cache.keys.device.type == cache.pooled.device.type == "mps"
        check_invariants(cache)
    assert got == want


def test_lifecycle_on_device(device):
    """The whole lifecycle on each device (cpu always, mps where available), then moved to the CPU."""
    cache = make_cache(device=device, kv=True)
    keys, k, v = stream(14, kv=True)
    keys, k, v = ([x.to(device) for x in t] for t in (keys, k, v))
    a = cache.new_sequence()
    chunk = append_chunks(cache, a, keys, [5, 1, 8], first_position=3, k=k, v=v, q=queries(14).to(device))
    assert all(p.token_cells.device.type == device for p in chunk)
    b = cache.fork(a)
    cache.shift(b, 0, -1, 2)
    cache.remove(a, 0, 5)
    cache.rewind(b, 12)
    c = cache.restore(None, cache.save(a))
    assert cache.digest(c) == cache.digest(a)
    check_invariants(cache)
    other = make_cache(device=device, kv=True)
    other.load_state_dict(cache.state_dict())
    assert other.digest() == cache.digest()
    d = cache.digest()
    cache.to("cpu")
    assert cache.device.type == "cpu" and cache.cells_of(a).device.type == "cpu"
    check_invariants(cache)
    if device == "cpu":
        assert cache.digest() == d


# ------------------------------------------------------------------------------------------------
# Errors: successor rule, holes, stale handles, capacity
# ------------------------------------------------------------------------------------------------

def test_non_successor_append_fails_closed(cache):
    a, b = cache.new_sequence(), cache.new_sequence()
    keys, _, _ = stream(6)
    cache.append(a, [k[:4] for k in keys], first_position=10)
    d = cache.digest()
    with pytest.raises(NonSuccessorError, match=r"position 14.*\[16, 17\]") as err:
        cache.append(a, [k[4:] for k in keys], first_position=16)
    assert "SeqHandle(slot=0" in str(err.value)
    with pytest.raises(NonSuccessorError):
        cache.reserve([b, a], [2, 2], [0, 13])       # b's row is fine, a's is not: nothing changes
    with pytest.raises(NonSuccessorError):
        cache.reserve([a], [1], [10])
    assert cache.digest() == d
    assert cache.run(b) == (0, 0)


def test_reserve_argument_errors(cache):
    a = cache.new_sequence()
    d = cache.digest()
    for args in (([a, a], [1, 1]), ([a], [1, 2]), ([a], [-1]), ([a], [1], [None, None]), ([a], [1], [-3])):
        with pytest.raises(HebrusError):
            cache.reserve(*args)
    assert cache.digest() == d


def test_positions_never_pass_the_largest_int64(cache):
    top = 2**63 - 1
    a = cache.new_sequence()
    d = cache.digest()
    for first, n in ((top - 2, 4), (top + 5, 1), (2**64 + 1, 1)):
        with pytest.raises(HebrusError, match="largest position"):
            cache.append(a, [k[:n] for k in stream(n)[0]], first_position=first)
        assert cache.digest() == d
    with pytest.raises(HebrusError, match="integer"):
        cache.reserve([a], [1], [1.5])
    cache.append(a, [k[:3] for k in stream(3)[0]], first_position=top - 2)     # ends exactly at the top
    assert cache.run(a) == (top - 2, 3)
    b = cache.new_sequence()
    chunk = cache.reserve([a, b], [0, 2])          # a row of 0 tokens still packs with the others
    assert chunk.positions.tolist() == [0, 1] and cache.run(a) == (top - 2, 3)
    with pytest.raises(HebrusError, match="largest position"):
        cache.append(a, [k[:1] for k in stream(1)[0]])
    with pytest.raises(HebrusError, match="largest position"):
        cache.shift(a, 0, -1, 1)
    blob = cache.save(a)
    meta, tensors = blob_mod.unpack(blob, "hebrus_torch.QSACache.sequence")
    d = cache.digest()
    for p0 in (top - 1, 2**64 + 1):
        bad = blob_mod.pack("hebrus_torch.QSACache.sequence", dict(meta, p0=p0),
                            dict(tensors, positions=torch.arange(3, dtype=torch.int64)))
        with pytest.raises(CorruptStateError, match="bad run"):
            cache.restore(None, bad)
    assert cache.digest() == d


def test_remove_middle_is_a_hole(cache):
    a = cache.new_sequence()
    cache.append(a, stream(12)[0], first_position=4)
    d = cache.digest()
    with pytest.raises(HoleError, match=r"\[4, 15\].*\[7, 9\].*hole"):
        cache.remove(a, 7, 10)
    assert cache.digest() == d and cache.run(a) == (4, 12)


def test_partial_shift_is_a_hole(cache):
    a = cache.new_sequence()
    cache.append(a, stream(12)[0])
    d = cache.digest()
    for p0, p1 in ((0, 5), (3, -1), (2, 8)):
        with pytest.raises(HoleError):
            cache.shift(a, p0, p1, 3)
    with pytest.raises(HebrusError):
        cache.shift(a, 0, -1, -1)            # would start below position 0
    assert cache.digest() == d


def test_tampered_cell_table_is_caught_by_plan_and_pooling(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(12)
    chunk = cache.append(a, keys)
    cells = cache.cells_of(a)
    cache.cell_pos[cells[5]] = 99               # a hole at position 5
    d = cache.digest()
    with pytest.raises(HoleError):
        cache.plan(0, chunk, queries(12), 2)
    with pytest.raises(HoleError, match="hole"):
        cache.remove(a, 0, 1)                   # re-anchors: the rebuild pools a group crossing the hole
    with pytest.raises(HoleError):
        cache.shift(a, 0, -1, 2)
    assert cache.digest() == d
    # the op itself refuses a group table crossing a hole
    with pytest.raises(HoleError):
        ops.qsa_pool(cache.keys[0], cache.cell_pos, cells[4:8].reshape(1, 4).to(torch.int32), torch.tensor([4]),
                     cache.norm_weight[0], cache.eps, cache.inv_freq)


def test_tampered_chunk_is_refused(cache):
    a = cache.new_sequence()
    chunk = cache.append(a, stream(8)[0])
    bad = ReservedChunk(chunk.handles, chunk.cu_seqlens, chunk.cells.flip(0), chunk.positions, chunk._owner, chunk._txn)
    with pytest.raises(HoleError):
        cache.plan(0, bad, queries(8), 2)
    cache.rewind(a, 4)
    with pytest.raises(HoleError):
        cache.plan(0, chunk, queries(8), 2)      # its later tokens are gone


@pytest.mark.parametrize("kill", ["free", "reset"])
def test_stale_handles(cache, kill):
    a = cache.new_sequence()
    chunk = cache.append(a, stream(8)[0])
    new = getattr(cache, kill)(a)
    if kill == "reset":
        assert new == SeqHandle(a.slot, a.generation + 1) and cache.run(new) == (0, 0)
    d = cache.digest()
    calls = [lambda: cache.run(a), lambda: cache.cells_of(a), lambda: cache.append(a, stream(1)[0]),
             lambda: cache.reserve([a], [1]), lambda: cache.remove(a, 0, -1), lambda: cache.rewind(a, 0),
             lambda: cache.shift(a, 0, -1, 1), lambda: cache.fork(a), lambda: cache.keep(a),
             lambda: cache.save(a), lambda: cache.free(a), lambda: cache.reset(a), lambda: cache.digest(a),
             lambda: cache.plan(0, chunk, queries(8), 2)]
    if kill == "reset":
        calls += [lambda: cache.copy(a, new), lambda: cache.copy(new, a)]
    for call in calls:
        with pytest.raises(StaleHandleError):
            call()
    assert cache.digest() == d
    b = cache.new_sequence()
    assert b.slot != a.slot or b.generation > a.generation


def test_capacity_errors():
    cache = make_cache(capacity=16, max_sequences=2)
    a, b = cache.new_sequence(), cache.new_sequence()
    with pytest.raises(CapacityError):
        cache.new_sequence()
    cache.append(a, stream(10)[0])
    d = cache.digest()
    with pytest.raises(CapacityError, match="7 cells needed but only 6"):
        cache.append(b, stream(7)[0])
    with pytest.raises(CapacityError):
        cache.restore(b, cache.save(a))
    with pytest.raises(CapacityError):
        cache.restore(None, cache.save(a))       # no free slot
    assert cache.digest() == d
    cache.append(b, stream(6)[0])
    cache.copy(a, b)                             # b now shares a's 10 cells; 6 free
    d = cache.digest()
    with pytest.raises(CapacityError):
        cache.shift(b, 0, -1, 1)                 # copy on write needs 10 fresh cells
    assert cache.digest() == d
    check_invariants(cache)


def test_capacity_error_inside_transaction_keeps_staged_work():
    cache = make_cache(capacity=12)
    a = cache.new_sequence()
    keys, _, _ = stream(12)
    with transaction(cache):
        chunk = cache.append(a, [k[:8] for k in keys])
        staged = cache.digest()
        with pytest.raises(CapacityError):
            cache.reserve([a], [5])
        assert cache.digest() == staged
        cache.append(a, [k[8:] for k in keys])
    assert cache.run(a) == (0, 12)
    check_invariants(cache)
    assert chunk.num_tokens == 8


# ------------------------------------------------------------------------------------------------
# Lifecycle
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 4, 8, 11])
def test_remove_prefix_reanchors(cache, k):
    a = cache.new_sequence()
    keys, _, _ = stream(14)
    cache.append(a, keys, first_position=2)
    cache.remove(a, -1, 2 + k)
    assert cache.run(a) == (2 + k, 14 - k)
    assert torch.equal(cache.keys_of(a, 0), keys[0][k:])
    check_invariants(cache)
    fresh = make_cache()
    f = fresh.new_sequence()
    fresh.append(f, [kk[k:] for kk in keys], first_position=2 + k)
    assert fresh.digest(f) == cache.digest(a)


def test_rewind_many_equals_one_rewind_after_another_with_shared_cells():
    """rewind_many (truncate's batched form) leaves what a rewind of each sequence in turn leaves, also for
    forked sequences that drop the same shared cells and groups (two references to one cell: one release
    per holder; a batched update that decremented once would leak the cell)."""
    keys, _, _ = stream(15)
    for cuts in ({0: 9, 1: 5, 2: 15, 3: 0}, {0: 3, 1: 3, 2: 13}, {1: 12, 3: 4}, {0: 20, 2: 7}):
        caches = [make_cache(), make_cache()]
        handles = []
        for c in caches:
            a = c.new_sequence()
            c.append(a, [kk[:11] for kk in keys], first_position=2)
            b = c.fork(a)                                # shares a's cells and groups
            x = c.new_sequence()
            c.append(x, [kk[:15] for kk in keys])
            y = c.fork(x)
            c.append(y, [kk[:2] for kk in keys])        # y: x's 15 shared cells, then 2 of its own
            handles.append([a, b, x, y])
        one, many = caches
        for i, p in cuts.items():
            one.rewind(handles[0][i], p)
        many.rewind_many({handles[1][i]: p for i, p in cuts.items()})
        assert many.digest() == one.digest(), cuts
        assert torch.equal(many.cell_ref, one.cell_ref) and torch.equal(many.group_ref, one.group_ref), cuts
        check_invariants(many)


def test_allocation_at_the_head_chooses_what_the_full_scan_chooses():
    """The allocator's shortcut (the cells from the head on, when free and not precious; a chunk's cells then taken
    in one ``hebrus::qsa_claim_cells`` call) takes exactly the cells and group rows the full scan takes: the same
    tables after every operation of a random workload with forks, rewinds, frees, cells freed and taken again in one
    transaction, and rolled-back ones."""
    rng = random.Random(5)
    fast, slow = make_cache(48), make_cache(48)
    slow._head_free = lambda *args: False
    claims = []
    claim = fast._claim_at_head
    fast._claim_at_head = lambda *args: claims.append(claim(*args)) or claims[-1]
    keys, _, _ = stream(64)
    live: list[list[SeqHandle]] = [[], []]
    for step in range(120):
        op = rng.choice(["new", "append", "append", "rewind", "fork", "free", "abort", "redo", "redo"])
        for c, seqs in zip((fast, slow), live):
            r = random.Random(step)
            try:
                if op == "new" or not seqs:
                    seqs.append(c.new_sequence())
                elif op == "append":
                    h = seqs[r.randrange(len(seqs))]
                    n = r.randrange(1, 9)
                    c.append(h, [kk[:n] for kk in keys])
                elif op == "rewind":
                    h = seqs[r.randrange(len(seqs))]
                    p0, n = c.run(h)
                    c.rewind(h, p0 + r.randrange(n + 1))
                elif op == "fork":
                    seqs.append(c.fork(seqs[r.randrange(len(seqs))]))
                elif op == "free":
                    c.free(seqs.pop(r.randrange(len(seqs))))
                elif op == "redo":              # cells freed and taken in one transaction (precious ones)
                    h = seqs[r.randrange(len(seqs))]
                    p0, n = c.run(h)
                    k = r.randrange(1, 9)
                    with transaction(c):
                        c.rewind(h, p0 + n // 2)
                        c.append(h, [kk[:k] for kk in keys])
                else:
                    with pytest.raises(RuntimeError), transaction(c):
                        c.append(seqs[r.randrange(len(seqs))], [kk[:3] for kk in keys])
                        raise RuntimeError("abort")
            except CapacityError:
                pass
        assert torch.equal(fast.cell_pos, slow.cell_pos) and torch.equal(fast.cell_ref, slow.cell_ref), step
        assert torch.equal(fast.group_ref, slow.group_ref) and fast.digest() == slow.digest(), step
        for table in ("_unwritten", "_freed_cells", "_freed_rows", "_pending"):
            assert torch.equal(getattr(fast, table), getattr(slow, table)), (step, table)
    check_invariants(fast)
    assert sum(c is not None for c in claims) > 10 and None in claims     # (both paths of the fast cache ran)


def test_the_allocators_numpy_views_follow_a_replaced_table():
    """Cells and rows taken at the head are written through numpy views of the tables (``_array``): when a table is
    replaced (the group rows grown, a savepoint's tensors put back), the writes land in the table the cache holds,
    and a rolled-back reserve leaves every table as it was."""
    keys, _, _ = stream(64)
    c = make_cache(64)
    h = c.new_sequence()
    c.append(h, [kk[:8] for kk in keys])                 # two groups: the views of group_ref and cell_ref are taken
    old_rows = c.group_ref
    with transaction(c):
        c._grow_rows(c.group_capacity)                   # a new group_ref tensor
    assert c.group_ref is not old_rows
    c.append(h, [kk[8:12] for kk in keys])               # the third group's row, taken at the head
    assert c.group_ref[:3].tolist() == [1, 1, 1] and int(old_rows[2]) == 0
    before = {t: getattr(c, t).clone() for t in ("cell_pos", "cell_ref", "group_ref", "_unwritten")}
    with pytest.raises(RuntimeError), transaction(c):
        c.append(h, [kk[12:16] for kk in keys])
        assert c.cell_ref[12:16].tolist() == [1] * 4
        raise RuntimeError("abort")
    for t, was in before.items():
        assert torch.equal(getattr(c, t), was), t
    check_invariants(c)


def test_allocation_at_the_head_skips_cells_a_rollback_may_need():
    """Cells freed in the open transaction lie at the head while other free cells do not: the shortcut must
    leave them to the full scan, which takes the others (a rollback restores the freed cells' keys)."""
    keys, _, _ = stream(8)
    c = make_cache(16)
    a, b, d = c.new_sequence(), c.new_sequence(), c.new_sequence()
    c.append(a, [kk[:6] for kk in keys])                # cells 0..5
    c.append(b, [kk[:4] for kk in keys])                # 6..9
    c.free(b)                                           # 6..9 free (committed: nobody may need them back)
    c.append(d, [kk[:6] for kk in keys])                # 10..15, the head wraps to 0
    e = c.new_sequence()
    with transaction(c):
        c.rewind(a, 0)                                  # 0..5 free, but the transaction may restore them
        c.append(e, [kk[:2] for kk in keys])
        assert c.cells_of(e).tolist() == [6, 7]


def test_rewind_many_is_atomic(cache):
    a, b = cache.new_sequence(), cache.new_sequence()
    keys, _, _ = stream(9)
    cache.append(a, keys)
    cache.append(b, keys)
    d = cache.digest()
    with pytest.raises(HebrusError):
        cache.rewind_many({a: 4, SeqHandle(b.slot, b.generation + 1): 2})     # a stale handle: nothing changes
    assert cache.digest() == d
    check_invariants(cache)


def test_remove_suffix_rewind_all_and_noop(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(14)
    cache.append(a, keys, first_position=2)
    d = cache.digest()
    cache.remove(a, 20, 30)
    cache.remove(a, 0, 2)
    cache.remove(a, 5, 5)
    assert cache.digest() == d
    cache.remove(a, 11, -1)
    assert cache.run(a) == (2, 9)
    check_invariants(cache)
    cache.rewind(a, 7)
    assert cache.run(a) == (2, 5)
    assert torch.equal(cache.keys_of(a, 1), keys[1][:5])
    check_invariants(cache)
    cache.append(a, [kk[5:] for kk in keys])
    check_invariants(cache)
    cache.remove(a, 0, -1)
    assert cache.run(a) == (2, 0)          # an emptied run keeps p0 as its default start
    assert int(cache.cell_ref.sum()) == 0
    cache.append(a, [kk[:3] for kk in keys], first_position=40)   # empty: first position is free
    assert cache.run(a) == (40, 3)
    check_invariants(cache)


def test_shift_whole_run_reropes(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(10)
    cache.append(a, keys, first_position=3)
    cache.shift(a, 0, -1, 6)
    assert cache.run(a) == (9, 10)
    check_invariants(cache)
    fresh = make_cache()
    f = fresh.new_sequence()
    fresh.append(f, keys, first_position=9)
    assert fresh.digest(f) == cache.digest(a)
    cache.shift(a, 9, 19, -9)
    assert cache.run(a) == (0, 10)
    d = cache.digest()
    cache.shift(a, 50, 60, 3)             # range misses the run
    cache.shift(a, 0, -1, 0)
    assert cache.digest() == d
    cache.append(a, stream(2, seed=3)[0], first_position=10)
    check_invariants(cache)


def test_copy_fork_share_cells_and_copy_on_append(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(10)
    cache.append(a, keys)
    da = cache.digest(a)
    b = cache.fork(a)
    assert cache.digest(b) == da
    assert torch.equal(cache.cells_of(a), cache.cells_of(b))
    assert torch.equal(cache.groups_of(a), cache.groups_of(b))
    assert int(cache.cell_ref.max()) == 2
    more, _, _ = stream(6, seed=9)
    cache.append(b, more)
    assert cache.digest(a) == da                        # a untouched
    assert torch.equal(cache.cells_of(b)[:10], cache.cells_of(a))
    cache.append(a, stream(3, seed=10)[0])              # a appends after b: fresh cells, b untouched
    assert torch.equal(cache.keys_of(b, 0)[10:], more[0])
    check_invariants(cache)
    cache.shift(b, 0, -1, 5)                            # shared cells are copied before re-positioning
    assert cache.run(a) == (0, 13) and cache.run(b) == (5, 16)
    check_invariants(cache)
    c = cache.new_sequence()
    cache.append(c, stream(5, seed=4)[0])
    cache.copy(a, c)
    assert cache.digest(c) == cache.digest(a)
    cache.copy(a, a)
    cache.free(a)
    assert cache.run(c) == (0, 13)
    check_invariants(cache)
    cache.keep(c)
    assert cache.sequences() == [c]
    check_invariants(cache)


def test_keep_frees_every_other(cache):
    hs = [cache.new_sequence() for _ in range(4)]
    for i, h in enumerate(hs):
        cache.append(h, stream(3 + i, seed=i)[0])
    cache.keep(hs[2])
    assert cache.sequences() == [hs[2]]
    for h in hs[:2] + hs[3:]:
        with pytest.raises(StaleHandleError):
            cache.run(h)
    check_invariants(cache)


def test_new_sequence_with_given_handle_and_restore_into_it(cache):
    h = cache.new_sequence(SeqHandle(3, 5))
    assert cache.run(h) == (0, 0)
    with pytest.raises(HebrusError):
        cache.new_sequence(SeqHandle(3, 5))        # in use
    cache.free(h)
    with pytest.raises(StaleHandleError):
        cache.new_sequence(SeqHandle(3, 5))        # older than the slot's generation
    a = cache.new_sequence()
    cache.append(a, stream(9)[0], first_position=1)
    blob = cache.save(a)
    h2 = cache.restore(SeqHandle(3, 6), blob)
    assert h2 == SeqHandle(3, 6) and cache.digest(h2) == cache.digest(a)
    # restoring into a live handle replaces its run
    other = make_cache()
    o = other.new_sequence()
    other.append(o, stream(5, seed=8)[0], first_position=30)
    assert cache.restore(a, other.save(o)) == a
    assert cache.digest(a) == other.digest(o) and cache.run(a) == (30, 5)
    check_invariants(cache)


# ------------------------------------------------------------------------------------------------
# Window eviction
# ------------------------------------------------------------------------------------------------

def test_window_evicts_oldest_in_multiples_of_r_and_reuses_cells():
    window = 10
    cache = make_cache(capacity=window, window=window)
    a = cache.new_sequence()
    keys, _, _ = stream(40)
    q = queries(40)
    for i in range(40):
        chunk = cache.append(a, [k[i:i + 1] for k in keys])
        p0, n = cache.run(a)
        assert n <= window and p0 + n == i + 1
        assert p0 % R == 0                      # anchor stays aligned: eviction in multiples of r
        assert torch.equal(cache.keys_of(a, 0), keys[0][p0:i + 1])
        check_invariants(cache)
        plan = cache.plan(0, chunk, q[i:i + 1], 2)
        assert int(plan.q_groups[0]) == n // R
        assert int(plan.token_positions[0][plan.token_positions[0] >= 0].min()) >= p0
    fresh = make_cache(capacity=window)
    f = fresh.new_sequence()
    p0, n = cache.run(a)
    fresh.append(f, [k[p0:] for k in keys], first_position=p0)
    assert fresh.digest(f) == cache.digest(a)


def test_window_chunks_and_limits():
    cache = make_cache(capacity=32, window=9)
    a = cache.new_sequence()
    keys, _, _ = stream(30)
    cache.append(a, [k[:7] for k in keys], first_position=1)
    cache.append(a, [k[7:13] for k in keys])                     # 13 > 9: evict 4 (rounded from 4)
    assert cache.run(a) == (5, 9)
    cache.append(a, [k[13:16] for k in keys])                    # 12 > 9: evict 3 -> rounded to 4
    assert cache.run(a) == (9, 8)
    check_invariants(cache)
    d = cache.digest()
    with pytest.raises(HebrusError, match="window"):
        cache.append(a, [k[16:26] for k in keys])
    assert cache.digest() == d
    cache.append(a, [k[16:25] for k in keys])                    # 9 tokens: the whole old run goes
    assert cache.run(a) == (17, 9)
    check_invariants(cache)


def _window_views(sizes, *, window=12, n=40, top_k=2, first_position=None, capacity=64):
    """Per query (position order): its position, q_groups, selected groups and attended positions, fed in
    chunks of ``sizes`` into a windowed cache; and the final digest of the sequence."""
    cache = make_cache(capacity=capacity, window=window)
    a = cache.new_sequence()
    keys, _, _ = stream(n)
    q = queries(n)
    plans, at = [], 0
    for i, size in enumerate(sizes):
        sl = slice(at, at + size)
        with transaction(cache):          # plan where a runtime plans: in the chunk's own transaction
            chunk = cache.append(a, [k[sl] for k in keys], first_position=first_position if i == 0 else None)
            plans.append(cache.plan(0, chunk, q[sl], top_k))
        at += size
    views = []
    for plan in plans:
        for i in range(plan.positions.shape[0]):
            pos = plan.token_positions[i]
            views.append((int(plan.positions[i]), int(plan.q_groups[i]), plan.selected_groups[i].tolist(),
                          sorted(pos[pos >= 0].tolist())))
    check_invariants(cache)
    return views, cache.digest(a), cache.run(a)


@pytest.mark.parametrize("first_position", [None, 3])
def test_window_queries_see_their_own_run_however_the_stream_is_cut(first_position):
    # SPEC §3: with a window, what a query at p sees is a function of p alone (the run after the tokens up
    # to p, whole groups evicted from the front so at most W remain); eviction takes effect after the
    # chunk's queries are planned.
    sizes = [3, 5, 7, 1, 2, 6, 5, 3, 8]
    one, d_one, run_one = _window_views([1] * 40, first_position=first_position)
    cut, d_cut, run_cut = _window_views(sizes, first_position=first_position)
    assert [v[0] for v in one] == [v[0] for v in cut]
    differ = [a[0] for a, b in zip(one, cut) if a != b]
    assert differ == [], f"queries at positions {differ} see other tokens when the stream is cut in {sizes}"
    assert run_cut == run_one and d_cut == d_one
    start = first_position or 0
    for p, q_groups, _, seen in one:               # and that view is the window of p: at most 12, aligned
        w0 = start + R * max(0, -(-(p - start + 1 - 12) // R))
        assert q_groups == (p - w0 + 1) // R and w0 <= seen[0] and seen[-1] <= p, (p, w0, seen)
    rng = random.Random(5)
    for _ in range(3):
        sizes = []
        while sum(sizes) < 40:
            sizes.append(min(rng.randint(1, 12), 40 - sum(sizes)))
        views, d, run = _window_views(sizes, first_position=first_position)
        assert views == one and d == d_one and run == run_one, sizes


def test_window_chunk_keeps_cells_its_earlier_queries_need_until_planned():
    # Run [0, 10), one chunk of 12 tokens: its first query (position 10) still sees [0, 10]; once
    # planned, the run is [12, 22) (whole groups evicted, anchor aligned), as token by token.
    views, _, run = _window_views([10, 12], n=22)
    one, _, run_one = _window_views([1] * 22, n=22)
    assert views == one and run == run_one == (12, 10)
    assert views[10][3] == list(range(0, 11))


def test_window_chunk_planned_after_its_eviction_is_refused():
    cache = make_cache(window=12)
    a = cache.new_sequence()
    keys, _, _ = stream(22)
    cache.append(a, [k[:10] for k in keys])
    chunk = cache.append(a, [k[10:] for k in keys])       # committed: [0, 12) evicted
    assert cache.run(a) == (12, 10)
    d = cache.digest()
    with pytest.raises(HoleError):
        cache.plan(0, chunk, queries(12), 2)
    assert cache.digest() == d
    b = cache.new_sequence()
    cache.append(b, [k[:10] for k in keys])
    chunk = cache.append(b, [k[10:14] for k in keys])     # its tokens are kept, its queries' window start is not
    assert cache.run(b) == (4, 10)
    d = cache.digest()
    with pytest.raises(HoleError, match="evicted or moved since reserve"):
        cache.plan(0, chunk, queries(4), 2)
    assert cache.digest() == d


def test_window_eviction_rolls_back():
    cache = make_cache(capacity=8, window=8)
    a = cache.new_sequence()
    keys, _, _ = stream(16)
    cache.append(a, [k[:8] for k in keys])
    d = cache.digest()
    with pytest.raises(RuntimeError):
        with transaction(cache):
            cache.append(a, [k[8:12] for k in keys])             # evicts 4, reuses their cells
            assert cache.run(a) == (4, 8)
            raise RuntimeError("boom")
    assert cache.digest() == d and cache.run(a) == (0, 8)
    assert torch.equal(cache.keys_of(a, 1), keys[1][:8])
    check_invariants(cache)


# ------------------------------------------------------------------------------------------------
# Saved state
# ------------------------------------------------------------------------------------------------

def test_save_restore_round_trip(cache):
    a = cache.new_sequence()
    keys, _, _ = stream(15)
    cache.append(a, keys, first_position=7)
    blob = cache.save(a)
    assert isinstance(blob, bytes)
    da = cache.digest(a)
    cache.free(a)
    b = cache.restore(None, blob)
    assert cache.digest(b) == da and cache.run(b) == (7, 15)
    other = make_cache(capacity=20, max_sequences=2, scrambled=3)     # any capacity, any layout
    c = other.restore(None, blob)
    assert other.digest(c) == da
    check_invariants(cache)
    check_invariants(other)


def _corrupt_blobs(cache, good: bytes) -> dict[str, bytes]:
    meta, tensors = blob_mod.unpack(good, "hebrus_torch.QSACache.sequence")
    holed = dict(tensors)
    holed["positions"] = holed["positions"].clone()
    holed["positions"][3] += 1
    wrong_shape = dict(tensors)
    wrong_shape["keys"] = wrong_shape["keys"][:, :-1]
    wrong_dtype = dict(tensors)
    wrong_dtype["keys"] = wrong_dtype["keys"].half()
    other_cfg = dict(meta, config=dict(meta["config"], head_dim=16))
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    return {
        "truncated": good[:-10], "tiny": good[:5], "empty": b"", "flipped": bytes(flipped),
        "wrong kind": blob_mod.pack("hebrus_torch.PLEState.sequence", meta, tensors),
        "hole": blob_mod.pack("hebrus_torch.QSACache.sequence", meta, holed),
        "shape": blob_mod.pack("hebrus_torch.QSACache.sequence", meta, wrong_shape),
        "dtype": blob_mod.pack("hebrus_torch.QSACache.sequence", meta, wrong_dtype),
        "config": blob_mod.pack("hebrus_torch.QSACache.sequence", other_cfg, tensors),
        "run": blob_mod.pack("hebrus_torch.QSACache.sequence", dict(meta, n=meta["n"] + 1), tensors),
        "extra tensor": blob_mod.pack("hebrus_torch.QSACache.sequence", meta, dict(tensors, x=torch.zeros(1))),
    }


def test_restore_refuses_corrupt_blobs(cache):
    a = cache.new_sequence()
    cache.append(a, stream(10)[0], first_position=2)
    b = cache.new_sequence()
    good = cache.save(a)
    d = cache.digest()
    for name, bad in _corrupt_blobs(cache, good).items():
        for target in (None, b, SeqHandle(5, 0)):
            with pytest.raises(CorruptStateError) as err:
                cache.restore(target, bad)
            if name == "hole":
                assert isinstance(err.value, HoleError) and isinstance(err.value, HoleInSavedStateError)
            assert cache.digest() == d, name
    with pytest.raises(CorruptStateError):
        cache.restore(None, "not bytes")
    assert cache.digest() == d


def test_restore_takes_json_true_false_for_no_integer(cache):
    """bool is an int subclass in Python; in an untrusted blob false is not the position 0, nor true a count."""
    a = cache.new_sequence()
    cache.append(a, stream(6)[0])                                     # p0 = 0
    cache.append(cache.new_sequence(), stream(1)[0])
    good = cache.save(a)
    meta, tensors = blob_mod.unpack(good, "hebrus_torch.QSACache.sequence")
    one = cache.save(cache.sequences()[1])
    meta1, tensors1 = blob_mod.unpack(one, "hebrus_torch.QSACache.sequence")
    assert meta["p0"] == 0 and meta1["n"] == 1
    d = cache.digest()
    forged = [blob_mod.pack("hebrus_torch.QSACache.sequence", dict(meta, p0=False), tensors),
              blob_mod.pack("hebrus_torch.QSACache.sequence", dict(meta1, n=True), tensors1),
              blob_mod.pack("hebrus_torch.QSACache.sequence",
                            dict(meta, config=dict(meta["config"], compress_ratio=4.0)), tensors)]
    for bad in forged:
        with pytest.raises(CorruptStateError, match="bad run|configured"):
            cache.restore(None, bad)
        assert cache.digest() == d
    assert cache.digest(cache.restore(None, good)) == cache.digest(a)


def test_state_dict_round_trip_and_untrusted_load(tmp_path):
    cache = make_cache(scrambled=2)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, stream(13)[0], first_position=3)
    c = cache.fork(a)
    cache.append(b, stream(6, seed=2)[0])
    cache.free(b)
    cache.append(c, stream(5, seed=3)[0])
    sd = cache.state_dict()
    assert all(isinstance(v, torch.Tensor) for k, v in sd.items() if k != "_extra_state")
    json.dumps(sd["_extra_state"])                           # JSON-like metadata
    path = tmp_path / "qsa.pt"
    torch.save(sd, path)
    loaded = torch.load(path, weights_only=True)               # no pickle of arbitrary objects needed
    other = make_cache()
    other.load_state_dict(loaded)
    assert other.digest() == cache.digest()
    assert other.sequences() == cache.sequences()
    check_invariants(other)
    # both continue identically
    for h in (a, c):
        cache.append(h, stream(3, seed=11)[0])
        other.append(h, stream(3, seed=11)[0])
    assert other.digest() == cache.digest()
    # state dict is a snapshot: later changes do not alter it
    assert sd["seq_n"][a.slot] == 13


def _resum(sd: dict) -> dict:
    sd = dict(sd)
    tensors = {k: v for k, v in sd.items() if k != "_extra_state"}
    sd["_extra_state"] = dict(sd["_extra_state"], checksum=QSACache._checksum(tensors))
    return sd


def test_load_state_dict_refuses_bad_state():
    cache = make_cache()
    a = cache.new_sequence()
    cache.append(a, stream(13)[0], first_position=3)
    cache.fork(a)
    good = cache.state_dict()
    target = make_cache()
    t = target.new_sequence()
    target.append(t, stream(5, seed=4)[0])
    d = target.digest()
    hole = dict(good, cell_pos=good["cell_pos"].clone())
    hole["cell_pos"][int(good["seq_cells"][4])] += 100
    refs = dict(good, cell_ref=good["cell_ref"] + 1)
    gen = dict(good, live=good["live"].clone())
    gen["live"][a.slot] = False
    swapped = dict(good, seq_cells=good["seq_cells"].flip(0))
    bad = {
        "missing": {k: v for k, v in good.items() if k != "keys"},
        "unexpected": dict(good, extra=torch.zeros(1)),
        "no extra": {k: v for k, v in good.items() if k != "_extra_state"},
        "checksum": dict(good, keys=good["keys"] + 1),
        "format": dict(good, _extra_state=dict(good["_extra_state"], version=99)),
        "config": _resum(dict(good, _extra_state=dict(good["_extra_state"], config={}))),
        "shape": _resum(dict(good, keys=good["keys"][:, :-1])),
        "dtype": _resum(dict(good, keys=good["keys"].double())),
        "hole": _resum(hole),
        "refcount": _resum(refs),
        "free slot with a run": _resum(gen),
        "swapped cells": _resum(swapped),
        "norm weight": _resum(dict(good, norm_weight=good["norm_weight"] + 1)),
        "not tensors": _resum(dict(good, seq_p0=[0] * 8)),
        "version true": dict(good, _extra_state=dict(good["_extra_state"], version=True)),
        "heads of bools": dict(good, _extra_state=dict(good["_extra_state"], heads=[True, False])),
        "config of floats": dict(good, _extra_state=dict(good["_extra_state"], config={
            k: float(v) if type(v) is int else v for k, v in good["_extra_state"]["config"].items()})),
    }
    for name, sd in bad.items():
        with pytest.raises(CorruptStateError) as err:
            target.load_state_dict(sd)
            pytest.fail(name)
        if name == "hole":
            assert isinstance(err.value, HoleError)
        assert target.digest() == d, name
    with pytest.raises(CorruptStateError):
        target.load_state_dict("nope")
    target.load_state_dict(good)
    assert target.digest() == cache.digest()


def test_load_state_dict_refuses_a_group_row_used_twice():
    """A consistent tamper (rows, their refcounts, the checksum) that gives two groups of one sequence one
    pooled row: cells were checked for double use, rows were not."""
    cache = make_cache()
    a = cache.new_sequence()
    cache.append(a, stream(8)[0])                                      # 2 groups
    good = cache.state_dict()
    rows = good["seq_groups"].clone()
    rows[1] = rows[0]
    bad = _resum(dict(good, seq_groups=rows,
                      group_ref=torch.bincount(rows, minlength=good["group_ref"].numel()).to(torch.int32)))
    target = make_cache()
    target.new_sequence()
    d = target.digest()
    with pytest.raises(CorruptStateError, match="slot 0 lists a pooled group row twice"):
        target.load_state_dict(bad)
    assert target.digest() == d
    target.load_state_dict(good)
    assert target.digest() == cache.digest()


def test_generations_are_bounded_so_no_bump_overflows(cache):
    """A slot adopted or loaded at generation 2**63 - 1 could not be freed without overflowing int64."""
    src = cache.new_sequence()
    cache.append(src, stream(3)[0])
    data = cache.save(src)
    d = cache.digest()
    for g in (2**63 - 1, MAX_GENERATION):
        with pytest.raises(HebrusError, match=r"2\*\*62 - 1"):
            cache.new_sequence(SeqHandle(1, g))
        with pytest.raises(HebrusError, match=r"2\*\*62 - 1"):
            cache.restore(SeqHandle(1, g), data)
        assert cache.digest() == d
    cache.free(src)
    last = cache.new_sequence(SeqHandle(0, MAX_GENERATION - 1))
    cache.append(last, stream(5)[0])
    cache.free(last)                                    # slot 0 is retired at the largest generation
    assert cache.new_sequence() == SeqHandle(1, 0)
    good = cache.state_dict()
    other = make_cache()
    other.load_state_dict(good)
    assert other.digest() == cache.digest()
    check_invariants(other)
    target = make_cache()
    d = target.digest()
    for slot, g in ((0, 2**63 - 1), (0, MAX_GENERATION + 1), (1, MAX_GENERATION)):   # slot 1 is live
        gen = good["generation"].clone()
        gen[slot] = g
        with pytest.raises(CorruptStateError, match=r"2\*\*62 - 1"):
            target.load_state_dict(_resum(dict(good, generation=gen)))
        assert target.digest() == d


def test_load_state_dict_strict_false_leaves_unexpected_keys_out():
    cache = make_cache()
    a = cache.new_sequence()
    cache.append(a, stream(9)[0])
    good = cache.state_dict()
    target = make_cache()
    d = target.digest()
    with pytest.raises(CorruptStateError, match=r"unexpected key\(s\) \['extra'\]"):
        target.load_state_dict(dict(good, extra=torch.zeros(1)))
    assert target.digest() == d
    result = target.load_state_dict(dict(good, extra=torch.zeros(1)), strict=False)
    assert result.unexpected_keys == ["extra"] and target.digest() == cache.digest()
    with pytest.raises(CorruptStateError, match=r"lacks \['keys'\]"):
        target.load_state_dict({k: v for k, v in good.items() if k != "keys"}, strict=False)


def test_check_then_publish_state_dict():
    """The two halves ModelCache uses to validate every holder before publishing any."""
    cache = make_cache()
    a = cache.new_sequence()
    cache.append(a, stream(9)[0], first_position=2)
    good = cache.state_dict()
    assert "generation" in good and "live" in good
    target = make_cache()
    d = target.digest()
    target.check_state_dict(good)
    with pytest.raises(CorruptStateError):
        target.check_state_dict(dict(good, keys=good["keys"] + 1))
    assert target.digest() == d
    target.publish_state_dict(good)
    assert target.digest() == cache.digest()


def test_nested_in_a_module_state_dict():
    class Holder(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.qsa = c

    c1 = make_cache()
    a = c1.new_sequence()
    c1.append(a, stream(9)[0])
    sd = Holder(c1).state_dict()
    assert "qsa._extra_state" in sd and "qsa.keys" in sd
    c2 = make_cache()
    Holder(c2).load_state_dict(sd)
    assert c2.digest() == c1.digest()


def test_to_dtype_rederives_pooled():
    cache = make_cache()
    a = cache.new_sequence()
    keys, _, _ = stream(11)
    cache.append(a, keys)
    cache.to(torch.float16)
    assert cache.dtype == torch.float16 and cache.inv_freq.dtype == torch.float32
    assert cache.norm_weight.dtype == torch.float32
    check_invariants(cache)
    fresh = make_cache(dtype=torch.float16)
    f = fresh.new_sequence()
    fresh.append(f, [k.half() for k in keys])
    assert fresh.digest(f) == cache.digest(a)


def test_cast_to_an_unsupported_dtype_is_refused_before_anything_changes(cache):
    """.double() failed half-way (in the pooling kernel) and left float64 keys a digest could not name."""
    a = cache.new_sequence()
    cache.append(a, stream(9)[0])
    d, keys = cache.digest(), cache.keys.clone()
    for cast in (lambda: cache.double(), lambda: cache.to(torch.float64), lambda: cache.type(torch.float16)):
        with pytest.raises(HebrusError, match="cannot cast"):
            cast()
        assert cache.digest() == d and cache.dtype == torch.float32 and torch.equal(cache.keys, keys)
        assert cache.cell_pos.dtype == torch.int64 and cache.cell_ref.dtype == torch.int32
    cache.save(a)
    check_invariants(cache)


# ------------------------------------------------------------------------------------------------
# Transactions
# ------------------------------------------------------------------------------------------------

class FakeHolder(Transactional):
    """A minimal second holder: a list of values, staged in a transaction."""

    def __init__(self):
        self.values: list[int] = []
        self._staged: list[int] | None = None

    def add(self, v: int) -> None:
        if self.in_transaction:
            self._staged.append(v)
        else:
            self.values.append(v)

    def _txn_begin(self):
        self._staged = list(self.values)

    def _txn_commit(self):
        self.values, self._staged = self._staged, None

    def _txn_rollback(self):
        self._staged = None

    def digest(self) -> str:
        return repr(self.values)


def _busy_block(cache, a, b, fake=None):
    keys, _, _ = stream(11, seed=21)
    chunk = cache.reserve([a, b], [5, 6])
    for layer in range(L):
        cache.write(layer, chunk, keys[layer])
        cache.plan(layer, chunk, queries(11), 2)
    cache.remove(a, 0, 4)
    c = cache.fork(b)
    cache.shift(c, 0, -1, 3)
    cache.free(b)
    blob = cache.save(a)
    cache.restore(None, blob)
    cache.append(c, stream(4, seed=22)[0])
    cache.rewind(a, 5)
    if fake is not None:
        fake.add(1)
    return c


def test_rollback_restores_everything_across_layers_and_holders():
    cache = make_cache(capacity=48)
    fake = FakeHolder()
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, stream(9, seed=1)[0], first_position=2)
    cache.append(b, stream(6, seed=2)[0])
    d, fd = cache.digest(), fake.digest()
    sd = cache.state_dict()
    with pytest.raises(KeyError):
        with transaction(cache, fake):
            _busy_block(cache, a, b, fake)
            assert cache.digest() != d
            raise KeyError("boom")
    assert cache.digest() == d and fake.digest() == fd
    assert not cache.in_transaction
    for k, v in cache.state_dict().items():
        if k != "_extra_state":
            assert torch.equal(v, sd[k]), k
    check_invariants(cache)
    # and the same block commits
    with transaction(cache, fake):
        c = _busy_block(cache, a, b, fake)
    assert fake.values == [1]
    assert cache.run(a) == (4, 1) and cache.run(c) == (3, 16)
    check_invariants(cache)


def test_commit_that_cannot_complete_rolls_back_every_holder(monkeypatch):
    """Groups completed by the chunk are pooled at commit, before any holder publishes: a kernel that
    refuses there rolls back every holder of the block."""
    cache = make_cache(capacity=48)
    fake = FakeHolder()
    a = cache.new_sequence()
    cache.append(a, stream(5, seed=1)[0])
    d, fd = cache.digest(), fake.digest()

    def refuse(*args, **kwargs):
        raise HoleError("injected refusal of the pooling kernel")

    with pytest.raises(HoleError, match="injected"):
        with transaction(fake, cache):
            fake.add(1)
            cache.reserve([a], [6])                     # keys never written: the groups pool at commit
            monkeypatch.setattr(cache, "_pool", refuse)
    monkeypatch.undo()
    assert cache.digest() == d and fake.digest() == fd and not cache.in_transaction
    check_invariants(cache)
    with transaction(fake, cache):
        fake.add(1)
        cache.reserve([a], [6])
    assert cache.run(a) == (0, 11) and fake.values == [1]


def test_a_holder_whose_commit_raises_leaves_no_transaction_open():
    class BrokenCommit(FakeHolder):
        def _txn_commit(self):
            raise RuntimeError("injected failure in a commit")

    cache = make_cache(capacity=48)
    a = cache.new_sequence()
    cache.append(a, stream(5, seed=1)[0])
    broken = BrokenCommit()
    d = cache.digest()
    with pytest.raises(RuntimeError, match="injected"):
        with transaction(broken, cache):
            broken.add(1)
            cache.append(a, stream(6, seed=2)[0])
            cache.new_sequence()
    assert not cache.in_transaction and not broken.in_transaction
    assert cache.digest() == d and broken.digest() == "[]"
    check_invariants(cache)
    cache.append(a, stream(3, seed=3)[0])
    assert cache.run(a) == (0, 8)


def test_failed_operation_inside_transaction_changes_nothing_and_block_continues():
    cache = make_cache()
    a = cache.new_sequence()
    keys, _, _ = stream(12)
    with transaction(cache):
        cache.append(a, [k[:8] for k in keys])
        staged = cache.digest()
        with pytest.raises(HoleError):
            cache.remove(a, 2, 4)
        with pytest.raises(NonSuccessorError):
            cache.reserve([a], [1], [3])
        assert cache.digest() == staged
        cache.append(a, [k[8:] for k in keys])
    assert cache.run(a) == (0, 12)
    check_invariants(cache)


def test_commit_is_equivalent_to_autocommit():
    keys, _, _ = stream(20)
    c1, c2 = make_cache(), make_cache()
    a1, a2 = c1.new_sequence(), c2.new_sequence()
    for i in range(0, 20, 5):
        c1.append(a1, [k[i:i + 5] for k in keys])
    with transaction(c2):
        for i in range(0, 20, 5):
            c2.append(a2, [k[i:i + 5] for k in keys])
    assert c1.digest() == c2.digest()


def test_chunk_from_rolled_back_transaction_is_dead(cache):
    a = cache.new_sequence()
    with pytest.raises(ValueError):
        with transaction(cache):
            chunk = cache.reserve([a], [4])
            raise ValueError
    with transaction(cache):
        with pytest.raises(HebrusError):
            cache.write(0, chunk, torch.ones(4, D))


def test_group_pool_growth_rolls_back():
    cache = make_cache(capacity=16, max_sequences=8)        # 16 // 4 + 8 = 12 group rows to start with
    a = cache.new_sequence()
    cache.append(a, stream(16)[0])
    assert cache.group_capacity == 12
    d = cache.digest()
    with pytest.raises(ZeroDivisionError):
        with transaction(cache):
            for delta in (1, 2, 3):
                cache.remove(cache.fork(a), 0, delta)       # 3 re-anchored copies: 3 + 3 + 3 new rows
            assert cache.group_capacity > 12
            check_invariants(cache)
            1 / 0
    assert cache.group_capacity == 12 and cache.digest() == d
    for delta in (1, 2, 3):
        cache.remove(cache.fork(a), 0, delta)
    assert cache.group_capacity > 12
    check_invariants(cache)


def test_reserve_zero_tokens_changes_nothing(cache):
    a = cache.new_sequence()
    d = cache.digest()
    chunk = cache.reserve([a], [0], [7])
    assert chunk.num_tokens == 0 and cache.digest() == d
    plan = cache.plan(0, chunk, torch.zeros(0, HQ, D), 2)
    assert isinstance(plan, QSAPlan) and plan.token_cells.shape == (0, 2 * R + R - 1)


def test_nested_transaction_is_refused(cache):
    with transaction(cache):
        with pytest.raises(HebrusError):
            with transaction(cache):
                pass


# ------------------------------------------------------------------------------------------------
# Parity with transformers' Qwen4ExpTextQSAIndexer
# ------------------------------------------------------------------------------------------------

def _tiny_model(**overrides):
    hf = pytest.importorskip("hf_models", reason="needs transformers==5.23.0")
    config = hf.tiny_config(layer_types=["indexed_attention", "linear_attention", "indexed_attention"],
                            num_hidden_layers=3, ple_layer_ids=[2], num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_key_heads=2,
                            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                            **overrides)
    torch.manual_seed(0)
    model = hf.modeling.Qwen4ExpForCausalLM(config).eval()
    with torch.no_grad():
        for i, t in enumerate(config.layer_types):
            if t == "indexed_attention":
                model.model.layers[i].self_attn.indexer.k_layernorm.weight.normal_(0, 0.3)
                model.model.layers[i].self_attn.indexer.q_layernorm.weight.normal_(0, 0.3)
    return hf, model


@pytest.mark.hf
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_from_transformers_refuses_rope_that_changes_with_the_context(rope_type):
    """These variants rewrite inv_freq once positions pass max_position_embeddings; the cache ropes with
    the frequencies it copied once, so its pooled keys would part from transformers'."""
    params = {"rope_type": rope_type, "factor": 8.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=32,
                      attention_factor=1.0)
    _, model = _tiny_model(max_position_embeddings=32, rope_parameters=params)
    with pytest.raises(HebrusError, match=f"rope_type '{rope_type}' rewrites inv_freq"):
        QSACache.from_transformers(model, capacity_tokens=64, max_sequences=2)
    with pytest.raises(HebrusError, match="rewrites inv_freq"):
        ModelCache.from_transformers(model, capacity_tokens=64, max_sequences=2)
    # A static scaled variant keeps its frequencies fixed: taken as they are.
    _, linear = _tiny_model(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    cache = QSACache.from_transformers(linear, capacity_tokens=64, max_sequences=2)
    assert torch.equal(cache.inv_freq, linear.model.rotary_emb.inv_freq.float())


@pytest.mark.hf
def test_from_transformers_refuses_rope_attention_scaling():
    """qsa_pool ropes with plain cos/sin; a rotary embedding that scales them (yarn's attention factor)
    would give pooled keys other than transformers'."""
    _, model = _tiny_model(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32})
    assert model.model.rotary_emb.attention_scaling != 1.0
    with pytest.raises(HebrusError, match="attention_scaling != 1 is not supported"):
        QSACache.from_transformers(model, capacity_tokens=64, max_sequences=2)
    with pytest.raises(HebrusError, match="attention_scaling != 1 is not supported"):
        ModelCache.from_transformers(model, capacity_tokens=64, max_sequences=2)


@pytest.mark.hf
@pytest.mark.parametrize("pad,n", [(0, 9), (0, 37), (3, 30)])
def test_from_transformers_plan_mask_matches_indexer(pad, n):
    hf, model = _tiny_model()
    text = model.model
    cfg = model.config
    cache = QSACache.from_transformers(model, capacity_tokens=64, max_sequences=2)
    assert cache.layer_ids == [0, 2] and cache.layer_index(2) == 1
    assert cache.head_dim == cfg.indexer_head_dim and cache.top_k == cfg.indexer_budget // cfg.indexer_compress_ratio
    with pytest.raises(HebrusError):
        cache.layer_index(1)
    s = pad + n
    torch.manual_seed(1)
    hidden = torch.randn(1, s, cfg.hidden_size)
    position_ids = torch.arange(s)[None]
    cos, sin = text.rotary_emb(hidden, position_ids)
    visible = torch.ones(s, s, dtype=torch.bool).tril()
    visible[:, :pad] = False
    mask4d = visible[None, None]
    a = cache.new_sequence()
    per_layer_keys, per_layer_q, expected = [], [], []
    with torch.no_grad():
        for model_layer in cache.layer_ids:
            ix = text.layers[model_layer].self_attn.indexer
            expected.append(ix(hidden, (cos, sin), mask4d, None)[0, 0])          # [S, S] bool
            qk = ix.index_qk_proj(hidden)
            q, k = torch.split(qk, [ix.index_n_heads * ix.index_head_dim, ix.index_head_dim], dim=-1)
            q = ix.q_layernorm(q.reshape(1, s, -1, ix.index_head_dim))
            q = hf.modeling.apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)
            per_layer_keys.append(k[0, pad:])
            per_layer_q.append(q[0, pad:])
    chunk = cache.append(a, per_layer_keys, first_position=pad)
    cells = cache.cells_of(a)
    layout = torch.cat([torch.full((pad,), -1, dtype=torch.int64), cells])
    compared = 0
    for layer in range(cache.num_layers):
        plan = cache.plan(layer, chunk, per_layer_q[layer], cache.top_k)
        got = plan.mask(layout)
        pooled = cache.pooled_of(a, layer).float()
        for t in range(n):
            ng = (t + 1) // cache.compress_ratio
            if ng > cache.top_k:
                scores = torch.relu(per_layer_q[layer][t].float() @ pooled[:ng].T).sum(0)
                top = torch.sort(scores, descending=True).values
                if bool(top[cache.top_k - 1] == top[cache.top_k]):
                    # a tie at the cut-off: transformers' topk picks either; the SPEC's rule (lower group
                    # index) is what plan follows (checked against the reference above)
                    assert plan.selected_groups[t].tolist() == _lowest_index_topk(scores, cache.top_k)
                    continue
            assert torch.equal(got[t], expected[layer][pad + t]), (layer, t)
            compared += 1
    assert compared >= n


def _lowest_index_topk(scores: torch.Tensor, k: int) -> list[int]:
    order = sorted(range(scores.numel()), key=lambda g: (-float(scores[g]), g))[:k]
    return sorted(order)


# ------------------------------------------------------------------------------------------------
# A transaction that cannot begin
# ------------------------------------------------------------------------------------------------

def _fail_once(obj, name, exc=MemoryError):
    real = getattr(obj, name)
    state = {"armed": True}

    def hook(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            raise exc("injected")
        return real(*args, **kwargs)

    setattr(obj, name, hook)


def test_a_savepoint_that_fails_at_begin_leaves_no_transaction_open():
    cache = make_cache()
    a = cache.new_sequence()
    keys, _, _ = stream(6)
    cache.append(a, keys)
    d = cache.digest()
    _fail_once(cache, "_savepoint")
    with pytest.raises(MemoryError):
        with transaction(cache):
            pass
    assert not cache.in_transaction and cache.digest() == d
    sd = cache.state_dict()                              # not refused as "inside a transaction"
    cache.to(torch.float16).to(torch.float32)
    cache.load_state_dict(sd)
    cache.append(a, [k[:1] for k in keys])               # and the next transaction works
    assert cache.run(a) == (0, 7)


def test_a_model_cache_whose_qsa_savepoint_fails_at_begin_stays_usable():
    from hf_models import modeling, tiny_config      # skips without transformers
    torch.manual_seed(0)
    cfg = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], ple_layer_ids=[1])
    model = modeling.Qwen4ExpForCausalLM(cfg).eval()
    mc = ModelCache.from_transformers(model, capacity_tokens=64, max_sequences=2)
    a = mc.new_sequence()
    d = mc.digest()
    _fail_once(mc.qsa, "_savepoint")
    with pytest.raises(MemoryError):
        mc.new_sequence()
    assert mc.digest() == d
    assert not any(h.in_transaction for h in (mc, mc.qsa, mc.ple))
    mc.state_dict()
    mc.to(torch.float32)
    assert mc.new_sequence() != a


def test_plans_of_one_transaction_reuse_rows_until_the_runs_change():
    """Every layer of a step plans the same chunk: the layer-independent rows (and the chunk's cell checks)
    are derived once per transaction (issue 37), give every layer the plan a fresh cache gives it, and are
    derived again, with their checks, once an operation changes the runs or cells inside the transaction."""
    n = 11
    keys, _, _ = stream(n, seed=3)
    q = queries(n, seed=4)
    fresh = []
    for layer in range(L):                        # each layer planned alone, in its own cache
        c = make_cache()
        s = c.new_sequence()
        with transaction(c):
            chunk = c.reserve([s], [n], [2])
            for lay in range(L):
                c.write(lay, chunk, keys[lay])
            fresh.append(c.plan(layer, chunk, q, 2))
    cache = make_cache()
    a, b = cache.new_sequence(), cache.new_sequence()
    append_chunks(cache, b, stream(6, seed=9)[0], [6])
    with transaction(cache):
        chunk = cache.reserve([a], [n], [2])
        for layer in range(L):
            cache.write(layer, chunk, keys[layer])
        plans = [cache.plan(layer, chunk, q, 2) for layer in range(L)]
        assert cache._plan_rows_memo is not None and plans[0].q_rows is plans[1].q_rows     # derived once
        cache.free(b)                                   # another sequence's run: the rows are derived again
        again = cache.plan(1, chunk, q, 2)
        assert again.q_rows is not plans[1].q_rows and torch.equal(again.token_cells, plans[1].token_cells)
        cache.rewind(a, 2 + 5)                          # the chunk's own run: its later tokens are gone
        with pytest.raises(HoleError):
            cache.plan(0, chunk, q, 2)
        with pytest.raises(HoleError):
            cache.write(0, chunk, keys[0])
    for got, want in zip(plans, fresh):      # (the cells differ: b took the first ones)
        for name in ("selected_groups", "q_groups", "token_positions", "token_offsets", "run_starts", "positions"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert cache._plan_rows_memo is None and cache._chunk_checked is None           # dropped with the transaction

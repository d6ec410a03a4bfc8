"""mps_kernels/ple_ngram_ids_slots.metal run in the emulator with the glue's launches, against the CPU kernel.

The history pool is updated in place (the glue marks it ``in_place``). Row ids and the pool must equal
the CPU kernel's (hebrus::ple_ngram_ids_slots on CPU) exactly, and the emulated ple_ngram_ids on the
gathered histories: ragged rows (some empty, shorter and longer than N-1), EOS-dense streams and
histories, N = 2..4, negative multipliers, EOS outside the vocabulary; pool rows not named by the
slots bitwise untouched; chunk invariance; every schedule and guard side; bad tokens, history
entries, slots (out of range, twice), cu_seqlens and vocab sizes raised at synchronization with the
CPU kernel's message, and the pool row left as it was when its update would read a bad value.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402
from hebrus_torch.ple import ops  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

VOCAB, EOS = 50, 7


def config(n, h, seed=0, negative=False):
    g = torch.Generator().manual_seed(seed)
    mult = torch.randint(1, 1 << 40, (n,), generator=g)
    if negative:
        mult[1::2] *= -1
    sizes = torch.randint(1000, 100000, ((n - 1) * h,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]]) + VOCAB
    return mult, sizes, offsets


def stream(lengths, n, pool_slots=None, seed=0, eos_rate=0.2):
    """tokens, cu_seqlens, a pool of random histories (EOS-dense) and distinct slots that use the pool's
    first and last rows."""
    g = torch.Generator().manual_seed(seed)
    total, batch = sum(lengths), len(lengths)
    pool_slots = pool_slots or batch + 3
    tokens = torch.randint(0, VOCAB, (total,), generator=g)
    tokens[torch.rand(total, generator=g) < eos_rate] = EOS
    pool = torch.randint(0, VOCAB, (pool_slots, n - 1), generator=g)
    pool[torch.rand(pool.shape, generator=g) < 0.3] = EOS
    inner = (torch.randperm(pool_slots - 2, generator=g) + 1).tolist()
    slots = torch.tensor([0, pool_slots - 1, *inner][:batch], dtype=torch.int32)[torch.randperm(batch, generator=g)]
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, cu, pool, slots


def emu(tokens, cu, pool, slots, *args, **kw):
    pool = pool.clone()
    return hebrus_emu.ple_ngram_ids_slots(tokens, cu, pool, slots, *args, **kw), pool


def cpu(tokens, cu, pool, slots, *args):
    pool = pool.clone()
    return ops.ple_ngram_ids_slots(tokens, cu, pool, slots, *args), pool


def assert_matches(tokens, cu, pool, slots, mult, sizes, offsets, eos=EOS, **kw):
    args = (mult, sizes, offsets, eos, VOCAB)
    ids, got_pool = emu(tokens, cu, pool, slots, *args, **kw)
    want_ids, want_pool = cpu(tokens, cu, pool, slots, *args)
    assert torch.equal(ids, want_ids) and torch.equal(got_pool, want_pool)
    plain_ids, new_history = hebrus_emu.ple_ngram_ids(tokens, cu, pool.index_select(0, slots.long()), *args)
    assert torch.equal(ids, plain_ids) and torch.equal(got_pool.index_select(0, slots.long()), new_history)
    ref_pool = pool.clone()
    assert torch.equal(reference.ple_ngram_ids_slots(tokens, cu, ref_pool, slots, *args), ids)
    assert torch.equal(ref_pool, got_pool)
    return ids, got_pool


@pytest.mark.parametrize("n,h,negative", [(3, 8, False), (2, 1, False), (4, 3, True), (3, 2, True)])
def test_matches_cpu_kernel(n, h, negative):
    mult, sizes, offsets = config(n, h, seed=n * 10 + h, negative=negative)
    tokens, cu, pool, slots = stream([0, 6, 1, 17, 0, 3, 40, 2], n, seed=h)
    assert_matches(tokens, cu, pool, slots, mult, sizes, offsets)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed):
    g = torch.Generator().manual_seed(50 + seed)
    n = int(torch.randint(2, 5, (1,), generator=g))
    h = int(torch.randint(1, 5, (1,), generator=g))
    batch = int(torch.randint(1, 8, (1,), generator=g))
    lengths = torch.randint(0, 2 * n + 2, (batch,), generator=g).tolist()
    mult, sizes, offsets = config(n, h, seed=seed, negative=bool(seed % 2))
    tokens, cu, pool, slots = stream(lengths, n, pool_slots=batch + 1 + seed, seed=seed, eos_rate=0.1 * seed)
    assert_matches(tokens, cu, pool, slots, mult, sizes, offsets, sched="random", seed=seed)


def test_decode_batch():
    mult, sizes, offsets = config(3, 8, seed=1)
    tokens, cu, pool, slots = stream([1] * 12, 3, pool_slots=30, seed=1)
    assert_matches(tokens, cu, pool, slots, mult, sizes, offsets)


@pytest.mark.parametrize("eos", [VOCAB + 100000, -1, -(1 << 63)])
def test_eos_outside_the_vocabulary(eos):
    # SPEC section 2: EOS is any int64; fresh histories [E]*(N-1) in the pool are valid.
    mult, sizes, offsets = config(3, 4, seed=3, negative=True)
    tokens, cu, _, slots = stream([0, 6, 1, 17], 3, seed=4, eos_rate=0.0)
    pool = torch.full((7, 2), eos)
    pool[int(slots[3]), 1] = 9
    assert_matches(tokens, cu, pool, slots, mult, sizes, offsets, eos=eos)


def test_rows_not_named_are_untouched():
    mult, sizes, offsets = config(3, 2)
    tokens, cu, pool, slots = stream([4, 0, 6, 1], 3, pool_slots=9, seed=6)
    free = [s for s in range(9) if s not in slots.tolist()]
    pool[free[0]] = torch.tensor([-5, VOCAB + 9])  # a free row's garbage is neither read nor checked
    _, got = emu(tokens, cu, pool, slots, mult, sizes, offsets, EOS, VOCAB)
    for s in range(9):
        if s not in slots.tolist() or s == int(slots[1]):  # row 1 has no tokens: its history passes through
            assert torch.equal(got[s], pool[s]), s


def test_launch_marks_the_pool_in_place():
    mult, sizes, offsets = config(3, 2)
    tokens, cu, pool, slots = stream([3, 2], 3)
    (launch,) = hebrus_emu.launches("ple_ngram_ids_slots", tokens, cu, pool, slots, mult, sizes, offsets, EOS, VOCAB)
    assert launch["kernel"] == "ple_ngram_ids_slots_long"
    assert launch["written"] == [False, False, True, False, False, False, False, True]
    assert launch["in_place"] == [False, False, True] + [False] * 5
    assert launch["tensors"][2].data_ptr() == pool.data_ptr()
    assert (launch["error_index"], launch["params_index"], launch["threads"]) == (8, 9, 5 + 2)


def run_chunks(rows, pool, slots, mult, sizes, offsets, cuts):
    pool = pool.clone()
    ids, bounds = [[] for _ in rows], [0, *cuts, max(len(r) for r in rows)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        parts = [r[a:b] for r in rows]
        cu = torch.tensor([0, *torch.tensor([len(p) for p in parts]).cumsum(0).tolist()], dtype=torch.int32)
        out = hebrus_emu.ple_ngram_ids_slots(torch.cat(parts), cu, pool, slots, mult, sizes, offsets, EOS, VOCAB)
        for i, chunk in enumerate(torch.split(out, [len(p) for p in parts])):
            ids[i].append(chunk)
    return [torch.cat(c) for c in ids], pool


def test_chunk_invariance():
    mult, sizes, offsets = config(3, 8, seed=5)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (k,), generator=g) for k in (11, 5, 0)]
    rows[0][[2, 3, 8]] = EOS
    pool = torch.full((4, 2), EOS)
    slots = torch.tensor([3, 0, 1], dtype=torch.int32)
    one = run_chunks(rows, pool, slots, mult, sizes, offsets, [])
    for cuts in ([1, 3, 4, 6, 7, 9, 10], [2, 7], [5]):
        other = run_chunks(rows, pool, slots, mult, sizes, offsets, cuts)
        assert all(torch.equal(a, b) for a, b in zip(one[0], other[0])) and torch.equal(one[1], other[1])


@pytest.mark.parametrize("sched,guard", [("reverse", "start"), ("random", "end")])
def test_schedules_and_guards_agree(sched, guard):
    mult, sizes, offsets = config(3, 8)
    tokens, cu, pool, slots = stream([300, 0, 21, 1], 3, seed=4)
    a = emu(tokens, cu, pool, slots, mult, sizes, offsets, EOS, VOCAB)
    b = emu(tokens, cu, pool, slots, mult, sizes, offsets, EOS, VOCAB, sched=sched, seed=2, guard=guard)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def both_raise(tokens, cu, pool, slots, mult, sizes, offsets, eos=EOS):
    """The emulator's error (at synchronization) and the CPU kernel's; returns both and the emulated pool."""
    got = pool.clone()
    with pytest.raises(hebrus_emu.ASYNC_ERROR) as emu_err:
        hebrus_emu.ple_ngram_ids_slots(tokens, cu, got, slots, mult, sizes, offsets, eos, VOCAB)
    with pytest.raises(HebrusError) as cpu_err:
        cpu(tokens, cu, pool, slots, mult, sizes, offsets, eos, VOCAB)
    assert str(cpu_err.value) in hebrus_emu.reported(), (str(cpu_err.value), hebrus_emu.reported())
    return str(emu_err.value), str(cpu_err.value), got


@pytest.mark.parametrize("where", ["token", "token_near_start", "token_negative", "history", "slot_range",
                                   "slot_twice", "cu", "vocab_size"])
def test_bad_input_raises_like_the_cpu_kernel(where):
    mult, sizes, offsets = config(3, 2)
    tokens, cu, pool, slots = stream([4, 0, 6, 3], 3, pool_slots=6, seed=9)  # rows at tokens 0, -, 4, 10
    untouched = []  # pool rows the kernel must leave as they were
    if where == "token":
        tokens[[7, 12]] = VOCAB  # row 2 position 3 (not copied), row 3 position 2 (copied into its history)
        untouched = [int(slots[3])]
    elif where == "token_near_start":
        tokens[4] = VOCAB + 1  # row 2 position 0: its ids are the row thread's
    elif where == "token_negative":
        tokens[11] = -1
        untouched = [int(slots[3])]
    elif where == "history":
        pool[int(slots[2]), 1] = VOCAB + 3
        untouched = [int(slots[2])]
    elif where == "slot_range":
        slots[3] = 6
    elif where == "slot_twice":
        slots[3] = int(slots[0])
        untouched = [int(slots[0])]
    elif where == "cu":
        cu = torch.tensor([0, 4, 3, 10, 13], dtype=torch.int32)
    else:
        sizes[3] = 0
    emu_msg, cpu_msg, got = both_raise(tokens, cu, pool, slots, mult, sizes, offsets)
    if where != "token":  # one bad value: the kernel's first message is the CPU kernel's
        assert emu_msg == cpu_msg
    if where == "history":  # the CPU kernel's message names the slot and the row
        assert cpu_msg == (f"hebrus::ple_ngram_ids_slots: history_pool[{int(slots[2])}, 1] = {VOCAB + 3} "
                           f"(slot of row 2) is outside [0, vocab={VOCAB}) and is not eos")
    for s in untouched:
        assert torch.equal(got[s], pool[s]), s


def test_empty_batch_launches_the_check_kernel():
    mult, sizes, offsets = config(3, 2)
    tokens, cu, pool, slots = stream([], 3, pool_slots=4)
    (launch,) = hebrus_emu.launches("ple_ngram_ids_slots", tokens, cu, pool, slots, mult, sizes, offsets, EOS, VOCAB)
    assert (launch["kernel"], launch["threads"]) == ("ple_ngram_ids_slots_check", 1)
    ids, got = emu(tokens, cu, pool, slots, mult, sizes, offsets, EOS, VOCAB)
    assert ids.shape == (0, 4) and torch.equal(got, pool)
    emu_msg, cpu_msg, _ = both_raise(tokens, torch.tensor([3], dtype=torch.int32), pool, slots, mult, sizes, offsets)
    assert emu_msg == cpu_msg
    sizes[2] = -4
    emu_msg, cpu_msg, _ = both_raise(tokens, cu, pool, slots, mult, sizes, offsets)
    assert emu_msg == cpu_msg == "hebrus::ple_ngram_ids_slots: vocab_sizes[2] must be positive, got -4"

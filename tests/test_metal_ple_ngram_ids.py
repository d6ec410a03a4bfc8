"""mps_kernels/ple_ngram_ids.metal run in the emulator with the glue's grid, against the reference.

Row ids must equal the reference exactly: ragged rows (some empty), EOS-dense streams and
histories, N = 2..4, negative multipliers (floor modulo as torch.remainder), chunk invariance
(one shot vs 1/2/1 vs random partitions), every schedule, and ids outside [0, vocab) or bad
cu_seqlens raising the reference's error with nothing returned.
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


def stream(lengths, n, seed=0, eos_rate=0.2):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens = torch.randint(0, VOCAB, (total,), generator=g)
    tokens[torch.rand(total, generator=g) < eos_rate] = EOS
    history = torch.randint(0, VOCAB, (len(lengths), n - 1), generator=g)
    history[torch.rand(history.shape, generator=g) < 0.3] = EOS
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, cu, history


@pytest.mark.parametrize("n,h,negative", [(3, 8, False), (2, 1, False), (4, 3, True), (3, 2, True)])
def test_matches_reference(n, h, negative):
    mult, sizes, offsets = config(n, h, seed=n * 10 + h, negative=negative)
    tokens, cu, history = stream([0, 6, 1, 17, 0, 3, 40], n, seed=h)
    got = hebrus_emu.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, EOS, VOCAB)
    want = reference.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, EOS, VOCAB)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fresh_history_and_eos_rule():
    # After an EOS the ids equal those of a fresh sequence starting there.
    mult, sizes, offsets = config(3, 4)
    seq = torch.tensor([3, 9, 11, EOS, 4, 8, 12, 5])
    fresh = torch.full((1, 2), EOS)
    ids, _ = hebrus_emu.ple_ngram_ids(seq, torch.tensor([0, 8], dtype=torch.int32), fresh, mult, sizes, offsets,
                                      EOS, VOCAB)
    tail, _ = hebrus_emu.ple_ngram_ids(seq[4:], torch.tensor([0, 4], dtype=torch.int32), fresh, mult, sizes,
                                       offsets, EOS, VOCAB)
    assert torch.equal(ids[4:], tail)


@pytest.mark.parametrize("eos", [VOCAB + 100000, -1, -(1 << 63)])
def test_eos_outside_the_vocabulary(eos):
    """SPEC §2: EOS is any int64, only compared with token ids (transformers' generation tests use vocab +
    100000). The kernel takes a fresh history [E]*(N-1) and matches the reference; a history id outside the
    vocabulary that is not E is still refused."""
    mult, sizes, offsets = config(3, 4, seed=3, negative=True)
    tokens, cu, _ = stream([0, 6, 1, 17], 3, seed=4, eos_rate=0.0)
    history = torch.full((4, 2), eos)
    history[3, 1] = 9
    got = hebrus_emu.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, eos, VOCAB)
    want = reference.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, eos, VOCAB)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    history[2, 0] = VOCAB + 1 if eos != VOCAB + 1 else VOCAB + 2
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=r"history\[2, 0\] = \d+ is outside \[0, vocab=50\) and is not eos"):
        hebrus_emu.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, eos, VOCAB)


def run_chunks(rows, history, mult, sizes, offsets, cuts):
    ids, bounds = [[] for _ in rows], [0, *cuts, max(len(r) for r in rows)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        parts = [r[a:b] for r in rows]
        cu = torch.tensor([0, *torch.tensor([len(p) for p in parts]).cumsum(0).tolist()], dtype=torch.int32)
        out, history = hebrus_emu.ple_ngram_ids(torch.cat(parts), cu, history, mult, sizes, offsets, EOS, VOCAB)
        for i, chunk in enumerate(torch.split(out, [len(p) for p in parts])):
            ids[i].append(chunk)
    return [torch.cat(c) for c in ids], history


def test_chunk_invariance():
    mult, sizes, offsets = config(3, 8, seed=5)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (k,), generator=g) for k in (11, 5, 0)]
    rows[0][[2, 3, 8]] = EOS
    history = torch.full((3, 2), EOS)
    one = run_chunks(rows, history, mult, sizes, offsets, [])
    for cuts in ([1, 3, 4, 6, 7, 9], [2, 7], [5]):
        other = run_chunks(rows, history, mult, sizes, offsets, cuts)
        assert all(torch.equal(a, b) for a, b in zip(one[0], other[0])) and torch.equal(one[1], other[1])


@pytest.mark.parametrize("sched,guard", [("reverse", "start"), ("random", "end")])
def test_schedules_agree(sched, guard):
    mult, sizes, offsets = config(3, 8)
    tokens, cu, history = stream([300, 0, 21], 3, seed=4)
    a = hebrus_emu.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, EOS, VOCAB)
    b = hebrus_emu.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, EOS, VOCAB, sched=sched, seed=2,
                                 guard=guard)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _both_raise(*args):
    with pytest.raises(hebrus_emu.ASYNC_ERROR) as emu_err:  # from the stream's error buffer, at synchronization
        hebrus_emu.ple_ngram_ids(*args)
    with pytest.raises(HebrusError) as ref_err:
        reference.ple_ngram_ids(*args)
    assert str(emu_err.value) in hebrus_emu.reported()
    # several bad entries: the reference names the first, the kernel reports every one
    return (str(ref_err.value) if str(ref_err.value) in hebrus_emu.reported() else str(emu_err.value)), str(ref_err.value)


@pytest.mark.parametrize("where", ["token", "token_negative", "history", "cu"])
def test_bad_input_raises_like_the_reference(where):
    mult, sizes, offsets = config(3, 2)
    tokens, cu, history = stream([4, 0, 6], 3, seed=9)
    if where == "token":
        tokens[[3, 7]] = VOCAB
    elif where == "token_negative":
        tokens[5] = -1
    elif where == "history":
        history[2, 1] = VOCAB + 3
    else:
        cu = torch.tensor([0, 4, 3, 10], dtype=torch.int32)
    emu_msg, ref_msg = _both_raise(tokens, cu, history, mult, sizes, offsets, EOS, VOCAB)
    assert emu_msg == ref_msg


def test_empty_batch_rows():
    mult, sizes, offsets = config(3, 2)
    tokens, cu, history = stream([0, 0], 3)
    ids, new_history = hebrus_emu.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, EOS, VOCAB)
    assert ids.shape == (0, 4) and torch.equal(new_history, history)

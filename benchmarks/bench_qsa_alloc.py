"""The QSA cache's decode-step bookkeeping: allocating at the head against the full scan, side by side.

A decode step reserves one cell per sequence (``QSACache.reserve`` in a transaction, every layer
written, committed). The allocator takes the cells from its head on when they are free and none is
needed back by a rollback (``_Allocator._at_head``); otherwise it scans the whole cell table (O(capacity)
per allocation). Both choose the same cells (tests/test_qsa_cache.py). This times one decode step of
``--seqs`` sequences of ``--prefix`` tokens each, 2 layers of 64-dim keys, at several capacities, with
the shortcut and with the scan forced (the shortcut switched off on that cache), alternating, and reports
the median step time of each and their ratio. Results go to benchmarks/RESULTS.md.

    python benchmarks/bench_qsa_alloc.py [--capacities 16384,65536,1048576] [--seqs 1,16] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, table, write_section  # noqa: E402

from hebrus_torch.qsa.cache import QSACache  # noqa: E402
from hebrus_torch.state.transaction import transaction  # noqa: E402

LAYERS, DIM, ROT = 2, 64, 32


def make(capacity: int, seqs: int, prefix: int, scan: bool) -> tuple[QSACache, list]:
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROT, 2, dtype=torch.float32) / ROT))
    cache = QSACache(capacity, num_layers=LAYERS, head_dim=DIM, norm_weight=torch.ones(LAYERS, DIM), eps=1e-6,
                     inv_freq=inv_freq, compress_ratio=4, max_sequences=seqs)
    if scan:
        cache._at_head = lambda *args: None
    handles = [cache.new_sequence() for _ in range(seqs)]
    for h in handles:
        cache.append(h, [torch.randn(prefix, DIM, generator=g) for _ in range(LAYERS)])
    return cache, handles


def decode_step(cache: QSACache, handles: list, keys: torch.Tensor) -> None:
    with transaction(cache):
        chunk = cache.reserve(handles, [1] * len(handles))
        for layer in range(LAYERS):
            cache.write(layer, chunk, keys)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacities", default="16384,65536,1048576")
    ap.add_argument("--seqs", default="1,16")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for capacity in (int(c) for c in args.capacities.split(",")):
        for seqs in (int(s) for s in args.seqs.split(",")):
            caches = {scan: make(capacity, seqs, args.prefix, scan) for scan in (False, True)}
            keys = torch.randn(seqs, DIM)
            times: dict[bool, list[float]] = {False: [], True: []}
            for step in range(args.steps):
                for scan in ((False, True) if step % 2 == 0 else (True, False)):
                    cache, handles = caches[scan]
                    t0 = time.perf_counter()
                    decode_step(cache, handles, keys)
                    times[scan].append(time.perf_counter() - t0)
            assert torch.equal(caches[False][0].cell_pos, caches[True][0].cell_pos), "the two allocators differ"
            head, scan = (statistics.median(times[s]) for s in (False, True))
            rows.append([str(capacity), str(seqs), f"{head * 1e3:.3f}", f"{scan * 1e3:.3f}", f"{scan / head:.1f}x"])
            print(rows[-1], flush=True)
    text = (f"`python benchmarks/bench_qsa_alloc.py --capacities {args.capacities} --seqs {args.seqs} --prefix "
            f"{args.prefix} --steps {args.steps} --threads {args.threads}`, {time.strftime('%Y-%m-%d')}: {machine()}.\n"
            f"One decode step of the QSA cache alone (reserve one cell per sequence, write {LAYERS} layers of "
            f"{DIM}-dim keys, commit), sequences of {args.prefix} tokens; median over {args.steps} steps of each "
            f"allocator, alternating. Both allocators choose the same cells (asserted); the rest of the step is the "
            f"same for both (and still has some work proportional to the capacity: the commit clears a flag per "
            f"cell).\n\n")
    text += table(["cells", "sequences", "at the head, ms / step", "full scan, ms / step", "scan / head"], rows)
    print(text)
    if not args.no_write:
        write_section("QSA cell allocation in a decode step", text)


if __name__ == "__main__":
    main()

"""How long a running stream waits while another request's prompt-cache file is written (issue 33).

On bench_engine.py's small random Qwen4Exp: request S streams ``--new`` tokens; after ``--warm`` of them,
a request W with an N-token prompt is added (``max_new_tokens=2``): it prefills in one step and finishes
in the next, a decode step beside S's, where its state is written to the prompt cache's directory. The inter-token gaps of S (its
``record_timestamps``) are split into the gap after the step in which W finished (its file is taken at
the end of that step) and the other decode steps (their median); the prompt cache's seconds on the engine's thread
(``counters.prompt_cache_seconds``: saving the state, and writing the file where that is not done off it) are
what every running stream waits for. With ``prompt_cache_dir`` off, the same run is the baseline of
that step (the two decodes without a file). One process, median of ``--repeat``.

    python benchmarks/bench_prompt_cache_stall.py [--lengths 1024,4096] [--repeat 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import small_model  # noqa: E402

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402


def stall(model, n: int, *, directory: str | None, warm: int, new: int, seed: int) -> tuple[float, float, float, float]:
    """(gap of the step where W finished, median of S's other gaps, the prompt cache's seconds on the engine's
    thread, bytes written) in seconds / bytes."""
    cfg = EngineConfig(capacity_tokens=16384, max_sequences=8, max_batch_tokens=8192, block_size=64,
                       prompt_cache_dir=directory)
    engine = Engine(model, cfg)
    g = torch.Generator().manual_seed(seed)
    s = engine.requests[engine.add_request(torch.randint(4, 4096, (32,), generator=g).tolist(), request_id="s",
                                           max_new_tokens=new, eos_token_id=-1, record_timestamps=True)]
    w = None
    done_at, spent = None, 0.0
    while engine.has_unfinished():
        before = engine.counters.prompt_cache_seconds
        engine.step()
        if w is None and len(s.generated) == warm:
            w = engine.requests[engine.add_request(torch.randint(4, 4096, (n,), generator=g).tolist(),
                                                   request_id="w", max_new_tokens=2, eos_token_id=-1)]
        if w is not None and done_at is None and w.status.is_done:
            done_at = len(s.generated) - 1       # the index of S's token of that step
            spent = engine.counters.prompt_cache_seconds - before
    # S's token of that step is stamped before W finishes in it (and its file is taken): the wait shows in the
    # gap to S's next token
    gaps = [b - a for a, b in zip(s.timestamps, s.timestamps[1:])]
    at = done_at
    others = [x for i, x in enumerate(gaps) if abs(i - at) > 2 and i > warm]
    written = engine.prompt_cache.total_bytes if engine.prompt_cache is not None else 0
    engine.close()
    return gaps[at], statistics.median(others), spent, written


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = small_model()
    with torch.inference_mode():
        stall(model, 256, directory=None, warm=args.warm, new=args.new, seed=0)       # warm-up
        print("| N | gap after the step W finished, with file | same step, no file | other decode steps | "
              "prompt cache on the engine thread | file |")
        print("|---|---|---|---|---|---|")
        for n in (int(x) for x in args.lengths.split(",")):
            with_file, without, other, engine_s, size = [], [], [], [], 0
            for r in range(args.repeat):
                with tempfile.TemporaryDirectory(prefix="bench-stall-") as d:
                    gap, rest, spent, size = stall(model, n, directory=d, warm=args.warm, new=args.new, seed=r)
                with_file.append(gap)
                other.append(rest)
                engine_s.append(spent)
                gap, _, _, _ = stall(model, n, directory=None, warm=args.warm, new=args.new, seed=r)
                without.append(gap)
            ms = lambda xs: f"{1e3 * statistics.median(xs):.1f} ms"  # noqa: E731
            print(f"| {n} | {ms(with_file)} | {ms(without)} | {ms(other)} | {ms(engine_s)} | {size / 2**20:.2f} MiB |")


if __name__ == "__main__":
    main()

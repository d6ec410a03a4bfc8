"""What one verification step costs against a plain decode step, side by side in one process.

bench_engine.py's small model, requests decoding after a 192-token prompt; every decode step of the
speculating engine verifies k drafts per request that are rejected (adaptive length off), so
each of its steps feeds k + 1 tokens per request, keeps one, and cuts every row back (state ops'
replay, write-back of the recorded rows, QSA rewind). Reported: the median time of 40 decode steps of
each engine (plain and speculating), over ``--repeat`` alternating runs, and the difference: what a
request that drafts k tokens and has all of them rejected adds to a step.

    python benchmarks/bench_verify_step.py [--requests 1,8] [--k 1,2] [--repeat 5] [--no-write]
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

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402
from hebrus_torch.engine.speculative import SpeculativeConfig  # noqa: E402

STEPS = 40


def decode_steps(model, prompts: list[list[int]], k: int) -> float:
    """Median seconds of STEPS decode steps (after the prefill and one decode step), k rejected drafts per
    request per step (k = 0: the plain engine)."""
    from bench_speculative import never_accepted

    rejected = never_accepted(model.config.vocab_size)
    spec = SpeculativeConfig(k, adaptive=False) if k else SpeculativeConfig(0)
    engine = Engine(model, EngineConfig(capacity_tokens=65536, max_sequences=max(8, len(prompts)),
                                        max_batch_tokens=None, speculative=spec), drafter=rejected if k else None)
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=STEPS + 8, eos_token_id=-1)
    engine.step()                   # the prefill of every prompt (no budget: one step)
    engine.step()
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if k:                           # (a draft equal to the model's argmax, 1 in ~4096, would be kept)
        assert engine.counters.spec_rollbacks >= STEPS * len(prompts) * 9 // 10
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--k", default="1,2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from bench_engine import small_model

    model = small_model()
    g = torch.Generator().manual_seed(3)
    rows = []
    with torch.inference_mode():
        for n in (int(x) for x in args.requests.split(",")):
            prompts = [torch.randint(4, model.config.vocab_size, (192,), generator=g).tolist() for _ in range(n)]
            for k in (int(x) for x in args.k.split(",")):
                decode_steps(model, prompts, 0), decode_steps(model, prompts, k)           # warm-up
                plain, spec = [], []
                for i in range(args.repeat):
                    for path in ((0, k) if i % 2 == 0 else (k, 0)):
                        (spec if path else plain).append(decode_steps(model, prompts, path))
                p, s = statistics.median(plain), statistics.median(spec)
                rows.append([str(n), str(k), f"{p * 1e3:.2f}", f"{s * 1e3:.2f}", f"{(s - p) * 1e3:+.2f}",
                             f"{s / p:.2f}x"])
                print(rows[-1], flush=True)
    text = (f"`python benchmarks/bench_verify_step.py --requests {args.requests} --k {args.k} --repeat {args.repeat} "
            f"--threads {args.threads}`, {time.strftime('%Y-%m-%d')}: {machine()}.\n"
            f"bench_engine.py's small model, 192-token prompts, then decode steps; the speculating engine's every "
            f"step verifies k drafts per request, all rejected (each row fed k + 1 tokens, kept 1, cut back). "
            f"Median of {STEPS} steps per run, median over {args.repeat} alternating runs.\n\n")
    text += table(["requests", "k (rejected drafts per request)", "plain step, ms", "verification step, ms",
                   "difference", "ratio"], rows)
    print(text)
    if not args.no_write:
        write_section("A verification step whose drafts are all rejected (issue 26)", text)


if __name__ == "__main__":
    main()

"""The engine of two source trees side by side: is a refactor free?

Runs bench_engine.py's workload (its small random Qwen4Exp, prompts of mixed lengths from its LENGTHS,
``--new`` greedy tokens each, all arriving at once, one thread) once per tree per pair, each run in a
fresh process whose ``hebrus_torch`` is imported from that tree (``PYTHONPATH``; the tree needs its
built extension, e.g. a worktree with ``hebrus_torch/_C.abi3.so`` copied in). Pairs run back to back
and alternate which tree goes first, so a slow spell of a shared machine hits both. Per request count:
each tree's median tokens/s, and the median over pairs of the new/base ratio of wall-time and of
CPU-time throughput, with the pairs' range. The generated tokens of both trees are asserted equal.

    python benchmarks/bench_revisions.py --base DIR --new DIR [--counts 1,8,64] [--new-tokens 32]
        [--pairs 5] [--no-write] [--section TITLE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(tree: str, count: int, new: int) -> None:
    """One engine run in this process (whose PYTHONPATH names ``tree``); prints one JSON line."""
    import torch

    import hebrus_torch
    if not os.path.abspath(hebrus_torch.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"bench_revisions: hebrus_torch came from {hebrus_torch.__file__}, not {tree}")
    from bench_engine import prompts_of, run_engine, small_model

    torch.set_num_threads(1)
    model = small_model()
    prompts = prompts_of(count, model.config.vocab_size)
    run_engine(model, prompts[:1], 2)                                   # warm up (rope tables, allocator)
    cpu0 = time.process_time()
    result = run_engine(model, prompts, new)
    cpu = time.process_time() - cpu0
    print(json.dumps({"wall": result["wall"], "cpu": cpu, "tokens": result["tokens"],
                      "steps": result["engine"].counters.steps, "outputs": result["outputs"]}))


def run_tree(tree: str, count: int, new: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tree, "--counts", str(count),
                          "--new-tokens", str(new)], env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"bench_revisions: the run on {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="the tree to compare against (its hebrus_torch/ and built extension)")
    ap.add_argument("--new", dest="new_tree", help="the tree under test")
    ap.add_argument("--counts", default="1,8,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="Engine throughput across a refactor")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    if args.child:
        child(args.child, counts[0], args.new_tokens)
        return
    if not (args.base and args.new_tree):
        ap.error("--base and --new are required")

    import torch
    from common import machine, table, write_section

    torch.set_num_threads(1)                # what machine() reports: the children's setting
    rows = []
    for count in counts:
        runs: dict[str, list[dict]] = {"base": [], "new": []}
        for pair in range(args.pairs):
            order = ["base", "new"] if pair % 2 == 0 else ["new", "base"]
            for name in order:
                runs[name].append(run_tree(args.base if name == "base" else args.new_tree, count, args.new_tokens))
            if runs["base"][-1]["outputs"] != runs["new"][-1]["outputs"]:
                raise SystemExit(f"bench_revisions: the trees generated different tokens at {count} requests")
        wall = [b["wall"] / n["wall"] for b, n in zip(runs["base"], runs["new"])]
        cpu = [b["cpu"] / n["cpu"] for b, n in zip(runs["base"], runs["new"])]
        tps = {k: statistics.median(r["tokens"] / r["wall"] for r in v) for k, v in runs.items()}
        rows.append([str(count), f"{tps['base']:.1f}", f"{tps['new']:.1f}", str(runs["new"][0]["steps"]),
                     f"{statistics.median(wall):.3f} ({min(wall):.2f}-{max(wall):.2f})",
                     f"{statistics.median(cpu):.3f} ({min(cpu):.2f}-{max(cpu):.2f})"])
        print(rows[-1], flush=True)
    body = table(["requests", "base tok/s (median)", "new tok/s (median)", "steps",
                  "new/base, wall: median (range)", "new/base, CPU: median (range)"], rows)
    head = (f"Machine: {machine()}. bench_engine.py's small random Qwen4Exp, greedy, {args.new_tokens} "
            f"new tokens per request, all arriving at once; {args.pairs} back-to-back pairs per row, order "
            f"alternating; each run a fresh process. base: {args.base}; new: {args.new_tree}. Generated "
            f"tokens equal in every pair.")
    print(head)
    print(body)
    if not args.no_write:
        write_section(args.section, head + "\n\n" + body)


if __name__ == "__main__":
    main()

"""The engine's decode step at 1, 16 and 64 requests on CPU, for comparing two trees side by side (issue 37).

The model is ``profile_engine_decode.llamacpp_variant`` (the small random Qwen4Exp llama.cpp can convert), fp32, one
thread. ``N`` requests of a 64-token random prompt each are admitted and prefilled; after 4 steps, the median CPU
time of the next ``--steps`` steps (every request decoding one token) is printed, one line per count, labelled
``--label``. The ``hebrus_torch`` imported is whichever ``PYTHONPATH`` names first, so two builds are compared by
running this script alternately with each tree first on ``PYTHONPATH`` (a shared machine's drift then hits both
alike):

    PYTHONPATH=<tree A> python benchmarks/bench_decode_step.py --label A
    PYTHONPATH=<tree B> python benchmarks/bench_decode_step.py --label B

or, on a machine of two cores or more, both at once (``--pair A B``): each round runs one process per tree at the
same time, each pinned to a core of its own, the cores swapped every round, so that the other jobs of a shared
machine slow both alike (alternating runs see that noise change between them: ±5% where the gains measured are a
few percent). Prints each round's pair and, per request count, the median over rounds of each tree's step and of
the ratio B / A:

    python benchmarks/bench_decode_step.py --pair <tree A> <tree B> --rounds 6

On a machine whose other jobs come and go within seconds, even paired rounds scatter (±20% a round was seen); there
``--interleave A B`` keeps one process per tree alive on one core, each with its engine decoding, and lets them take
turns in short chunks of steps (``--chunk``, the order swapped every round), so that both see the same minutes of the
machine; per request count it prints each tree's median step (CPU time) and the ratio B / A, once with A's process
started first and once with B's, and the geometric mean of the two (the same tree on both sides measured the process
started second ~3% slower):

    python benchmarks/bench_decode_step.py --interleave <tree A> <tree B> --counts 1 --rounds 40 --chunk 25

A tree written ``<path>@python`` runs with ``EngineConfig(native_layers=False)`` (``--python-layers``): the same tree's
Python path against its native layers is ``--pair <path>@python <path>``. ``<path>@aten`` runs with the row kernel off
(``--aten-products``: the fused ops' dense products of a few rows by ATen's mm, ``hebrus_torch.row_kernel``): the
row kernel against ATen's is ``--pair <path>@aten <path>``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_engine_decode import llamacpp_variant  # noqa: E402

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402


def _engine(model: torch.nn.Module, requests: int, steps: int, prompt: int = 64,
            native_layers: bool = True) -> Engine:
    """An engine with ``requests`` requests of a ``prompt``-token random prompt each, able to decode ``steps`` more."""
    g = torch.Generator().manual_seed(1)
    options = {} if native_layers else {"native_layers": False}       # (a tree from before the option: no key)
    engine = Engine(model, EngineConfig(capacity_tokens=requests * (prompt + steps + 16), max_sequences=requests,
                                        max_batch_tokens=max(4096, requests * prompt), block_size=256, **options))
    for i in range(requests):
        engine.add_request(torch.randint(4, model.config.vocab_size, (prompt,), generator=g).tolist(),
                           request_id=f"r{i}", max_new_tokens=steps + 8, eos_token_id=-1)
    return engine


def decode_step_ms(model: torch.nn.Module, requests: int, steps: int, prompt: int = 64,
                   native_layers: bool = True) -> float:
    """Median CPU milliseconds of a decode step with ``requests`` requests decoding."""
    engine = _engine(model, requests, steps, prompt, native_layers)
    times = []
    with torch.inference_mode():
        for _ in range(4):
            engine.step()
        for _ in range(steps):
            t0 = time.process_time()
            engine.step()
            times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def _tree_run(tree: str) -> tuple[dict[str, str], list[str]]:
    """A tree argument (``<path>``, ``<path>@python``, ``<path>@aten``) as the environment and flags of this script's
    run of it."""
    path, _, mode = tree.partition("@")
    flag = {"": [], "python": ["--python-layers"], "aten": ["--aten-products"]}[mode]
    return dict(os.environ, PYTHONPATH=path), flag


def paired(trees: list[str], counts: str, steps: int, rounds: int) -> None:
    """Both trees at once each round, one core each (swapped every round): the per-round pairs, then per request
    count the medians over rounds (ms) and the median ratio tree B / tree A."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pair needs two cores (run the trees alternately with PYTHONPATH instead)")
    results: dict[str, list[dict[int, float]]] = {tree: [] for tree in trees}
    for r in range(rounds):
        procs = []
        for i, tree in enumerate(trees):
            core = cores[(i + r) % 2]
            env, flag = _tree_run(tree)
            cmd = ["taskset", "-c", str(core), sys.executable, os.path.abspath(__file__), "--counts", counts,
                   "--steps", str(steps), "--label", tree] + flag
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        for tree, proc in zip(trees, procs):
            out = proc.communicate()[0]
            if proc.returncode:
                raise SystemExit(f"{tree}: the benchmark failed ({proc.returncode})")
            line = [x for x in out.splitlines() if " ms" in x][-1]
            results[tree].append({int(n): float(ms) for n, ms in re.findall(r"(\d+): ([\d.]+) ms", line)})
            print(f"round {r + 1}: {line}", flush=True)
    a, b = trees
    for n in (int(c) for c in counts.split(",")):
        ma = statistics.median(x[n] for x in results[a])
        mb = statistics.median(x[n] for x in results[b])
        ratio = statistics.median(y[n] / x[n] for x, y in zip(results[a], results[b]))
        print(f"{n} requests: A {ma:.2f} ms, B {mb:.2f} ms, B / A {ratio:.3f} (median of {rounds} paired rounds)")


def serve_turns(requests: int, steps: int, native_layers: bool) -> None:
    """The worker of ``--interleave``: after 4 steps prints ``ready``, then for each line ``K`` of stdin decodes K steps
    and prints their CPU times (ns, this thread), one line."""
    engine = _engine(llamacpp_variant(), requests, steps, native_layers=native_layers)
    with torch.inference_mode():
        for _ in range(4):
            engine.step()
        print("ready", flush=True)
        for line in sys.stdin:
            times = []
            for _ in range(int(line)):
                t0 = time.thread_time_ns()
                engine.step()
                times.append(time.thread_time_ns() - t0)
            print(" ".join(map(str, times)), flush=True)


def _take_turns(trees: list[str], n: int, rounds: int, chunk: int, core: str) -> list[list[float]]:
    """Per tree, the CPU times (ms) of its steps: its engine alive with the other's on ``core``, taking turns of
    ``chunk`` steps (the first to go swapped every round); the processes started in the order of ``trees``."""
    procs = []                          # (by position: the same tree twice measures the method's own bias)
    for tree in trees:
        env, flag = _tree_run(tree)
        cmd = ["taskset", "-c", core, sys.executable, os.path.abspath(__file__), "--serve-turns", str(n),
               "--steps", str(rounds * chunk + 8)] + flag
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
    try:
        for tree, proc in zip(trees, procs):
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"{tree}: the benchmark failed ({proc.wait()})")
        times: list[list[float]] = [[], []]
        for r in range(rounds):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                procs[i].stdin.write(f"{chunk}\n")
                procs[i].stdin.flush()
                times[i] += [int(x) / 1e6 for x in procs[i].stdout.readline().split()]
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait()
    return times


def interleaved(trees: list[str], counts: str, rounds: int, chunk: int) -> None:
    """Both trees' engines alive at once on one core, taking turns of ``chunk`` steps: per request count, each tree's
    median step (ms) over its ``rounds * chunk`` steps and the ratio B / A, twice: with A's process started first,
    then B's. The process started second was ~3% slower with the same tree on both sides (its memory, not its
    code), so the ratio reported is the geometric mean of the two orders'."""
    core = str(sorted(os.sched_getaffinity(0))[-1])
    for n in (int(c) for c in counts.split(",")):
        a_first = _take_turns(trees, n, rounds, chunk, core)
        b_first = _take_turns(trees[::-1], n, rounds, chunk, core)[::-1]
        ratios = []
        for label, (ta, tb) in (("A started first", a_first), ("B started first", b_first)):
            ma, mb = statistics.median(ta), statistics.median(tb)
            ratios.append(mb / ma)
            print(f"{n} requests, {label}: A {ma:.2f} ms, B {mb:.2f} ms, B / A {mb / ma:.3f}", flush=True)
        print(f"{n} requests: B / A {(ratios[0] * ratios[1]) ** 0.5:.3f} (geometric mean of both orders; "
              f"{rounds} turns of {chunk} steps each)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,16,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--pair", nargs=2, metavar=("TREE_A", "TREE_B"), help="time two trees at once, a core each")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--interleave", nargs=2, metavar=("TREE_A", "TREE_B"),
                    help="time two trees on one core, taking turns of --chunk steps")
    ap.add_argument("--chunk", type=int, default=25)
    ap.add_argument("--serve-turns", type=int, metavar="REQUESTS", help=argparse.SUPPRESS)
    ap.add_argument("--python-layers", action="store_true",
                    help="EngineConfig(native_layers=False): every layer through the Python path")
    ap.add_argument("--aten-products", action="store_true",
                    help="the fused ops' dense products of a few rows by ATen's mm (the row kernel off)")
    args = ap.parse_args()
    if args.pair:
        paired(args.pair, args.counts, args.steps, args.rounds)
        return
    if args.interleave:
        interleaved(args.interleave, args.counts, args.rounds, args.chunk)
        return
    torch.set_num_threads(1)
    import hebrus_torch
    if args.aten_products:
        from hebrus_torch.row_kernel import set_dense_row_kernel
        set_dense_row_kernel(False)
    if args.serve_turns:
        serve_turns(args.serve_turns, args.steps, native_layers=not args.python_layers)
        return
    model = llamacpp_variant()

    cells = [f"{n}: {decode_step_ms(model, n, args.steps, native_layers=not args.python_layers):.2f} ms"
             for n in (int(c) for c in args.counts.split(","))]
    print(f"{args.label} ({os.path.dirname(hebrus_torch.__file__)}): " + ", ".join(cells))


if __name__ == "__main__":
    main()

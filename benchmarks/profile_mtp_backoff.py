"""What a backed-off decode step of an MTP engine costs beyond a plain one (issue 38's "no more than 5% slower
where nothing is accepted").

bench_mtp.py's copy model (``--layers``) with a random MTP block (``testing.random_mtp(config, 6)``: nothing is
accepted), ``--requests`` requests of 64 random tokens, greedy. Two engines run side by side, a plain one and one
speculating with the block (``--k`` drafts, the back-off): their decode steps alternate, one of each in turn, so
both see the same load. A random block's drafts all miss, so the MTP engine verifies at decode steps 0, 4 and 20
and then drafts nothing until step 84: its steps 21 to ``20 + --steps`` are backed off. Per step, CPU time of the
process (one thread); the ratio is the median of the paired steps' ratios.

Then one backed-off step of each is recorded (a ``TorchDispatchMode``: every ATen / hebrus op with its name), and
the ops the MTP step dispatches beyond the plain one are listed by name; with ``--profile`` the backed-off steps
run under cProfile too and the functions whose time differs most are printed.

With ``--runs N`` it measures instead N whole runs (``--new`` tokens per request, the prefill included) of the two
engines with their steps interleaved the same way: per run the plain engine's CPU time over the MTP engine's, the
ratio bench_mtp.py's ``--nothing-accepted-pairs`` measures, with each step of one paired with the same step of the
other rather than whole runs one after another (less noise on a shared machine).

    python benchmarks/profile_mtp_backoff.py [--layers 4] [--requests 1] [--steps 60] [--profile] [--runs N]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402
from hebrus_torch.engine.speculative import SpeculativeConfig  # noqa: E402

CLOCK = time.process_time


class OpNames(TorchDispatchMode):
    """The name of every ATen / hebrus op a block dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def engines(model, prompts: list[list[int]], k: int, new: int) -> tuple[Engine, Engine]:
    out = []
    for spec in (None, SpeculativeConfig(k, method="mtp")):
        cfg = EngineConfig(capacity_tokens=65536, max_sequences=max(8, len(prompts)), max_batch_tokens=512,
                           speculative=spec)
        engine = Engine(model, cfg)
        for i, p in enumerate(prompts):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=new, eos_token_id=-1)
        out.append(engine)
    return out[0], out[1]


def interleaved_runs(model, prompts: list[list[int]], k: int, new: int, runs: int) -> list[float]:
    """``runs`` whole runs (the prompts' prefill and ``new`` greedy tokens each) of a plain engine and an MTP one,
    their steps interleaved (one of each in turn, so that both see the same load at each step); per run, the plain
    engine's CPU time over the MTP engine's (the tokens asserted equal)."""
    ratios = []
    for _ in range(runs):
        plain, mtp = engines(model, prompts, k, new)
        spent = {id(plain): 0.0, id(mtp): 0.0}
        while plain.has_unfinished() or mtp.has_unfinished():
            for engine in (plain, mtp):
                if engine.has_unfinished():
                    t0 = CLOCK()
                    engine.step()
                    spent[id(engine)] += CLOCK() - t0
        assert [r.generated for r in plain.requests.values()] == [r.generated for r in mtp.requests.values()]
        ratios.append(spent[id(plain)] / spent[id(mtp)])
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="backed-off steps timed (at most 63)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh pairs of engines, their steps pooled")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--runs", type=int, default=0,
                    help="instead: this many whole runs of --new tokens, plain and MTP steps interleaved")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--checkpoint", default=None,
                    help="load the trunk from this checkpoint (bench_mtp.py's --checkpoint) instead of building it")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from bench_mtp import PROMPT, copy_model
    from hebrus_torch.testing import random_mtp

    if args.checkpoint:
        from hebrus_torch.loading import from_pretrained

        model = from_pretrained(args.checkpoint)
        args.layers = model.config.num_hidden_layers
    else:
        model = copy_model(args.layers)
    model.mtp = random_mtp(model.config, 6)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, model.config.vocab_size, (PROMPT,), generator=g).tolist()
               for _ in range(args.requests)]
    if args.runs:
        with torch.inference_mode():
            interleaved_runs(model, prompts[:1], args.k, 4, 1)             # (warm-up)
            ratios = interleaved_runs(model, prompts, args.k, args.new, args.runs)
        print(f"{args.layers} layers, {args.requests} request(s), {args.new} tokens each, {args.runs} runs with the "
              f"steps interleaved: plain / MTP {statistics.median(ratios):.3f}x (median; quartiles "
              f"{' / '.join(f'{q:.3f}' for q in statistics.quantiles(ratios, n=4))})", flush=True)
        return
    steps = min(args.steps, 63)
    ratios, times = [], {"plain": [], "mtp": []}
    profiles = {"plain": cProfile.Profile(), "mtp": cProfile.Profile()} if args.profile else None
    ops = {}
    early: list[list] = [[] for _ in range(21)]
    with torch.inference_mode():
        for _ in range(args.rounds):
            plain, mtp = engines(model, prompts, args.k, 21 + steps + 4)
            for engine in (plain, mtp):
                engine.step()                       # the prefill
            for step in range(21):                  # decode steps 0..20: the MTP engine's 3 drafting rounds
                pair = []
                for engine in (plain, mtp):
                    t0 = CLOCK()
                    engine.step()
                    pair.append(CLOCK() - t0)
                early[step].append(pair)
            passes = mtp.mtp_drafter.passes
            for _ in range(steps):
                pair = []
                for name, engine in (("plain", plain), ("mtp", mtp)):
                    if profiles:
                        profiles[name].enable()
                    t0 = CLOCK()
                    engine.step()
                    pair.append(CLOCK() - t0)
                    if profiles:
                        profiles[name].disable()
                    times[name].append(pair[-1])
                ratios.append(pair[0] / pair[1])
            assert mtp.mtp_drafter.passes == passes, "the MTP engine drafted in the timed steps"
            for name, engine in (("plain", plain), ("mtp", mtp)):
                rec = OpNames()
                with rec:
                    engine.step()
                ops[name] = rec.names
    print(f"{args.layers} layers, {args.requests} request(s), {len(ratios)} backed-off steps: plain "
          f"{1e3 * statistics.median(times['plain']):.3f} ms, MTP {1e3 * statistics.median(times['mtp']):.3f} ms, "
          f"plain / MTP (median of pairs) {statistics.median(ratios):.3f}x")
    rounds = [step for step in range(21) if step in (0, 4, 20)]
    extra = {step: statistics.median(m - p for p, m in early[step]) for step in range(21)}
    print("decode steps 0..20, MTP - plain (ms, median of rounds):",
          " ".join(f"{s}:{1e3 * extra[s]:+.2f}" for s in range(21)))
    print(f"the 3 drafting rounds (steps {rounds}): {1e3 * sum(extra[s] for s in rounds):+.2f} ms in all; the "
          f"backed-off steps: {1e3 * (statistics.median(times['mtp']) - statistics.median(times['plain'])):+.3f} ms each")
    print(f"ops per step: plain {sum(ops['plain'].values())}, MTP {sum(ops['mtp'].values())}")
    extra = ops["mtp"] - ops["plain"]
    fewer = ops["plain"] - ops["mtp"]
    print("ops the MTP step adds:", dict(extra.most_common()))
    if fewer:
        print("ops the MTP step lacks:", dict(fewer.most_common()))
    if profiles:
        stats = {name: pstats.Stats(p) for name, p in profiles.items()}
        per = {name: {f"{fn[0].rsplit('/', 1)[-1]}:{fn[1]}({fn[2]})": v[2] for fn, v in s.stats.items()}
               for name, s in stats.items()}              # tottime per function
        diff = collections.Counter({f: per["mtp"].get(f, 0.0) - per["plain"].get(f, 0.0)
                                    for f in set(per["mtp"]) | set(per["plain"])})
        n = len(ratios)
        print("functions whose own time grows most (us per step, MTP - plain):")
        for f, d in diff.most_common(40):
            print(f"  {1e6 * d / n:8.1f}  {f}")


if __name__ == "__main__":
    main()

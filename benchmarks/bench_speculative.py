"""Speculative decoding (issue 26): the engine with and without it, side by side in one process.

Workloads, at 1, 8 and 64 requests arriving at once, greedy, prompt lookup drafting up to ``--k`` tokens:

- **copy**: a model whose answer repeats a passage its prompt quotes. Random weights never repeat
  text, so this is bench_engine.py's small Qwen4Exp with the outputs of its mixing paths (attention
  ``o_proj``, GDN ``out_proj``, MoE ``down_proj``, PLE ``value_proj``) scaled by LOCAL_SCALE: every path still
  runs, but the next token depends mostly on the last few. Each prompt is ``P + A + P``, A being the
  model's own greedy answer to a random P of 64 tokens (a conversation that asks again: the answer
  quotes the first one); A and the measured answer are ``--new`` tokens (64 by default).
- **random**: the same model on random prompts of 192 tokens: drafts only from chance n-gram matches.
- **never**: the same, with a drafter whose drafts are always rejected: what verification, rollback and
  the back-off cost where nothing is accepted.
- **random-model**: bench_engine.py's small model as it is (unscaled) on random prompts of 192 tokens.

Per row: tokens/s of the plain engine and with speculation (generated tokens / wall time of the whole
run), their ratio, median time to first token, acceptance (accepted / drafted), tokens per
verification row (accepted drafts + the target's token, per row), engine steps. Each configuration
runs ``--repeat`` times, plain and speculative interleaved (which goes first alternates); the ratio is
the median over the repeats of each pair's ratio (a pair runs back to back, so a slow spell of a shared
machine hits both), of wall time and of the process's CPU time (what other processes on the machine
take from a run's wall time does not count in its CPU time), with the pairs' range. The greedy tokens
of both paths are asserted equal. Results go to benchmarks/RESULTS.md.

    python benchmarks/bench_speculative.py [--counts 1,8,64] [--k 8] [--repeat 3] [--new 64] [--no-write]
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


LOCAL_SCALE = 0.01


def local_model() -> torch.nn.Module:
    """bench_engine.py's small model with its mixing paths' outputs scaled by LOCAL_SCALE."""
    from bench_engine import small_model

    model = small_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("o_proj", "out_proj", "down_proj", "value_proj")):
                p.mul_(LOCAL_SCALE)
    return model


def never_accepted(vocab: int):
    def draft(req, k):
        return [(req.tokens[-1] + 7 + j) % vocab for j in range(k)]
    return draft


def run(model, prompts, new: int, spec: SpeculativeConfig | None, drafter=None) -> dict:
    cfg = EngineConfig(capacity_tokens=65536, max_sequences=max(8, len(prompts)), max_batch_tokens=512,
                       speculative=spec or SpeculativeConfig(0))
    engine = Engine(model, cfg, drafter=drafter)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=new, eos_token_id=-1)
    engine.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    reqs = list(engine.requests.values())
    c = engine.counters
    return {"wall": wall, "cpu": cpu, "tokens": sum(len(r.generated) for r in reqs),
            "ttft": statistics.median(r.first_token_time - t0 for r in reqs),
            "drafted": c.spec_drafted_tokens, "accepted": c.spec_accepted_tokens, "rows": c.spec_verify_rows,
            "steps": c.steps, "out": {r.request_id: r.generated for r in reqs}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,8,64")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", default="copy,random,never,random-model")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="Speculative decoding (issue 26)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from bench_engine import small_model

    copier = local_model()
    vocab = copier.config.vocab_size
    counts = [int(x) for x in args.counts.split(",")]
    spec = SpeculativeConfig(args.k)
    rows = []
    g = torch.Generator().manual_seed(7)
    random_model = None
    for workload in args.workloads.split(","):
        for n in counts:
            drafter = None
            model, new = copier, args.new
            if workload == "copy":
                questions = [torch.randint(4, vocab, (64,), generator=g).tolist() for _ in range(n)]
                with torch.inference_mode():
                    answers = run(copier, questions, new, None)["out"]
                prompts = [q + answers[f"r{i}"] + q for i, q in enumerate(questions)]
            elif workload in ("random", "never"):
                prompts = [torch.randint(4, vocab, (192,), generator=g).tolist() for _ in range(n)]
                drafter = never_accepted(vocab) if workload == "never" else None
            else:
                random_model = random_model or small_model()
                model = random_model
                prompts = [torch.randint(4, vocab, (192,), generator=g).tolist() for _ in range(n)]
            with torch.inference_mode():
                run(model, prompts[:1], 4, spec, drafter)                            # warm-up
                results = {"plain": [], "spec": []}
                for i in range(args.repeat):            # the order alternates: neither path always goes first
                    for path in (("plain", "spec") if i % 2 == 0 else ("spec", "plain")):
                        results[path].append(run(model, prompts, new, spec if path == "spec" else None,
                                                 drafter if path == "spec" else None))
            plain, sp = results["plain"], results["spec"]
            assert all(r["out"] == plain[0]["out"] for r in plain + sp), "speculation changed greedy tokens"
            tps = {k: statistics.median(r["tokens"] / r["wall"] for r in v) for k, v in results.items()}
            ttft = {k: statistics.median(r["ttft"] for r in v) for k, v in results.items()}
            ratio = {}
            for clock in ("wall", "cpu"):           # each pair's spec / plain tokens per second
                pairs = sorted(a[clock] / b[clock] for a, b in zip(plain, sp))
                ratio[clock] = f"{statistics.median(pairs):.2f}x ({pairs[0]:.2f}-{pairs[-1]:.2f})"
            last = sp[-1]
            acc = last["accepted"] / last["drafted"] if last["drafted"] else 0.0
            per_row = (last["accepted"] + last["rows"]) / last["rows"] if last["rows"] else 0.0
            rows.append([workload, str(n), f"{tps['plain']:.1f}", f"{tps['spec']:.1f}",
                         ratio["wall"], ratio["cpu"], f"{ttft['plain'] * 1e3:.0f} / {ttft['spec'] * 1e3:.0f} ms",
                         f"{acc:.2f} ({last['accepted']} / {last['drafted']})", f"{per_row:.2f}",
                         f"{plain[-1]['steps']} / {last['steps']}"])
            print(rows[-1], flush=True)
    text = (f"`python benchmarks/bench_speculative.py --counts {args.counts} --k {args.k} --repeat {args.repeat} "
            f"--new {args.new} --threads {args.threads} --workloads {args.workloads}`, {time.strftime('%Y-%m-%d')}: "
            f"{machine()}, load average at the end "
            f"{os.getloadavg()[0]:.1f}.\n"
            f"Models: bench_engine.py's small random Qwen4Exp (4 layers: GDN, indexed attention, PLE, 8 experts; "
            f"vocab 4096, fp32), for copy / random / never with its mixing paths' outputs scaled by "
            f"{LOCAL_SCALE} (the module docstring says why), for random-model as it is. Copy prompts: P + A + P "
            f"(P random, 64 tokens; A the model's greedy answer to P, {args.new} tokens); random prompts: 192 random "
            f"tokens; {args.new} tokens generated per request. Engine: capacity 65536, max_batch_tokens 512, greedy, "
            f"prompt lookup up to {args.k} drafts per step with the adaptive length (never = a drafter whose "
            f"drafts are always rejected). Every request arrives at once; tokens/s = generated tokens / wall time "
            f"of the whole run, median of {args.repeat} runs, plain and speculative interleaved (which goes first "
            f"alternates); spec / plain = the median of the {args.repeat} back-to-back pairs' ratios of wall time and "
            f"of the process's CPU time (the pairs' range in brackets); TTFT median over "
            f"requests; acceptance and tokens per verification row from the last speculative run; steps = engine "
            f"steps plain / speculative. The greedy tokens of both paths are asserted equal in every run.\n\n")
    text += table(["workload", "requests", "plain tok/s", "spec tok/s", "spec / plain (wall)", "spec / plain (CPU)",
                   "TTFT plain / spec",
                   "acceptance", "tokens per verification", "steps"], rows)
    print(text)
    if not args.no_write:
        write_section(args.section, text)


if __name__ == "__main__":
    main()

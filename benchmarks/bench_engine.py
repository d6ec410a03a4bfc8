"""Continuous batching (hebrus_torch.engine) against transformers' generate, on a small random Qwen4Exp.

For 1, 4, 16 and 64 concurrent requests of mixed prompt lengths (64-4096), all arriving at once:
generated tokens per second and time to first token of

- the engine (``Engine.step`` loop, chunked prefill under ``max_batch_tokens``),
- sequential ``model.generate`` per prompt, unpatched and patched (``hx.apply``),
- padded-batch ``model.generate`` of all prompts at once (left padding), unpatched and patched,
  where its memory (eager/sdpa masks and scores of [N, heads, L, L]) fits,

then the saving of prefix sharing on requests with a common 1024-token prefix, and where the engine's
step time goes. Every request generates exactly ``--new`` tokens (no EOS). One run, one process;
every baseline is run in the same process after the engine. Results go to benchmarks/RESULTS.md.

    python benchmarks/bench_engine.py [--counts 1,4,16,64] [--new 16] [--quick] [--section TITLE]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, table, write_section  # noqa: E402

import hebrus_torch  # noqa: E402,F401
from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402
from hebrus_torch.integrations import transformers as htx  # noqa: E402

LENGTHS = [64, 4096, 256, 1024, 128, 2048, 512, 96, 768, 3072, 192, 1536, 384, 64, 2560, 640]
MEMORY_LIMIT = 6 << 30      # padded-batch generate is skipped when its attention scores alone would pass this


def small_model(seed: int = 0, **overrides) -> torch.nn.Module:
    """The benchmarks' small random Qwen4Exp (hidden 256, 4 layers); ``overrides``: config fields."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=4,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, ple_layer_ids=[1, 3], ple_embed_dim=128,
        eos_token_id=3, hc_count=2, hc_lowrank=32, ngram_vocab_size_base=4096, indexer_n_heads=4,
        indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=512, indexer_compress_ratio=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        max_position_embeddings=8192)
    fields.update(overrides)
    config = Qwen4ExpTextConfig(**fields)
    model = modeling.Qwen4ExpForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv1d" in name or "norm" in name:
                p.normal_(0, 0.1)
    return model


def prompts_of(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (LENGTHS[i % len(LENGTHS)],), generator=g).tolist() for i in range(n)]


class FirstToken:
    """A generate streamer that records when the first new token comes out."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:   # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_engine(model, prompts, new, **config):
    cfg = dict(capacity_tokens=sum(len(p) + new for p in prompts) + 64, max_sequences=max(1, len(prompts)),
               max_batch_tokens=512, block_size=256)
    cfg.update(config)
    engine = Engine(model, EngineConfig(**cfg))
    engine.runner.timings = collections.Counter()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=new, eos_token_id=-1)
    with torch.inference_mode():
        engine.run()
    wall = time.perf_counter() - t0
    reqs = list(engine.requests.values())
    assert all(len(r.generated) == new for r in reqs)
    ttft = [r.first_token_time - t0 for r in reqs]
    return dict(wall=wall, tokens=new * len(prompts), ttft=ttft, engine=engine,
                outputs=[r.generated for r in reqs])


def run_sequential(model, prompts, new):
    t0 = time.perf_counter()
    ttft, outputs = [], []
    with torch.inference_mode():
        for p in prompts:
            s = FirstToken()
            out = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, streamer=s)
            ttft.append(s.first - t0)
            outputs.append(out[0, len(p):].tolist())
    return dict(wall=time.perf_counter() - t0, tokens=new * len(prompts), ttft=ttft, outputs=outputs)


def padded_fits(model, prompts) -> bool:
    c = model.config
    length = max(len(p) for p in prompts)
    return len(prompts) * c.num_attention_heads * length * length * 4 <= MEMORY_LIMIT


def run_padded(model, prompts, new):
    length = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), length), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.tensor(p)
        mask[i, length - len(p):] = 1
    s = FirstToken()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       eos_token_id=None, pad_token_id=0, streamer=s)
    wall = time.perf_counter() - t0
    return dict(wall=wall, tokens=new * len(prompts), ttft=[s.first - t0] * len(prompts))


def fmt(result) -> tuple[str, str, str]:
    tps = result["tokens"] / result["wall"]
    return f"{tps:.1f}", f"{statistics.median(result['ttft']):.2f}", f"{result['wall']:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,4,16,64")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="counts 1,4 and 4 new tokens (a smoke run)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="Continuous batching: engine vs generate (issue 17)",
                    help="the RESULTS.md section the run writes (one per workload, e.g. per --new)")
    ap.add_argument("--unpatched-limit", type=int, default=6000,
                    help="skip unpatched generate when the prompts hold more tokens than this (transformers' "
                         "indexer loops over queries in Python: minutes per thousand tokens here)")
    ap.add_argument("--no-sharing", action="store_true", help="skip the prefix-sharing section")
    ap.add_argument("--no-patched-baselines", action="store_true",
                    help="skip generate of the patched model (its rows say so): long decode-heavy runs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every path (default 1: a small "
                    "model is many small ops, and threads only add synchronisation on a shared 2-core machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counts = [1, 4] if args.quick else [int(c) for c in args.counts.split(",")]
    new = 4 if args.quick else args.new
    model = small_model()
    vocab = model.config.vocab_size
    rows, breakdown, agree = [], None, []
    for n in counts:
        prompts = prompts_of(n, vocab)
        eng = run_engine(model, prompts, new)
        unpatched = sum(len(p) for p in prompts) <= args.unpatched_limit
        seq = run_sequential(model, prompts, new) if unpatched else None
        seq_p = pad_p = None
        if not args.no_patched_baselines:
            htx.apply(model)
            try:
                seq_p = run_sequential(model, prompts, new)
                pad_p = run_padded(model, prompts, new) if padded_fits(model, prompts) else None
            finally:
                htx.revert(model)
        pad = run_padded(model, prompts, new) if unpatched and padded_fits(model, prompts) else None
        ref = seq if seq is not None else seq_p
        if ref is None:
            agree.append(f"{n}: no generate ran")
        else:
            same = sum(a == b for a, b in zip(eng["outputs"], ref["outputs"]))
            agree.append(f"{n}: {same}/{n}" + ("" if seq is not None else " (vs patched)"))
        e_tps = eng["tokens"] / eng["wall"]
        lengths = [len(p) for p in prompts]
        for name, r in (("engine", eng), ("sequential generate", seq), ("sequential generate, patched", seq_p),
                        ("padded generate", pad), ("padded generate, patched", pad_p)):
            if r is None:
                why = ("not run (prompts over --unpatched-limit tokens)" if "patched" not in name and not unpatched
                       else "not run (--no-patched-baselines)" if "patched" in name and args.no_patched_baselines
                       else "not run (its [N, heads, L, L] scores exceed 6 GiB)")
                rows.append([str(n), name, why, "", "", ""])
                continue
            tps, ttft, wall = fmt(r)
            ratio = "1.00" if r is eng else f"{e_tps / (r['tokens'] / r['wall']):.2f}"
            rows.append([str(n), name, tps, ttft, wall, ratio])
        rows[-5][0] = f"{n} (prompts {min(lengths)}-{max(lengths)}, {sum(lengths)} tokens)"
        if breakdown is None or n >= 16:
            engine = eng["engine"]
            parts = dict(engine.runner.timings)
            model_s = engine.counters.model_seconds
            parts["other model work (embedding, lm_head, packing, transaction)"] = model_s - sum(parts.values())
            parts["scheduler, sampling, bookkeeping"] = engine.counters.step_seconds - model_s
            breakdown = (n, engine.counters.step_seconds, parts, engine.counters.steps)
        print(table(["requests", "path", "generated tok/s", "TTFT median (s)", "wall (s)", "engine x"], rows),
              flush=True)

    # Prefix sharing: 8 requests with a common 1024-token prefix and 64 tokens of their own.
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(4, vocab, (1024,), generator=g).tolist()
    sharing = [shared + torch.randint(4, vocab, (64,), generator=g).tolist() for _ in range(8)]
    pre_rows = []
    for on in (() if args.no_sharing else (False, True)):
        r = run_engine(model, sharing, new, allow_block_sharing=on)
        c = r["engine"].counters
        pre_rows.append(["on" if on else "off", str(c.prefill_tokens), str(c.prefix_hit_tokens),
                         f"{r['wall']:.1f}", f"{statistics.median(r['ttft']):.2f}",
                         f"{r['tokens'] / r['wall']:.1f}"])

    n, total, parts, steps = breakdown
    body = [
        f"Machine: {machine()}. Model: random Qwen4Exp, hidden 256, 4 layers (linear, indexed, linear, indexed), "
        f"PLE on layers 1 and 3, 8 experts top-2, indexer budget 512 (r 4), fp32, vocab 4096. Every request "
        f"generates {new} tokens, greedy; all arrive at once. Engine: max_batch_tokens 512, block 256, "
        f"max_sequences = requests. TTFT is the median over requests from the common start. Ratio: engine "
        f"tokens/s over the row's.",
        "",
        table(["requests", "path", "generated tok/s", "TTFT median (s)", "wall (s)", "engine x"], rows),
        "",
        f"Engine tokens equal to sequential generate (unpatched where it ran), per count: {', '.join(agree)} (greedy; a "
        f"difference is a near tie between BLAS row counts, SPEC §8).",
        "",
    ]
    if pre_rows:
        body += [
            f"Prefix sharing, 8 requests of a common 1024-token prefix + 64 own tokens, block 256, {new} new tokens:",
            "",
            table(["sharing", "prefill tokens run", "prefix tokens reused", "wall (s)", "TTFT median (s)",
                   "generated tok/s"], pre_rows),
            "",
        ]
    body += [
        f"Where the engine's time goes ({n} requests, {steps} steps, {total:.1f} s of steps; host wall time):",
        "",
        table(["part", "seconds", "share"], [[k, f"{v:.2f}", f"{100 * v / total:.0f}%"]
                                            for k, v in sorted(parts.items(), key=lambda kv: -kv[1])]),
    ]
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        write_section(args.section, text)


if __name__ == "__main__":
    main()

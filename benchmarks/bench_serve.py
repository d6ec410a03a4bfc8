"""Serving benchmark (issue 18): ``python -m hebrus_torch.serve`` against transformers serve without
continuous batching, on the patched model, over loopback with the ``openai`` client.

- time to first token (TTFT) of a chat's first turn and of its second turn, with the hebrus prefix cache on
  and off, and on transformers serve's one-request-at-a-time ``generate`` path;
- streaming throughput (generated tokens per second over all clients) with 1, 8 and 32 concurrent clients;
- with a chat template that renders earlier assistant turns differently from what was generated (the
  second turn's prompt then extends the first turn's prompt only), the fraction of the second turn taken
  from the prefix cache (block-boundary hits) at two block sizes.

Run: ``python benchmarks/bench_serve.py [--quick] [--no-write]``; appends a section to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import test_serve as ts  # noqa: E402  (the tests' model, tokenizer and server helpers)
from common import RESULTS  # noqa: E402

# earlier assistant turns rendered with a marker the generation prompt does not have (as templates that drop
# earlier turns' reasoning do): the second prompt diverges from the first turn's tokens where the reply starts
RERENDER_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} "
                     "{% if m['role'] == 'assistant' %}w0 {% endif %}{{ m['content'] }} <|im_end|> {% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(ts.WORDS[1:]) for _ in range(n))


def stream(srv: ts.Server, messages, max_tokens: int) -> tuple[float, str, int, float]:
    """(seconds to the first content chunk, text, completion tokens, total seconds) of one streamed chat."""
    t0 = time.perf_counter()
    first, parts, tokens = None, [], 0
    for chunk in srv.chat(messages, max_tokens=max_tokens, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return (first if first is not None else total), "".join(parts), tokens, total


def two_turns(srv: ts.Server, seed: int, first_words: int, second_words: int, reply: int):
    rng = random.Random(seed)
    m1 = [{"role": "user", "content": words(rng, first_words)}]
    t1, text1, _, _ = stream(srv, m1, reply)
    m2 = m1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": words(rng, second_words)}]
    s0 = srv.settled_stats() if srv.hebrus else None
    t2, _, _, _ = stream(srv, m2, reply)
    hit = None
    if srv.hebrus:
        s1 = srv.settled_stats()
        hit = s1["counters"]["prefix_hit_tokens"] - s0["counters"]["prefix_hit_tokens"]
    return t1, t2, hit, len(ts.prompt_ids(srv.tokenizer, m2))


def throughput(srv: ts.Server, clients: int, max_tokens: int, prompt_words: int, seed: int) -> float:
    rng = random.Random(seed)
    rounds = 4 if clients == 1 else 1
    prompts = [[{"role": "user", "content": words(rng, prompt_words)}] for _ in range(clients * rounds)]

    def client(i: int) -> int:
        return sum(stream(srv, prompts[i * rounds + r], max_tokens)[2] for r in range(rounds))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client, range(clients)))
    return tokens / (time.perf_counter() - t0)


def start(model_dir: Path, tokenizer, log: Path, *args: str, hebrus: bool = True) -> ts.Server:
    srv = ts.Server(model_dir, *args, log=log)
    srv.__enter__()
    srv.hebrus, srv.tokenizer = hebrus, tokenizer
    stream(srv, [{"role": "user", "content": "w1 w2 w3"}], 4)     # warm-up (builds the engine)
    return srv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer and shorter runs")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--first-words", type=int, default=None, help="words of the first user message (400)")
    ap.add_argument("--ttft-only", action="store_true", help="only the time-to-first-token table")
    args = ap.parse_args()
    first_words, second_words, reply = (200, 16, 8) if args.quick else (400, 20, 16)
    first_words = args.first_words or first_words
    conversations = 2 if args.quick else 3
    levels = (1, 8) if args.quick else (1, 8, 32)
    tp_tokens, tp_words = (16, 16) if args.quick else (64, 32)

    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    model, tokenizer = ts.make_model(), ts.make_tokenizer()
    model_dir = ts.save_checkpoint(tmp / "model", model, tokenizer)
    rerender_dir = ts.save_checkpoint(tmp / "model-rerender", model, ts.make_tokenizer(RERENDER_TEMPLATE))
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    configs = [
        ("hebrus engine, prefix cache on", ["--hebrus-capacity-tokens", "8192"], True),
        ("hebrus engine, prefix cache off", ["--hebrus-capacity-tokens", "8192", "--hebrus-prefix-cache-tokens", "0"],
         True),
        ("transformers serve, no continuous batching (patched model)", ["--no-continuous-batching"], False),
    ]
    rows_ttft, rows_tp = [], []
    for name, extra, hebrus in configs:
        srv = start(model_dir, tokenizer, tmp / f"{len(rows_ttft)}.log", *extra, hebrus=hebrus)
        try:
            runs = [two_turns(srv, 100 + i, first_words, second_words, reply) for i in range(conversations)]
            t1 = statistics.median(r[0] for r in runs)
            t2 = statistics.median(r[1] for r in runs)
            hits = [r[2] for r in runs]
            frac = (f"{statistics.median(h / r[3] for h, r in zip(hits, runs)):.0%}" if hebrus else "n/a")
            rows_ttft.append((name, t1, t2, frac))
            tps = {} if args.ttft_only else {c: throughput(srv, c, tp_tokens, tp_words, seed=200 + c) for c in levels}
            rows_tp.append((name, tps))
            print(name, f"ttft {t1 * 1e3:.0f} / {t2 * 1e3:.0f} ms reused {frac}",
                  {c: f"{v:.1f}" for c, v in tps.items()}, flush=True)
        finally:
            srv.stop()

    rerender = []
    for block in () if args.ttft_only else (16, 64, 256):
        srv = start(rerender_dir, ts.make_tokenizer(RERENDER_TEMPLATE), tmp / f"rr{block}.log",
                    "--hebrus-capacity-tokens", "8192", "--cb-block-size", str(block))
        try:
            runs = [two_turns(srv, 300 + i, first_words, second_words, reply) for i in range(conversations)]
            rerender.append((block, statistics.median(r[2] / r[3] for r in runs),
                             statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)))
            print("rerender block", block, rerender[-1], flush=True)
        finally:
            srv.stop()

    cfg = model.config
    lines = [
        "", "## Serving through transformers serve (issue 18)" + (", long first turn" if args.ttft_only else ""),
        "`python benchmarks/bench_serve.py" + "".join(f" {a}" for a in sys.argv[1:] if a != "--no-write")
        + f"`, {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores shared with other work "
        f"(load average at the end {os.getloadavg()[0]:.1f}), torch {torch.__version__}, each server a subprocess "
        f"with OMP_NUM_THREADS={threads}, `--device cpu`, fp32; clients are `openai` streaming chat completions over "
        "loopback from the same machine (their threads compete for the same 2 cores).",
        f"Model: random tiny Qwen4Exp ({cfg.num_hidden_layers} layers {cfg.layer_types}, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}, {sum(p.numel() for p in model.parameters()) / 1e3:.0f}K parameters), greedy, "
        "word-level tokenizer with a ChatML-like template; hebrus servers: `--hebrus-capacity-tokens 8192`, "
        "transformers' default page size (256) and `max_batch_tokens` (512).",
        "",
        f"Time to first token, median of {conversations} chats: turn 1 is a {first_words}-word user message "
        f"({first_words + 7} prompt tokens), {reply}-token reply; turn 2 adds that reply and a {second_words}-word "
        "message. Reused: the second turn's prompt tokens taken from the prefix cache "
        "(`/hebrus/stats` prefix_hit_tokens).",
        "", "| server | turn 1 TTFT | turn 2 TTFT | turn 2 reused |", "|---|---|---|---|",
    ]
    lines += [f"| {n} | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | {f} |" for n, a, b, f in rows_ttft]
    if args.ttft_only:
        lines = lines + [""]
        text = "\n".join(lines) + "\n"
        print(text)
        if not args.no_write:
            with open(RESULTS, "a") as f:
                f.write(text)
        return
    lines += ["", f"Streaming throughput, generated tokens per second over all clients ({tp_words}-word prompts, "
              f"up to {tp_tokens} tokens each, EOS may end a reply earlier; 1 client: 4 requests in a row):", "",
              "| server | " + " | ".join(f"{c} client{'s' if c > 1 else ''}" for c in levels) + " |",
              "|---|" + "---|" * len(levels)]
    lines += [f"| {n} | " + " | ".join(f"{t[c]:.1f}" for c in levels) + " |" for n, t in rows_tp]
    lines += ["", "A template that renders earlier assistant turns differently from the generated tokens (an extra "
              "`w0` before each earlier reply): the second turn extends only the first turn's prompt, and only "
              "whole blocks of it are reused (hebrus engine, prefix cache on):", "",
              "| block size (`--cb-block-size`) | turn 2 reused | turn 1 TTFT | turn 2 TTFT |", "|---|---|---|---|"]
    lines += [f"| {b} | {f:.0%} | {a * 1e3:.0f} ms | {c * 1e3:.0f} ms |" for b, f, a, c in rerender]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        with open(RESULTS, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()

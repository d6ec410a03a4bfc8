"""The prompt cache across restarts (issue 27): a chat's second turn after a restart, warm files vs cold.

For turn-1 prompts of several lengths on bench_engine.py's small random Qwen4Exp: an engine with a
``prompt_cache_dir`` serves turn 1 (``--reply`` new tokens) and is closed, as a server process ends.
Then turn 2 (turn 1's prompt + reply + ``--message`` new tokens) is sent to

- a new engine on the same directory (warm: turn 1's state is restored from its file),
- a new engine without a directory (cold: the whole conversation is prefilled),
- and, for reference, the engine that served turn 1 kept alive (its in-memory prefix cache),

and its time to first token is measured (from ``add_request`` to the first sampled token; engine
start, with the scan of the directory and the model fingerprint, is timed apart). Median of
``--repeat`` rounds, the paths interleaved within each round. One process; results go to
benchmarks/RESULTS.md.

    python benchmarks/bench_prompt_cache.py [--lengths 512,2048,4096] [--repeat 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import small_model  # noqa: E402
from common import machine, table, write_section  # noqa: E402

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402


def first_token_seconds(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds from add_request to the first token, prompt tokens taken from a prefix) of one request."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, max_new_tokens=1, eos_token_id=-1)
    req = engine.requests[rid]
    while req.first_token_time < 0:
        engine.step()
    return req.first_token_time - t0, req.prefix_hit_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--reply", type=int, default=16, help="turn 1's generated tokens")
    ap.add_argument("--message", type=int, default=64, help="turn 2's new tokens after the reply")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="Prompt cache across restarts (issue 27)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = small_model()
    cfg = dict(capacity_tokens=16384, max_sequences=8, max_batch_tokens=512, block_size=64)
    g = torch.Generator().manual_seed(1)
    rows, notes = [], []
    with torch.inference_mode():
        warmup = Engine(model, EngineConfig(**cfg))
        first_token_seconds(warmup, torch.randint(4, 4096, (600,), generator=g).tolist())
        for n in lengths:
            times = {"warm": [], "cold": [], "memory": []}
            starts = {"warm": [], "cold": []}
            hits, file_bytes, write_s = {}, 0, []
            for _ in range(args.repeat):
                turn1 = torch.randint(4, 4096, (n,), generator=g).tolist()
                directory = tempfile.mkdtemp(prefix="bench-prompt-cache-")
                first = Engine(model, EngineConfig(**cfg, prompt_cache_dir=directory))
                first.add_request(turn1, request_id="t1", max_new_tokens=args.reply, eos_token_id=-1)
                first.run()
                write_s.append(first.counters.prompt_cache_seconds)
                file_bytes = first.prompt_cache.total_bytes
                first.close()
                turn2 = turn1 + first.requests["t1"].generated + torch.randint(
                    4, 4096, (args.message,), generator=g).tolist()
                for path in ("warm", "cold", "memory"):
                    t0 = time.perf_counter()
                    if path == "memory":
                        engine = first
                    else:
                        engine = Engine(model, EngineConfig(**cfg, prompt_cache_dir=directory if path == "warm"
                                                            else None))
                        starts[path].append(time.perf_counter() - t0)
                    seconds, hit = first_token_seconds(engine, turn2)
                    times[path].append(seconds)
                    hits[path] = hit
                    engine.close()
                for name in os.listdir(directory):
                    os.unlink(os.path.join(directory, name))
                os.rmdir(directory)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append([str(n), str(len(turn2)), f"{med['warm'] * 1e3:.1f} ms", f"{med['cold'] * 1e3:.1f} ms",
                         f"{med['cold'] / med['warm']:.1f}x", f"{med['memory'] * 1e3:.1f} ms",
                         f"{hits['warm']} / {hits['memory']}", f"{file_bytes / 2**20:.2f} MiB",
                         f"{statistics.median(write_s) * 1e3:.1f} ms",
                         f"{statistics.median(starts['warm']) * 1e3:.0f} / "
                         f"{statistics.median(starts['cold']) * 1e3:.0f} ms"])
            print(rows[-1], flush=True)
    params = sum(p.numel() for p in model.parameters())
    text = (f"`python benchmarks/bench_prompt_cache.py --lengths {args.lengths} --repeat {args.repeat} --threads "
            f"{args.threads}`, {time.strftime('%Y-%m-%d')}: {machine()}, load average at the end "
            f"{os.getloadavg()[0]:.1f}.\n"
            f"Model: bench_engine.py's small random Qwen4Exp ({params / 1e6:.1f}M parameters, 4 layers, fp32), "
            f"engine capacity {cfg['capacity_tokens']}, max_batch_tokens {cfg['max_batch_tokens']}, block size "
            f"{cfg['block_size']}; the prompt-cache directory on the local disk ({tempfile.gettempdir()}).\n\n"
            f"Turn 1: a prompt of N random tokens, {args.reply} generated; turn 2: turn 1's prompt + reply + "
            f"{args.message} new tokens, sent to a new engine after the first was closed (a restart). Time to "
            f"first token of turn 2 (from add_request to the first token), median of {args.repeat} rounds, the "
            f"paths interleaved: warm = a new engine on turn 1's directory (the state restored from the file: "
            f"read, both checksums, ModelCache.restore), cold = a new engine without one (the whole "
            f"conversation prefilled), in memory = the engine that served turn 1, never stopped. Reused: turn 2's "
            f"prompt tokens taken from the file / from memory. Turn 1's write: ModelCache.save, the file written "
            f"and fsynced, at its finish. Engine start: Engine() with / without the directory (model fingerprint "
            f"and directory scan).\n\n")
    text += table(["N", "turn 2 prompt", "warm TTFT", "cold TTFT", "cold / warm", "in-memory TTFT",
                   "reused (file / memory)", "file", "turn 1 write", "engine start (warm / cold)"], rows)
    print(text)
    if not args.no_write:
        write_section(args.section, text)


if __name__ == "__main__":
    main()

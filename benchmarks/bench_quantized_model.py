"""The whole benchmark model at bf16, 8-bit and 4-bit (issue 36): a checkpoint of the released shapes per layer
(benchmarks/bench_ple_disk.py's ``released_shapes``: hidden 2560, experts x 640 with top 10, 4 layers, fewer
experts, vocabulary 32768) written once, converted by ``python -m hebrus_torch.convert`` (group 64), then each
loaded by ``hebrus_torch.from_pretrained`` in its own process: size on disk, resident memory after loading
(anonymous RSS), and the engine's decode tokens/s at 1 and 8 requests.

    python benchmarks/bench_quantized_model.py --dir /tmp/hebrus-quant-bench [--experts 32] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

SECTION = "Whole model at bf16 / 8-bit / 4-bit (issue 36)"


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def one(path: Path, tokens: int) -> dict:
    """In this process: load, memory, decode rates."""
    import hebrus_torch
    from bench_ple_disk import decode_rate, status

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    t0 = time.perf_counter()
    model = hebrus_torch.from_pretrained(path, ple_table="memory")
    load_s = time.perf_counter() - t0
    loaded = status()
    with torch.inference_mode():
        decode_rate(model, 1, 2, 0)                                     # warm-up
        rates = {n: decode_rate(model, n, tokens, n) for n in (1, 8)}
    return {"load_s": load_s, "rss_anon": loaded["RssAnon"], "rates": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hebrus-quant-bench"))
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.tokens)))
        return
    from bench_ple_disk import released_shapes
    from common import machine, table, write_section

    from hebrus_torch.convert import convert
    from hebrus_torch.testing import write_checkpoint

    src = args.dir / f"bf16-e{args.experts}"
    if not src.exists():
        write_checkpoint(src, released_shapes(args.experts, 1000), seed=0, dtype=torch.bfloat16,
                         max_shard_size="2GB", tokenizer=False, mtp=False)
    dirs = {"bf16": src}
    for bits in (8, 4):
        dst = args.dir / f"q{bits}-e{args.experts}"
        if not dst.exists():
            t0 = time.perf_counter()
            convert(src, dst, bits=bits, group_size=64)
            print(f"converted {bits}-bit in {time.perf_counter() - t0:.1f} s", flush=True)
        dirs[f"{bits}-bit g64"] = dst
    load = os.getloadavg()[0]
    rows = []
    base = None
    for name, path in dirs.items():
        done = subprocess.run([sys.executable, __file__, "--one", str(path), "--tokens", str(args.tokens)],
                              capture_output=True, text=True, check=True, timeout=1800)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        base = base or r
        rows.append([name, f"{dir_bytes(path) / 2**20:.0f}", f"{r['rss_anon'] / 2**20:.0f}",
                     f"{r['rates']['1']:.2f}", f"{r['rates']['8']:.2f}",
                     f"{r['rates']['1'] / base['rates']['1']:.2f}x", f"{r['load_s']:.1f}"])
        print(" | ".join(rows[-1]), flush=True)
    body = (f"Machine: {machine()}. `python benchmarks/bench_quantized_model.py --experts {args.experts} --tokens "
            f"{args.tokens}`. The released shapes per layer (bench_ple_disk.py's config: 4 layers, 3 linear + 1 "
            f"indexed, {args.experts} experts, vocabulary 32768, one PLE layer with a small table), bf16 weights "
            f"and activations, converted with group 64 (lm_head and embeddings kept in bf16). Each variant in a "
            f"process of its own, 2 threads: checkpoint size, anonymous RSS after loading, engine decode tokens/s "
            f"(32-token prompts, {args.tokens} new tokens, steps past the prompts) at 1 and 8 requests. Load "
            f"average at the start: {load:.1f}.\n\n")
    body += table(["weights", "on disk MiB", "RSS after load MiB", "tok/s 1 req", "tok/s 8 req", "1 req vs bf16",
                   "load s"], rows)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()

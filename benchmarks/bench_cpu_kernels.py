"""The CPU kernels' time at the released layer's expert shapes, and one engine prefill, for comparing two trees (issue 37).

Cases, each the median CPU time (one thread) of ``--rounds`` calls:

- ``hebrus::moe_experts`` at hidden 2560, intermediate 640, top 10 of 16 experts: fp32 at 512 rows, bf16 and fp16 at 1
  and 64 rows (a row reads its 10 experts: 196 MB in fp32, 98 MB in 16 bits);
- the engine's prefill of one 512-token random prompt in one chunk on ``profile_engine_decode.llamacpp_variant``
  (the first prefill, which warms the process, not counted);
- a decode step's dense projection, 1 and 8 rows of a [4096, 256] fp32 weight (the small model's ``lm_head``) read
  from DRAM (48 such weights, 201 MB, used in turn): ``hebrus::dense_projection`` (the row kernel, where the tree
  has it) and ``F.linear`` (ATen's mm), each as the mean over the 48 calls and in GB/s of weight read.

The ``hebrus_torch`` timed is whichever ``PYTHONPATH`` names first: run the script alternately with each tree first so
that a shared machine's drift falls on both alike (benchmarks/RESULTS.md, "Accumulators of the AVX2 clones"):

    PYTHONPATH=<tree A> python benchmarks/bench_cpu_kernels.py
    PYTHONPATH=<tree B> python benchmarks/bench_cpu_kernels.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

EXPERTS, INTER, HIDDEN, TOP_K = 16, 640, 2560, 10


def cpu_time(fn, rounds: int) -> float:
    """Median CPU seconds of ``rounds`` calls of fn()."""
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def experts_case(dtype: torch.dtype, rows: int, rounds: int) -> float:
    import hebrus_torch

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.02).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.04).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(rows)])
    weights = torch.rand(rows, TOP_K, generator=g).to(dtype)
    return cpu_time(lambda: hebrus_torch.moe_experts(x, ids, weights, gate_up, down), rounds)


def projection_case(rows: int, rounds: int) -> tuple[float | None, float]:
    """Mean seconds of one projection (rows of x against a cold [4096, 256] weight): dense_projection (None where
    the tree has no such op), F.linear."""
    import torch.nn.functional as F

    import hebrus_torch  # noqa: F401  (registers the ops)

    g = torch.Generator().manual_seed(rows)
    weights = [torch.randn(4096, 256, generator=g) for _ in range(48)]
    x = torch.randn(rows, 256, generator=g)
    op = getattr(torch.ops.hebrus, "dense_projection", None)

    def each(fn):
        return lambda: [fn(x, w) for w in weights]

    with torch.inference_mode():
        ours = None if op is None else cpu_time(each(op.default), rounds) / len(weights)
        return ours, cpu_time(each(F.linear), rounds) / len(weights)


def prefill_case(tokens: int, rounds: int) -> float:
    from hebrus_torch.engine import Engine, EngineConfig
    from profile_engine_decode import llamacpp_variant

    model = llamacpp_variant()
    rng = random.Random(0)

    def prefill() -> None:
        engine = Engine(model, EngineConfig(capacity_tokens=2 * tokens, max_sequences=1, max_batch_tokens=tokens,
                                            block_size=256))
        engine.add_request([rng.randrange(model.config.vocab_size) for _ in range(tokens)], request_id="r",
                           max_new_tokens=1, eos_token_id=-1)
        engine.step()

    with torch.inference_mode():
        prefill()                                    # (warms the process)
        return cpu_time(prefill, rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import hebrus_torch

    print(f"hebrus_torch from {os.path.dirname(hebrus_torch.__file__)}, torch {torch.__version__}, one thread")
    for dtype, rows in ((torch.float32, 512), (torch.bfloat16, 1), (torch.bfloat16, 64), (torch.float16, 1),
                        (torch.float16, 64)):
        seconds = experts_case(dtype, rows, args.rounds)
        print(f"moe_experts {str(dtype).removeprefix('torch.')}, {rows} rows: {seconds * 1e3:.1f} ms")
    print(f"engine prefill, {args.tokens} tokens: {prefill_case(args.tokens, args.rounds) * 1e3:.1f} ms")
    megabytes = 4096 * 256 * 4 / 1e6
    for rows in (1, 8):
        ours, aten = projection_case(rows, args.rounds)
        mine = "-" if ours is None else f"{ours * 1e6:.0f} us ({megabytes / ours / 1e3:.1f} GB/s)"
        print(f"dense projection, {rows} rows, cold [4096, 256] fp32: dense_projection {mine}, F.linear "
              f"{aten * 1e6:.0f} us ({megabytes / aten / 1e3:.1f} GB/s)")


if __name__ == "__main__":
    main()

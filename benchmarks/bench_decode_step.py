"""The engine's decode step at 1, 16 and 64 requests on CPU, for comparing two trees side by side (issue 37).

The model is ``profile_engine_decode.llamacpp_variant`` (the small random Qwen4Exp llama.cpp can convert), fp32, one
thread. ``N`` requests of a 64-token random prompt each are admitted and prefilled; after 4 steps, the median CPU
time of the next ``--steps`` steps (every request decoding one token) is printed, one line per count, labelled
``--label``. The ``hebrus_torch`` imported is whichever ``PYTHONPATH`` names first, so two builds are compared by
running this script alternately with each tree first on ``PYTHONPATH`` (a shared machine's drift then hits both
alike):

    PYTHONPATH=<tree A> python benchmarks/bench_decode_step.py --label A
    PYTHONPATH=<tree B> python benchmarks/bench_decode_step.py --label B
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_engine_decode import llamacpp_variant  # noqa: E402

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402


def decode_step_ms(model: torch.nn.Module, requests: int, steps: int, prompt: int = 64) -> float:
    """Median CPU milliseconds of a decode step with ``requests`` requests decoding."""
    g = torch.Generator().manual_seed(1)
    engine = Engine(model, EngineConfig(capacity_tokens=requests * (prompt + steps + 16), max_sequences=requests,
                                        max_batch_tokens=max(4096, requests * prompt), block_size=256))
    for i in range(requests):
        engine.add_request(torch.randint(4, model.config.vocab_size, (prompt,), generator=g).tolist(),
                           request_id=f"r{i}", max_new_tokens=steps + 8, eos_token_id=-1)
    times = []
    with torch.inference_mode():
        for _ in range(4):
            engine.step()
        for _ in range(steps):
            t0 = time.process_time()
            engine.step()
            times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,16,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--label", default="this tree")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = llamacpp_variant()
    import hebrus_torch

    cells = [f"{n}: {decode_step_ms(model, n, args.steps):.2f} ms" for n in (int(c) for c in args.counts.split(","))]
    print(f"{args.label} ({os.path.dirname(hebrus_torch.__file__)}): " + ", ".join(cells))


if __name__ == "__main__":
    main()

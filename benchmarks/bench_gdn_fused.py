"""CPU cost of the GDN layer's fused ops (issue 37) against the code they replace, at the released model's
shapes (48 value heads of 128): ``hebrus::gdn_gates`` against the packed forward's gate formulas, and
``hebrus::gdn_gated_rms_norm`` against transformers' ``Qwen4ExpTextRMSNormGated``, for a decode step
(T = 1) and a prefill chunk (T = 512). Old and new run interleaved (each first every other repeat), min
over repeats of the CPU time per call.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_gdn_fused.py [--repeats 7] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from hf_models import modeling  # noqa: E402

import hebrus_torch  # noqa: E402
from hebrus_torch.gdn.fused import _sigmoid, _softplus  # noqa: E402

HEADS, DV = 48, 128


def old_gates(a, b, A_log, dt_bias):
    return -A_log.float().exp() * _softplus(a.float() + dt_bias), _sigmoid(b).to(b.dtype)


def per_call(fn, args, calls: int) -> float:
    """CPU seconds per call (the process's CPU time, not wall time: on a shared machine the wall clock
    also counts the time other processes hold the cores; with one thread this is the op's own work)."""
    start = time.process_time()
    for _ in range(calls):
        fn(*args)
    return (time.process_time() - start) / calls


def measure(tokens: int, dtype: torch.dtype, repeats: int) -> dict[str, tuple[float, float]]:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(tokens, HEADS, generator=g) * 4).to(dtype), (torch.randn(tokens, HEADS, generator=g) * 4).to(dtype)
    A_log, dt_bias = torch.randn(HEADS, generator=g).to(dtype), torch.randn(HEADS, generator=g).to(dtype)
    norm = modeling.Qwen4ExpTextRMSNormGated(DV, eps=1e-6, activation="silu").to(dtype)
    x = torch.randn(tokens * HEADS, DV, generator=g).to(dtype)
    z = torch.randn(tokens * HEADS, DV, generator=g).to(dtype)
    cases = {
        "gates": ((old_gates, (a, b, A_log, dt_bias)), (hebrus_torch.gdn_gates, (a, b, A_log, dt_bias))),
        "gated norm": ((norm, (x, z)), (hebrus_torch.gdn_gated_rms_norm, (x, z, norm.weight, 1e-6, "silu"))),
    }
    calls = 200 if tokens == 1 else 1
    out = {}
    with torch.inference_mode():
        for name, (old, new) in cases.items():
            best_old = best_new = float("inf")
            for rep in range(repeats):        # interleaved, each going first every other time
                if rep % 2:
                    best_new = min(best_new, per_call(*new, calls))
                best_old = min(best_old, per_call(*old, calls))
                if not rep % 2:
                    best_new = min(best_new, per_call(*new, calls))
            out[name] = (best_old, best_new)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} (start)")
    rows = []
    for tokens in (1, 512):
        for dtype in (torch.float32, torch.bfloat16):
            for name, (old, new) in measure(tokens, dtype, args.repeats).items():
                unit, scale = ("us", 1e6) if tokens == 1 else ("ms", 1e3)
                digits = 1 if tokens == 1 else 2
                rows.append((name, tokens, str(dtype).replace("torch.", ""), f"{old * scale:.{digits}f} {unit}",
                             f"{new * scale:.{digits}f} {unit}"))
    print(f"load average {os.getloadavg()[0]:.1f} (end)")
    if args.markdown:
        print("| op | T | dtype | before | fused |\n|---|---:|---|---:|---:|")
        for r in rows:
            print("| " + " | ".join(map(str, r)) + " |")
    else:
        for r in rows:
            print(*r, sep="\t")


if __name__ == "__main__":
    main()

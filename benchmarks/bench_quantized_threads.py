"""The quantized CPU ops called back to back at 1 and 2 threads (issue 36): a decode step's projections (the
shapes of the 4-layer released-shape benchmark model's 4-bit checkpoint, benchmarks/bench_quantized_model.py) and one
MoE layer (hidden 2560, 32 experts x 640, top 10) at 1 and 8 rows, group 64, bf16 rows. Per case: the median wall
time of a call over ``--calls`` calls in a row (warm caches: what a call costs beyond reading its weights, so how
the threads meet) and the process CPU time per call. The rounds alternate the thread counts.

The figure this is for: a short call's cost at 2 threads on a machine whose cores are shared (the development VM
has 2 cores and other processes): with OpenMP's barrier, one thread not scheduled held a call for a time slice.

    python benchmarks/bench_quantized_threads.py [--calls 50] [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import hebrus_torch  # noqa: E402
from hebrus_torch.moe.quantize import quantize  # noqa: E402
from common import machine, table, write_section  # noqa: E402

SECTION = "Quantized ops at 1 and 2 threads, called back to back (issue 36)"
GROUP = 64
PROJECTIONS = [(10240, 2560), (10240, 320), (320, 10240), (640, 2560)]   # [out, in]
HIDDEN, INTER, TOP_K, EXPERTS = 2560, 640, 10, 32


def cases(bits_list: list[int], rows_list: list[int]):
    g = torch.Generator().manual_seed(0)
    out = []
    for out_dim, in_dim in PROJECTIONS:
        w = (torch.randn(out_dim, in_dim, generator=g) * in_dim ** -0.5).bfloat16()
        for bits in bits_list:
            q = quantize(w, bits, GROUP)
            for rows in rows_list:
                x = torch.randn(rows, in_dim, generator=g).bfloat16()
                out.append((f"quantized_linear [{out_dim}, {in_dim}] {bits}-bit", rows,
                            lambda x=x, q=q, bits=bits: hebrus_torch.quantized_linear(x, *q, GROUP, bits)))
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN ** -0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER ** -0.5).bfloat16()
    for bits in bits_list:
        parts = [quantize(gate_up[e], bits, GROUP) + quantize(down[e], bits, GROUP) for e in range(EXPERTS)]
        tensors = [torch.stack([p[i] for p in parts]) for i in range(6)]
        for rows in rows_list:
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(rows)])
            wts = torch.rand(rows, TOP_K, generator=g)
            wts = (wts / wts.sum(-1, keepdim=True)).bfloat16()
            x = torch.randn(rows, HIDDEN, generator=g).bfloat16()
            out.append((f"moe_experts_quantized {EXPERTS} experts {bits}-bit", rows,
                        lambda x=x, ids=ids, wts=wts, t=tensors, bits=bits: hebrus_torch.moe_experts_quantized(
                            x, ids, wts, *t, GROUP, bits)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bits", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    all_cases = cases(args.bits, args.rows)
    samples: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for label, rows, fn in all_cases:
                    fn()
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.calls):
                        fn()
                    samples.setdefault((label, rows, threads), []).append(
                        ((time.perf_counter() - t0) / args.calls, (time.process_time() - c0) / args.calls))
    rows_out = []
    for label, rows, _ in all_cases:
        wall = {t: statistics.median(s for s, _ in samples[(label, rows, t)]) for t in (1, 2)}
        cpu = {t: statistics.median(c for _, c in samples[(label, rows, t)]) for t in (1, 2)}
        rows_out.append([label, str(rows), f"{wall[1] * 1e3:.3f}", f"{wall[2] * 1e3:.3f}", f"{cpu[2] * 1e3:.3f}",
                         f"{wall[1] / wall[2]:.2f}x"])
        print(" | ".join(rows_out[-1]), flush=True)
    body = (f"Machine: {machine()}. `python benchmarks/bench_quantized_threads.py --calls {args.calls} --rounds "
            f"{args.rounds}` (hebrus_torch from {os.path.dirname(hebrus_torch.__file__)}). Each op called "
            f"{args.calls} times in a row (warm caches), group {GROUP}, bf16 rows; medians over {args.rounds} rounds, "
            f"the thread counts alternating. Load average at the start: {load:.1f}, at the end: "
            f"{os.getloadavg()[0]:.1f}. 'speed-up': 1 thread's wall time over 2 threads'.\n\n")
    body += table(["op", "rows", "ms 1 thread", "ms 2 threads", "CPU ms 2 threads", "speed-up at 2 threads"],
                  rows_out)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()

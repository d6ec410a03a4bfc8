"""CPU time per call of the quantized CPU ops at one thread (issue 36), for comparing two builds on a machine whose
load does not let wall times be compared: bench_moe.py's quantized cases (one released-shape MoE layer, 64 experts,
hidden 2560 x 640, top 10; the [10240, 2560] projection; group 64, bf16 rows) at 1, 8 and 64 rows, each call
after a 256 MiB buffer is written (cold caches); the median over ``--repeat`` calls of the process CPU time (and
of the wall time). Prints one JSON line; run it once per build, alternating, with PYTHONPATH pointing at each.

    OMP_NUM_THREADS=1 python benchmarks/bench_quantized_cpu_time.py [--rows 1 8 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hebrus_torch
from hebrus_torch.moe.quantize import quantize

HIDDEN, INTER, TOP_K, GROUP, EXPERTS, PROJ_OUT = 2560, 640, 10, 64, 64, 10240


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN ** -0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER ** -0.5).bfloat16()
    experts, proj = {}, {}
    weight = (torch.randn(PROJ_OUT, HIDDEN, generator=g) * HIDDEN ** -0.5).bfloat16()
    for bits in (4, 8):
        parts = [quantize(gate_up[e], bits, GROUP) + quantize(down[e], bits, GROUP) for e in range(EXPERTS)]
        experts[bits] = [torch.stack([p[i] for p in parts]) for i in range(6)]
        proj[bits] = quantize(weight, bits, GROUP)
    flush = torch.empty(256 << 20, dtype=torch.uint8)
    out = {"hebrus_torch": hebrus_torch.__file__}
    with torch.inference_mode():
        for rows in args.rows:
            gr = torch.Generator().manual_seed(rows)
            ids = torch.stack([torch.randperm(EXPERTS, generator=gr)[:TOP_K] for _ in range(rows)])
            w = torch.rand(rows, TOP_K, generator=gr)
            w = (w / w.sum(-1, keepdim=True)).bfloat16()
            x = torch.randn(rows, HIDDEN, generator=gr).bfloat16()
            for bits in (4, 8):
                cases = {f"moe_experts_quantized {bits}-bit": lambda bits=bits: hebrus_torch.moe_experts_quantized(
                             x, ids, w, *experts[bits], GROUP, bits),
                         f"quantized_linear {bits}-bit": lambda bits=bits: hebrus_torch.quantized_linear(
                             x, *proj[bits], GROUP, bits)}
                for label, fn in cases.items():
                    fn()
                    cpu, wall = [], []
                    for _ in range(args.repeat):
                        flush.add_(1)
                        t0, c0 = time.perf_counter(), time.process_time()
                        fn()
                        wall.append(time.perf_counter() - t0)
                        cpu.append(time.process_time() - c0)
                    out[f"{label} rows {rows}"] = {"cpu_ms": round(statistics.median(cpu) * 1e3, 2),
                                                   "wall_ms": round(statistics.median(wall) * 1e3, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""One released-shape MoE layer's routed experts (hidden 2560, expert intermediate 640, top 10) at 1, 8 and
64 rows: hebrus::moe_experts (fp32, bf16) and moe_experts_quantized (8-bit, 4-bit, group 64) against
transformers' experts on its default ``grouped_mm`` path (issue 36); and one released-shape projection
(a GDN layer's ``in_proj_qkv``, [10240, 2560]) as hebrus::quantized_linear (8-bit, 4-bit) against bf16
``torch.nn.functional.linear``.

Per case: the median time of a call with cold caches (a 1 GiB buffer is streamed between calls, as the
other layers of a decode step would), the bytes of expert weights the call must read (each distinct expert
hit once: codes, scales and biases for the quantized ops) and that over the time as a fraction of the
copy bandwidth sampled right after each call (common.copy_sample). The layer has fewer experts than the released 512
(``--experts``, memory): a call reads only the experts its rows hit, so the time depends on the rows and
k, not on E, once the weights are out of cache.

Every case of a row count is timed once per round, the rounds interleaved (so a change of the shared machine's
load falls on all of them alike), each call followed by a copy-bandwidth sample (common.copy_sample) that its
bytes are compared with; the figures are medians over the rounds. ``--threads 1 2`` runs the whole table at each
thread count.

    python benchmarks/bench_moe.py [--experts 64] [--threads 1 2] [--repeat 5] [--no-write]
    python benchmarks/bench_moe.py --experts 512 --dtypes bfloat16 --bits 4 8   # the released layer, ~9 GB

``--dtypes`` / ``--bits`` pick the dense and quantized cases (every case's weights are resident at once: at the
released 512 experts fp32 alone is 10 GB).
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
from common import copy_sample, flush_caches, machine, table, write_section  # noqa: E402

HIDDEN, INTER, TOP_K, GROUP = 2560, 640, 10, 64
PROJ_OUT = 10240          # in_proj_qkv of a released linear-attention layer: [10240, 2560]
SECTION = "MoE layer: moe_experts vs transformers' grouped_mm, 1 and 2 threads (issue 36)"


def routing(rows: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(rows)])
    w = torch.rand(rows, TOP_K, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


def interleaved(cases, repeat: int) -> dict[str, list[tuple[float, float]]]:
    """{label: [(seconds, copy bytes/s right after)] * repeat}: one untimed call of every case, then `repeat`
    rounds each timing every case once after a cache flush."""
    for _, fn, _ in cases:
        fn()
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in cases}
    for _ in range(repeat):
        for label, fn, _ in cases:
            flush_caches()
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
            samples[label].append((seconds, copy_sample()))
    return samples


def hf_experts(gate_up: torch.Tensor, down: torch.Tensor):
    from hf_models import modeling, tiny_config

    config = tiny_config(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=gate_up.shape[0],
                         num_experts_per_tok=TOP_K)
    config._experts_implementation = "grouped_mm"
    module = modeling.Qwen4ExpTextExperts(config).to(gate_up.dtype)
    module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="*", default=[])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--bits", type=int, nargs="*", default=[8, 4], choices=[8, 4])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    thread_counts = args.threads or [torch.get_num_threads()]
    experts = args.experts
    g = torch.Generator().manual_seed(0)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    stored = torch.float32 if torch.float32 in dtypes else torch.bfloat16  # one expert at a time in fp32
    gate_up_all = torch.stack([(torch.randn(2 * INTER, HIDDEN, generator=g) * HIDDEN ** -0.5).to(stored)
                               for _ in range(experts)])
    down_all = torch.stack([(torch.randn(HIDDEN, INTER, generator=g) * INTER ** -0.5).to(stored)
                            for _ in range(experts)])
    load = os.getloadavg()[0]
    bandwidths = []
    rows_out = []
    with torch.inference_mode():
        variants = []
        for dtype in dtypes:
            gu, dn = gate_up_all.to(dtype), down_all.to(dtype)
            variants.append((str(dtype).split(".")[1], dtype, gu, dn, hf_experts(gu, dn)))
        quantized = []
        for bits in args.bits:
            parts = [quantize(gate_up_all[e].bfloat16(), bits, GROUP) + quantize(down_all[e].bfloat16(), bits, GROUP)
                     for e in range(experts)]
            quantized.append((bits, [torch.stack([p[i] for p in parts]) for i in range(6)]))
            del parts
        del gate_up_all, down_all
        proj = (torch.randn(PROJ_OUT, HIDDEN, generator=g) * HIDDEN ** -0.5).bfloat16()
        proj_q = {bits: quantize(proj, bits, GROUP) for bits in args.bits}
        for rows in args.rows:
            ids, w = routing(rows, experts, rows)
            hit = int(ids.unique().numel())
            x32 = torch.randn(rows, HIDDEN, generator=g)
            cases = []
            for name, dtype, gu, dn, module in variants:
                x, wd = x32.to(dtype), w.to(dtype)
                per_expert = 3 * HIDDEN * INTER * gu.element_size()
                cases.append((f"transformers grouped_mm {name}", lambda: module(x, ids, wd), hit * per_expert))
                cases.append((f"moe_experts {name}",
                              lambda gu=gu, dn=dn, x=x, wd=wd: hebrus_torch.moe_experts(x, ids, wd, gu, dn),
                              hit * per_expert))
            xb, wb = x32.bfloat16(), w.bfloat16()
            for bits, tensors in quantized:
                per_expert = sum(t[0].numel() * t.element_size() for t in tensors)
                cases.append((f"moe_experts_quantized {bits}-bit g{GROUP}",
                              lambda tensors=tensors, bits=bits: hebrus_torch.moe_experts_quantized(
                                  xb, ids, wb, *tensors, GROUP, bits), hit * per_expert))
            cases.append(("projection: F.linear bf16", lambda: torch.nn.functional.linear(xb, proj),
                          proj.numel() * 2))
            for bits, tensors in proj_q.items():
                cases.append((f"projection: quantized_linear {bits}-bit g{GROUP}",
                              lambda tensors=tensors, bits=bits: hebrus_torch.quantized_linear(xb, *tensors, GROUP,
                                                                                               bits),
                              sum(t.numel() * t.element_size() for t in tensors)))
            for threads in thread_counts:
                torch.set_num_threads(threads)
                samples = interleaved(cases, args.repeat)
                bandwidths += [bw for per_case in samples.values() for _, bw in per_case]
                times = {label: statistics.median(t for t, _ in per_case) for label, per_case in samples.items()}
                for label, _, nbytes in cases:
                    t = times[label]
                    base = times.get("projection: F.linear bf16" if label.startswith("projection")
                                     else "transformers grouped_mm bfloat16", float("nan"))
                    of_copy = statistics.median(nbytes / s / bw for s, bw in samples[label])
                    rows_out.append([str(rows), str(threads), str(hit), label, f"{t * 1e3:.2f}",
                                     f"{nbytes / 2**20:.0f}", f"{nbytes / t / 1e9:.1f}", f"{of_copy:.2f}",
                                     f"{base / t:.2f}x"])
                    print(" | ".join(rows_out[-1]), flush=True)
    threads_arg = " ".join(str(t) for t in thread_counts)
    options = (f" --dtypes {' '.join(args.dtypes)}" if args.dtypes != ["float32", "bfloat16"] else "") + (
        f" --bits {' '.join(map(str, args.bits))}" if args.bits != [8, 4] else "") + (
        f" --rows {' '.join(map(str, args.rows))}" if args.rows != [1, 8, 64] else "")
    body = (f"Machine: {machine()}. `python benchmarks/bench_moe.py --experts {experts} --threads {threads_arg} "
            f"--repeat {args.repeat}{options}`. One layer's routed experts at the released shape (H {HIDDEN}, I {INTER}, "
            f"top {TOP_K}), {experts} experts (the time depends on the experts hit, not on E, once weights are out "
            f"of cache); random routing; median of {args.repeat} calls, each after a 1 GiB cache flush, the cases of "
            f"a row count and thread count interleaved round by round. Bytes: the weights of the distinct experts hit "
            f"(quantized: codes + bf16 scales and biases, group {GROUP}). 'of copy bw': the median over the calls of "
            f"their GB/s over a 256 MiB copy's (read + write counted) timed right after each; those samples ranged "
            f"{min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} GB/s, median "
            f"{statistics.median(bandwidths) / 1e9:.1f}. Load average at the start: {load:.1f}, at the end: "
            f"{os.getloadavg()[0]:.1f}. The last column is the speed-up over transformers' bf16 grouped_mm path at "
            f"the same rows and threads (the projection rows: over bf16 F.linear of the same [{PROJ_OUT}, {HIDDEN}] "
            f"weight, 'experts hit' not applying).\n\n")
    body += table(["rows", "threads", "experts hit", "path", "ms", "weights MiB", "GB/s", "of copy bw",
                   "vs bf16 baseline"], rows_out)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()

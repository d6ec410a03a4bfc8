"""GDN prefill: the chunked op (hebrus::gdn_chunk_delta_rule_slots) vs the recurrent one (hebrus::gdn_delta_rule)
against the machine's dense fp32 matmul rate, all in one run (issue 25).

A real layer: Hv = 8 value heads, Hk = 4 key heads, Dk = Dv = 128, fp32, rows starting at position 0.
The work counted per token and value head is 7 Dk Dv multiply-adds (the issue's convention; the chunked
kernel does about 4 Dk Dv of real multiply-adds, the recurrent one 3 Dk Dv plus the decay), divided by
the time and by the rate of torch.mm on large square fp32 matrices with the same thread count. The
matmul rate is sampled before every case (the shared VM's speed drifts); each row divides by the
median of the samples next to it.

    python benchmarks/bench_gdn_prefill.py [--threads N] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import hebrus_torch  # noqa: F401  (registers the ops)
from hebrus_torch.gdn.chunked import chunk_gated_delta_rule_slots
from hebrus_torch.gdn.delta_rule import gated_delta_rule
from common import machine, table, write_section

HV, HK, DK, DV = 8, 4, 128, 128
SECTION = "GDN prefill: chunked vs recurrent (issue 25)"


def matmul_rate(n: int = 2048, repeat: int = 3) -> float:
    """Multiply-adds per second of torch.mm on [n, n] fp32 matrices (best of ``repeat``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return n ** 3 / best


def inputs(rows: int, tokens: int, seed: int = 0):
    T = rows * tokens
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, HK, DK, generator=gen), torch.randn(T, HK, DK, generator=gen)
    v = torch.randn(T, HV, DV, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(T, HV, generator=gen)) * 0.1
    beta = torch.sigmoid(torch.randn(T, HV, generator=gen))
    cu = torch.arange(0, T + 1, tokens, dtype=torch.int32)
    return q, k, v, g, beta, cu


def best_time(fn, repeat: int, budget: float) -> float:
    """Best wall time of ``repeat`` calls (fewer when one call exceeds ``budget`` seconds), after one warm-up."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = [first] if first > budget else []
    while len(times) < repeat and (not times or sum(times) < budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="T = 512 and 4096 (1 row) only")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default=None, help="RESULTS.md section (default: by thread count)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [(1, 512), (1, 1024), (1, 4096), (1, 16384), (8, 512), (64, 64), (64, 256)]
    if args.quick:
        cases = [(1, 512), (1, 4096)]
    rows_out = []
    rates = []
    load = os.getloadavg()[0]
    for rows, tokens in cases:
        q, k, v, g, beta, cu = inputs(rows, tokens)
        T = rows * tokens
        pool = torch.zeros(rows, HV, DK, DV)
        slots = torch.arange(rows, dtype=torch.int32)
        start = torch.zeros(rows, dtype=torch.int64)
        state = torch.zeros(rows, HV, DK, DV)

        def chunked():
            pool.zero_()
            chunk_gated_delta_rule_slots(q, k, v, g, beta, cu, start, pool, slots)

        def recurrent():
            state.zero_()
            gated_delta_rule(q, k, v, g, beta, cu, state, inplace=True)

        rate = statistics.median([matmul_rate() for _ in range(3)])
        rates.append(rate)
        t_c = best_time(chunked, 5, 3.0)
        t_r = best_time(recurrent, 3, 3.0)
        rate = statistics.median([rate, matmul_rate(), matmul_rate()])
        work = 7 * DK * DV * T * HV
        rows_out.append([f"{rows} x {tokens}", f"{T}", f"{rate / 1e9:.1f}", f"{t_c * 1e3:.1f}", f"{t_r * 1e3:.1f}",
                         f"{T / t_c:,.0f}", f"{work / t_c / rate:.2f}", f"{work / t_r / rate:.2f}",
                         f"{t_r / t_c:.1f}x"])
        print(" | ".join(rows_out[-1]), flush=True)
    body = (f"Machine: {machine()}. `python benchmarks/bench_gdn_prefill.py"
            f"{' --threads ' + str(args.threads) if args.threads else ''}`. Hv = {HV}, Hk = {HK}, Dk = Dv = {DK}, "
            "fp32, rows from position 0, zero initial state; best of up to 5 (chunked) / 3 (recurrent) calls. "
            "Work: 7 Dk Dv multiply-adds per token and value head; fraction = work / time / the torch.mm rate "
            "(2048 x 2048 fp32, best of 3, median of the samples taken before and after each case). "
            f"Load average at the start / end: {load:.1f} / {os.getloadavg()[0]:.1f} (other processes share the "
            "cores: every figure of the run carries it; compare the columns of one row).\n\n"
            + table(["rows x tokens", "total tokens", "mm GMAC/s", "chunked ms", "recurrent ms", "chunked tokens/s",
                     "chunked / mm", "recurrent / mm", "speed-up"], rows_out) + "\n")
    print(body)
    if not args.no_write:
        write_section(args.section or f"{SECTION}, {torch.get_num_threads()} thread"
                      f"{'s' if torch.get_num_threads() > 1 else ''}", body)


if __name__ == "__main__":
    main()

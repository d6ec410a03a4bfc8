"""CPU cost of one decoder layer's hyper-connections, fused against the modules' own ops (issue 37).

A layer's hyper-connections are two pre-mixes (transformers' ``Qwen4ExpTextGatedResidual``: norm,
low-rank down / up, SiLU, sigmoid, stream mix, inject weights) and two post-combines (the layer's
``hyper + out * inject``). Timed at the released shapes (hc_count 4, hidden 2560, hc_lowrank 320;
random weights) on T rows, 1 thread by default:

- ``modules``: what the packed forward ran before ``hc_premix``: the fused ``hc_rms_norm``, then the
  module's projections and element-wise ops (``hebrus_torch.hc.premix.premix_by_modules``) and the
  layer's two-op post-combine;
- ``fused``: ``hebrus::hc_premix`` + ``hebrus::hc_post_combine`` (``hyper_premix`` / ``post_combine``).

The two run interleaved (one call of each per round, ``--rounds`` rounds); the minimum per call is
reported. Both give the same bits (checked before timing). Prints markdown rows; writes nothing.

    OMP_NUM_THREADS=1 python benchmarks/bench_hc.py --rows 1,512 --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's hebrus_torch

from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling  # noqa: E402
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402

from hebrus_torch.hc import hyper_premix, post_combine  # noqa: E402
from hebrus_torch.hc.premix import post_combine_by_ops, premix_by_modules  # noqa: E402


def layer_hyper_connections(dtype: torch.dtype, hidden: int, hc_count: int, lowrank: int):
    """The attention and MLP hyper-connections of one layer, random weights of a trained layer's scale."""
    config = Qwen4ExpTextConfig(hidden_size=hidden, hc_count=hc_count, hc_lowrank=lowrank)
    gen = torch.Generator().manual_seed(0)
    pair = []
    for _ in range(2):
        hc = modeling.Qwen4ExpTextGatedResidual(config)
        with torch.no_grad():
            for p in hc.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        pair.append(hc.to(dtype))
    return pair


def run_layer(pair, h: torch.Tensor, out: torch.Tensor, premix, combine) -> torch.Tensor:
    """The packed decoder layer's hyper-connections with the sublayers replaced by adding ``out``."""
    for hc in pair:
        x, hyper, inject = premix(hc, h)
        h = combine(hyper, out + x, inject)
    return h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,512")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--hc-count", type=int, default=4)
    parser.add_argument("--lowrank", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=0, help="0: 200 at one row, 6 at more")
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} "
          f"{os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}")
    print("| dtype | rows | modules (ms) | fused (ms) | fused / modules |")
    print("|---|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        pair = layer_hyper_connections(dtype, args.hidden, args.hc_count, args.lowrank)
        for rows in map(int, args.rows.split(",")):
            gen = torch.Generator().manual_seed(rows)
            h = torch.randn(rows, args.hc_count * args.hidden, generator=gen).to(dtype)
            out = torch.randn(rows, args.hidden, generator=gen).to(dtype)
            paths = {"modules": (premix_by_modules, post_combine_by_ops), "fused": (hyper_premix, post_combine)}
            with torch.no_grad():
                results = {k: run_layer(pair, h, out, *fns) for k, fns in paths.items()}
                assert torch.equal(results["modules"], results["fused"]), "the fused ops changed the bits"
                best = {k: float("inf") for k in paths}
                for _ in range(args.rounds or (200 if rows == 1 else 6)):
                    for k, fns in paths.items():
                        t0 = time.perf_counter()
                        run_layer(pair, h, out, *fns)
                        best[k] = min(best[k], time.perf_counter() - t0)
            print(f"| {name} | {rows} | {best['modules'] * 1e3:.3f} | {best['fused'] * 1e3:.3f} | "
                  f"{best['fused'] / best['modules']:.2f} |")
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

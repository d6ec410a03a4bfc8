"""One released-shape MoE block on CPU (hidden 2560, expert and shared-expert intermediate 640, top 10 of
``--experts``), the engine's packed path before and after issue 37's fused router and shared expert:

* before: the router module (linear, softmax, top-k, renormalisation, cast), the shared expert module
  (three linears, SiLU, product), ``hebrus::moe_experts``, the shared gate's linear, sigmoid, product, sum
  (``hebrus_torch.moe.block.packed_moe`` as it was: 17 dispatches on MPS);
* after: ``packed_moe(fused=True)`` (what it runs off CPU): the router's and the shared gate's linears,
  ``hebrus::moe_route``, ``hebrus::moe_experts``, ``hebrus::moe_shared_expert`` (5).

Per row count: the minimum over ``--repeat`` rounds of the median time of a call, the two paths interleaved
in each round (warm caches: the block's cost beyond streaming its weights), and whether both give the same
output bits (on CPU both fused ops run the modules' ATen sequences, so they must).

    python benchmarks/bench_moe_block.py [--experts 64] [--threads 1] [--repeat 5] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from common import machine, table, timeit, write_section  # noqa: E402
from hebrus_torch.moe import block  # noqa: E402

HIDDEN, INTER, TOP_K = 2560, 640, 10
SECTION = "MoE block: the fused router and shared expert on CPU (issue 37)"


def moe_block(experts: int, dtype: torch.dtype):
    from hf_models import modeling, tiny_config

    config = tiny_config(hidden_size=HIDDEN, moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER,
                         num_experts=experts, num_experts_per_tok=TOP_K, norm_topk_prob=True)
    mlp = modeling.Qwen4ExpTextSparseMoeBlock(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return mlp.to(dtype).requires_grad_(False)


def before(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """packed_moe before issue 37: the router and the shared expert as module calls beside moe_experts."""
    shared = mlp.shared_expert(x)
    _, weights, ids = mlp.gate(x)
    routed = block.routed_experts(mlp.experts, x, ids, weights)
    return routed + torch.sigmoid(mlp.shared_expert_gate(x)) * shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    rows_out = []
    mlp = moe_block(args.experts, torch.bfloat16)
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).bfloat16()
            same = torch.equal(before(mlp, x), block.packed_moe(mlp, x, fused=True))
            best = {"before": float("inf"), "after": float("inf")}
            for _ in range(args.repeat):
                best["before"] = min(best["before"], timeit(lambda: before(mlp, x), repeat=5))
                best["after"] = min(best["after"], timeit(lambda: block.packed_moe(mlp, x, fused=True), repeat=5))
            rows_out.append([str(rows), f"{best['before'] * 1e3:.3f}", f"{best['after'] * 1e3:.3f}",
                             f"{best['before'] / best['after']:.2f}x", "yes" if same else "no"])
            print(" | ".join(rows_out[-1]), flush=True)
    body = (f"Machine: {machine()}. `python benchmarks/bench_moe_block.py --experts {args.experts} --threads "
            f"{args.threads}`. One MoE block at the released shape (H {HIDDEN}, I {INTER}, shared {INTER}, top "
            f"{TOP_K} of {args.experts} experts), bf16, random weights; min over {args.repeat} interleaved rounds of "
            f"the median of 5 warm calls. Load average at the start: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
            f"(1 / 5 / 15 min). 'before': the router and the shared expert as module calls beside moe_experts (17 "
            f"dispatches on MPS); 'after': packed_moe(fused=True) with moe_route and moe_shared_expert (5, what it "
            f"runs off CPU).\n\n")
    body += table(["rows", "before ms", "after ms", "speed-up", "same bits"], rows_out)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()

"""What ``torch.compile`` gains on CPU for one decoder layer's packed forward (issue 37).

The layer: a linear-attention decoder layer of ``bench_engine.small_model`` (hidden 256, hc 2, 8 experts
top-2), as the engine's packed forward runs it (``packed_decoder_layer``: hyper-connections, the GDN with
its state through ``hebrus::ple_conv_slots`` and ``hebrus::gdn_delta_rule_slots`` on explicit pools, the MoE
through ``hebrus::moe_experts``), without the holders' bookkeeping. Rows: 1 sequence decoding (T = 1),
16 sequences decoding (T = 16) and one 64-token prefill chunk, eager vs ``torch.compile(fullgraph=True)``
(inductor, default mode), one thread, median of ``--repeat`` timed calls after warm-up; the compile time
of each shape is reported too. Writes its RESULTS.md section unless ``--no-write``.

    python benchmarks/bench_compile.py [--repeat 200] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hebrus_torch.gdn.delta_rule import gated_delta_rule_slots  # noqa: E402
from hebrus_torch.models.qwen4_exp.forward import packed_decoder_layer  # noqa: E402
from hebrus_torch.models.qwen4_exp.gdn import gated_delta_net  # noqa: E402
from hebrus_torch.ple import ops as ple_ops  # noqa: E402


def gdn_layer_step(layer: torch.nn.Module, cu_seqlens: torch.Tensor, slots: torch.Tensor):
    """One linear-attention decoder layer's packed forward with its state in explicit pools (what the
    engine's ``ChunkStep`` runs, less the holders' bookkeeping): ``step(h, conv_pool, recurrent_pool) -> h``
    with h Tensor[T, hc * hidden], conv_pool Tensor[S, K - 1, conv_dim] and recurrent_pool
    Tensor[S, Hv, Dk, Dv] float32 (both updated in place at ``slots``, one per row of ``cu_seqlens``)."""
    gdn = layer.linear_attn

    def step(h: torch.Tensor, conv_pool: torch.Tensor, recurrent_pool: torch.Tensor) -> torch.Tensor:
        def conv(x, weight, activation):
            weight = weight.reshape(weight.shape[0], weight.shape[-1])
            return ple_ops.ple_conv_slots(x, weight, cu_seqlens, conv_pool, slots, 1, activation)

        def delta_rule(q, k, v, g, beta):
            return gated_delta_rule_slots(q, k, v, g, beta, cu_seqlens, recurrent_pool, slots)

        return packed_decoder_layer(layer, h, lambda x: gated_delta_net(gdn, x, conv, delta_rule), "gdn")

    return step


def state_pools(layer: torch.nn.Module, num_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random conv tails Tensor[S, K - 1, conv_dim] and recurrent states Tensor[S, Hv, Dk, Dv] for the layer."""
    gdn = layer.linear_attn
    conv_dim, k = gdn.conv1d.weight.shape[0], gdn.conv1d.weight.shape[-1]
    conv = torch.randn((num_slots, k - 1, conv_dim), generator=gen) * 0.5
    rec = torch.randn((num_slots, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim), generator=gen) * 0.1
    return conv, rec


def timed(fn, args, repeat: int) -> float:
    for _ in range(5):
        fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="torch.compile of one decoder layer on CPU (issue 37)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from bench_engine import small_model
    from common import machine, table, write_section

    model = small_model()
    layer = next(m for m in model.model.layers if m.layer_type == "linear_attention")
    hc, hidden = model.config.hc_count, model.config.hidden_size
    rows = []
    for name, lengths in (("1 sequence decoding (T = 1)", [1]), ("16 sequences decoding (T = 16)", [1] * 16),
                          ("one 64-token prefill chunk", [64])):
        gen = torch.Generator().manual_seed(len(lengths))
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        slots = torch.arange(len(lengths), dtype=torch.int32)
        h = torch.randn((sum(lengths), hc * hidden), generator=gen)
        step = gdn_layer_step(layer, cu, slots)
        pools = state_pools(layer, len(lengths), gen)
        torch._dynamo.reset()
        with torch.inference_mode():
            eager = timed(step, (h, *pools), args.repeat)
            compiled = torch.compile(step, fullgraph=True)
            t0 = time.perf_counter()
            compiled(h, *pools)
            compile_s = time.perf_counter() - t0
            fast = timed(compiled, (h, *pools), args.repeat)
        rows.append([name, f"{eager * 1e3:.3f}", f"{fast * 1e3:.3f}", f"{eager / fast:.2f}x", f"{compile_s:.0f}"])
        print(rows[-1], flush=True)
    torch._dynamo.reset()
    load = os.getloadavg()
    text = "\n".join([
        f"Machine: {machine()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. One linear-attention "
        f"decoder layer of bench_engine's small model (hidden 256, hc 2, GDN 2 key / 4 value heads of 32, 8 "
        f"experts top-2 of 256 + shared 256) as `packed_decoder_layer` runs it, its GDN state through "
        f"hebrus::ple_conv_slots and hebrus::gdn_delta_rule_slots on explicit pools and its routed experts "
        f"through hebrus::moe_experts (the holders' bookkeeping, which the engine runs around it, is not in "
        f"the timed call). Eager vs torch.compile(fullgraph=True) with inductor's default mode; median of "
        f"{args.repeat} calls after warm-up, inference mode; compile time: the first compiled call.",
        "",
        table(["rows", "eager (ms)", "compiled (ms)", "gain", "compile (s)"], rows),
    ])
    print(text)
    if not args.no_write:
        write_section(args.section, text)


if __name__ == "__main__":
    main()

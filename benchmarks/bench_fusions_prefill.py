"""Engine prefill on CPU with issue 37's fused ops against the module paths they replaced (issue 37's
"prefill no slower on CPU than today").

A released-shape model (``bench_ple_disk.released_shapes``: hidden 2560, 3 linear + 1 indexed layer, hc 4,
``--experts`` experts top 10, one PLE layer) prefills one ``--tokens``-token prompt through the engine in one
chunk, once with every fusion the packed forward takes on CPU (``hc_premix``, ``hc_post_combine``,
``rms_norm_rope``, ``sigmoid_gate``, ``gdn_gates``, ``gdn_gated_rms_norm``, ``moe_route``, ``moe_shared_expert``;
``qsa_token_cells`` has no other path and runs in both) and once with each of them switched to the path the packed
forward runs for a module it cannot fuse, which is the code these ops replaced: the pre-mix's modules after
``hc_rms_norm``, the layer's two-op combine, the norm then transformers' ``apply_rotary_pos_emb``, the sigmoid
and product before ``o_proj``, the gates' ATen formulas, the gated norm module, the router module, the shared
expert module. The two variants alternate round by round in one process; each prefill is timed by the process's
CPU time (one thread) and the tokens of the two are compared. Prints a table; ``--write`` appends it to RESULTS.md.

    python benchmarks/bench_fusions_prefill.py [--tokens 512] [--experts 16] [--rounds 5] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, table, write_section  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402


@contextlib.contextmanager
def module_paths():
    """Every fusion of the CPU packed forward switched to its module path (see the module docstring)."""
    from hebrus_torch.gdn import fused as gdn_fused
    from hebrus_torch.hc import premix
    from hebrus_torch.models.qwen4_exp import attention, forward
    from hebrus_torch.moe import block

    def route_by_module(mlp, x, fused=None):
        _, weights, ids = mlp.gate(x)
        return ids, weights, torch.sigmoid(mlp.shared_expert_gate(x))

    def gated_heads(attn, out, gate):
        return attention.gated_output(attn, out, gate.reshape(*gate.shape[:-2], -1))

    patches = [(premix, "_fusable_premix", lambda hc, h: False),
               (forward, "post_combine", premix.post_combine_by_ops),
               (attention, "_is_module_rope", lambda rope: False),
               (attention, "_gated_heads", gated_heads),
               (gdn_fused, "_needs_autograd", lambda *t: True),
               (block, "route", route_by_module),
               (block, "_fuse_elementwise", lambda fused: False)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


FUSED_OPS = ("hc_premix", "hc_post_combine", "rms_norm_rope", "sigmoid_gate", "gdn_gates", "gdn_gated_rms_norm",
             "moe_route", "moe_shared_expert")


class FusedOpCounter(TorchDispatchMode):
    """How many of :data:`FUSED_OPS` a block dispatches (the check that the module paths are the ones run)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "hebrus" and func.overloadpacket.__name__ in FUSED_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def prefill(model, prompt: list[int]) -> tuple[float, list[int]]:
    """CPU seconds of the engine step that prefills ``prompt`` in one chunk, and the token it samples."""
    engine = Engine(model, EngineConfig(capacity_tokens=len(prompt) + 64, max_sequences=1,
                                        max_batch_tokens=len(prompt), block_size=256))
    engine.add_request(prompt, request_id="r", max_new_tokens=1, eos_token_id=-1)
    t0 = time.process_time()
    outputs = engine.step()
    seconds = time.process_time() - t0
    return seconds, [tok for out in outputs for tok in out.new_tokens]


def build(dtype: torch.dtype, experts: int):
    from bench_ple_disk import released_shapes
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(released_shapes(experts, 1000)).to(dtype).eval()
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    load0 = os.getloadavg()
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model = build(dtype, args.experts)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(4, model.config.vocab_size, (args.tokens,), generator=g).tolist()
        times = {"fused": [], "modules": []}
        tokens = {}
        with torch.inference_mode():
            fused_ops = {}
            for variant in ("fused", "modules"):                         # warm-up, counting the fused ops
                with module_paths() if variant == "modules" else contextlib.nullcontext(), FusedOpCounter() as c:
                    prefill(model, prompt[:64])
                fused_ops[variant] = c.count
            for r in range(args.rounds):
                order = ("fused", "modules") if r % 2 == 0 else ("modules", "fused")
                for variant in order:
                    with module_paths() if variant == "modules" else contextlib.nullcontext():
                        seconds, toks = prefill(model, prompt)
                    times[variant].append(seconds)
                    tokens.setdefault(variant, toks)
        ratios = [f / m for f, m in zip(times["fused"], times["modules"])]
        rows.append([name, str(args.tokens), f"{statistics.median(times['modules']):.3f}",
                     f"{statistics.median(times['fused']):.3f}", f"{statistics.median(ratios):.3f}",
                     f"{min(ratios):.3f}-{max(ratios):.3f}", "yes" if tokens["fused"] == tokens["modules"] else "no",
                     f"{fused_ops['fused']} / {fused_ops['modules']}"])
        print(rows[-1], flush=True)
        del model
    load1 = os.getloadavg()
    header = ["dtype", "prompt tokens", "module paths, CPU s (median)", "fused, CPU s (median)",
              "fused / modules (median of rounds)", "range", "same token", "fused ops dispatched (fused / modules)"]
    text = (f"Machine: {machine()}. {args.rounds} rounds per dtype, the two variants alternating within each round, "
            f"one prefill step each, CPU time of the process (one thread). Load average at the start "
            f"{load0[0]:.1f}, at the end {load1[0]:.1f}.\n\n" + table(header, rows))
    print(text)
    if args.write:
        write_section("Engine prefill: issue 37's fusions against the module paths, CPU (issue 37)",
                      text + "\n\n`python benchmarks/bench_fusions_prefill.py " + " ".join(sys.argv[1:]) + "`")


if __name__ == "__main__":
    main()

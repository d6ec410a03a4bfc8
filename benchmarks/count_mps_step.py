"""What one engine step launches and waits for on MPS, counted on CPU (``hebrus_torch._emulate``).

The engine runs a random-weight Qwen4Exp of real head sizes (hidden 2048; GDN Hk=16, Hv=32,
Dk=Dv=128; indexer D=128, 16 heads; attention 16 x 128, 2 KV heads; MoE 16 experts, top 2) with
``--layers`` decoder layers (linear and indexed attention alternating, PLE on the linear ones) inside
``emulate("mps")``: every branch the MPS device takes is taken, the ops with Metal kernels
(``_emulate.NATIVE_OPS["mps"]``, gdn_delta_rule included) count one dispatch each, the others run
their reference op by op. Prints, per part of the model, the dispatches, the host syncs and the
uploads of a prefill chunk of ``--prompt`` tokens and of a decode step with ``--batch`` requests
decoding, then every sync with its source line. Counts only (no timing: the emulation runs at CPU
speed, far from the device's). Nothing is written to RESULTS.md.

    python benchmarks/count_mps_step.py --layers 4 --prompt 256 --batch 4
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's hebrus_torch

from tiny_qwen4exp import random_model  # noqa: E402

from hebrus_torch import _emulate  # noqa: E402
from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402
from hebrus_torch.engine.step_counts import StepCounts, count_step  # noqa: E402


def real_size_model(layers: int, *, hidden: int = 2048, vocab: int = 32000, experts: int = 16):
    """Random weights, Qwen-like head sizes; ``layers`` alternate linear / indexed attention."""
    layer_types = ["linear_attention", "indexed_attention"] * (layers // 2) + ["linear_attention"] * (layers % 2)
    return random_model(
        0, attn_implementation="sdpa", embed_shift=2.0, index_shift=1.0, vocab_size=vocab, hidden_size=hidden,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, num_hidden_layers=len(layer_types),
        layer_types=layer_types, ple_layer_ids=[i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
        ple_embed_dim=512, ngram_vocab_size_base=50_000, ngram_size=3, heads_per_ngram=8,
        indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        hc_lowrank=32, eos_token_id=2, pad_token_id=0, bos_token_id=1, max_position_embeddings=65536)


def print_counts(title: str, counts: StepCounts, sites: bool) -> None:
    print(f"\n{title}")
    print(f"  {'part':40s} {'dispatches':>10s} {'syncs':>6s} {'uploads':>8s}")
    for part, d, s, u in counts.table():
        print(f"  {part:40s} {d:10d} {s:6d} {u:8d}")
    if counts.fallbacks:
        print("  hebrus ops run as their reference:", {f"{p}: {op}": n for (p, op), n in counts.fallbacks.items()})
    if sites:
        print("  syncs by source line:")
        for (part, what, site), n in sorted(counts.sync_sites.items()):
            print(f"    {n:3d}  {what:18s} {site:32s} ({part})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=256, help="tokens of the prefill chunk")
    parser.add_argument("--batch", type=int, default=4, help="requests decoding in the decode step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default=_emulate.from_env() or "mps", help="device type to emulate")
    parser.add_argument("--no-sites", action="store_true", help="do not list the syncs by source line")
    parser.add_argument("--fallback", action="append", default=[], metavar="OP",
                        help="count hebrus op OP as not native (its reference runs), e.g. gdn_delta_rule as on "
                             "MPS before its Metal kernel")
    args = parser.parse_args()
    if args.fallback:
        _emulate.NATIVE_OPS[args.device] = _emulate.NATIVE_OPS[args.device] - set(args.fallback)
    torch.set_num_threads(args.threads)
    model = real_size_model(args.layers, hidden=args.hidden)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 32000, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    config = EngineConfig(capacity_tokens=args.batch * (args.prompt + 16) + 64, max_sequences=args.batch,
                          max_batch_tokens=args.prompt, allow_block_sharing=False)
    print(f"emulating {args.device} on CPU (torch {torch.__version__}, {args.threads} threads): {args.layers} layers "
          f"{list(model.config.layer_types)}, hidden {args.hidden}, fp32, greedy; native: "
          f"{sorted(_emulate.NATIVE_OPS[args.device])}")
    with torch.no_grad(), _emulate.emulate(args.device) as dev:
        engine = Engine(model.to(dev), config)
        for p in prompts:
            engine.add_request(p, max_new_tokens=64)
        prefill = count_step(engine)                     # request 0's prompt: one chunk of --prompt tokens
        while any(not r.generated for r in engine.requests.values()):
            engine.step()                                # the others' prompts
        decode = count_step(engine)                      # every request decodes one token
    print_counts(f"prefill chunk: 1 request x {args.prompt} tokens", prefill, not args.no_sites)
    print_counts(f"decode step: {args.batch} requests x 1 token", decode, not args.no_sites)


if __name__ == "__main__":
    main()

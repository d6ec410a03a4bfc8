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

``--released`` counts the released checkpoint's structure instead (REAL_MODEL.md: 3 linear-attention
layers then an indexed one, PLE on decoder layer 1; 512 experts, top 10; hc_count 4, hc_lowrank 320;
attention 24 x 256 with its output gate, 2 KV heads, partial rotary 0.25; GDN 16 / 48 heads of 128;
indexer 4 + 1 heads of 128, budget 2048, compress ratio 4; bf16) with the widths that only size
weights scaled down to fit a CPU (``--hidden`` 256, expert and shared-expert intermediate 64, PLE
embedding = hidden, vocabulary 32000, n-gram table base 50,000): what is dispatched does not depend
on them (``--check-widths`` recounts at twice the widths and compares). It prints, per part and per
layer type, the dispatches and syncs of a decode step at each of ``--batches`` (default 1, 8, 64)
and of one prefill chunk of ``--prompt`` tokens (default 512), with ``--markdown`` as RESULTS.md rows:

    python benchmarks/count_mps_step.py --released --markdown
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's hebrus_torch

from tiny_qwen4exp import random_model, released_structure_model  # noqa: E402

from hebrus_torch import _emulate  # noqa: E402
from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402
from hebrus_torch.engine.step_counts import PARTS, StepCounts, count_step  # noqa: E402


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


RELEASED_LAYERS = {"linear_attention": 36, "indexed_attention": 12}


def count_engine(model, device: str, *, batch: int, prompt: int, decode_context: int = 24):
    """(prefill counts of one chunk of ``prompt`` tokens, decode counts with ``batch`` requests decoding
    after prompts of ``decode_context`` tokens)."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    config = EngineConfig(capacity_tokens=prompt + batch * (decode_context + 16) + 64, max_sequences=batch + 1,
                          max_batch_tokens=max(prompt, batch * decode_context), allow_block_sharing=False)
    with torch.no_grad(), _emulate.emulate(device) as dev:
        engine = Engine(model.to(dev), config)
        engine.add_request(torch.randint(4, vocab, (prompt,), generator=gen).tolist(), max_new_tokens=1)
        prefill = count_step(engine)                 # the one chunk (its request then ends)
        while engine.requests and any(not r.generated for r in engine.requests.values()):
            engine.step()
        for _ in range(batch):
            engine.add_request(torch.randint(4, vocab, (decode_context,), generator=gen).tolist(), max_new_tokens=64)
        while any(not r.generated for r in engine.requests.values()):
            engine.step()
        decode = count_step(engine)
    assert len(decode.outputs) == batch, "every request decodes in the counted step"
    return prefill, decode


PER_LAYER_PARTS = ("gdn", "attention", "ple", "moe", "hyper-connections")


def per_layer(counts: StepCounts, layer_types: list[str], ple_layers: int) -> dict[str, tuple[float, float]]:
    """{row: (dispatches, syncs)} per layer of each type and per part (a part's count over the layers
    it runs in), plus the step's average per layer (everything, engine included, over the layers)."""
    n_layers = len(layer_types)
    runs_in = {"gdn": layer_types.count("linear_attention"), "attention": layer_types.count("indexed_attention"),
               "ple": ple_layers, "moe": n_layers, "hyper-connections": n_layers}
    rows = {}
    for part in PER_LAYER_PARTS:
        label, n = PARTS[part], runs_in[part]
        rows[part] = (counts.dispatches[label] / n if n else 0.0, counts.syncs[label] / n if n else 0.0)
    shared = [rows["moe"][i] + rows["hyper-connections"][i] for i in range(2)]
    rows["linear_attention layer"] = (rows["gdn"][0] + shared[0], rows["gdn"][1] + shared[1])
    rows["indexed_attention layer"] = (rows["attention"][0] + shared[0], rows["attention"][1] + shared[1])
    rows["average per layer (whole step / layers)"] = (counts.total_dispatches / n_layers, counts.total_syncs / n_layers)
    return rows


def released_report(args) -> None:
    dtype = getattr(torch, args.dtype)
    model = released_structure_model(args.hidden, args.inter, dtype=dtype, layers=args.layers)
    if args.quantize:
        from hebrus_torch.convert.model import quantize_model

        quantize_model(model, bits=args.quantize, group_size=32)     # (the converter's categories; tiny widths)
    layer_types = list(model.config.layer_types)
    runs = {}
    for batch in args.batches:
        prefill, decode = count_engine(model, args.device, batch=batch, prompt=args.prompt)
        runs[f"decode, {batch} request{'s' if batch > 1 else ''}"] = decode
        runs.setdefault(f"prefill chunk, {args.prompt} tokens", prefill)
    if args.check_widths:
        wide = released_structure_model(2 * args.hidden, 2 * args.inter, dtype=dtype, layers=args.layers)
        for batch in args.batches[:1]:
            p2, d2 = count_engine(wide, args.device, batch=batch, prompt=args.prompt)
            same = (p2.dispatches == runs[f"prefill chunk, {args.prompt} tokens"].dispatches and
                    d2.dispatches == runs[f"decode, {batch} request{'s' if batch > 1 else ''}"].dispatches)
            print(f"widths x2 (hidden {2 * args.hidden}, intermediate {2 * args.inter}): counts "
                  f"{'identical' if same else 'DIFFER'}")
    cols = list(runs)
    print(f"\nreleased structure, {len(layer_types)} layers {layer_types}, PLE on layer 1, {args.dtype}, "
          f"hidden {args.hidden}, expert intermediate {args.inter}; dispatches (syncs)")
    tables = {c: per_layer(runs[c], layer_types, 1) for c in cols}
    rows = [PARTS[p] for p in PER_LAYER_PARTS] + ["linear_attention layer", "indexed_attention layer",
                                                    "average per layer (whole step / layers)"]
    keys = list(PER_LAYER_PARTS) + rows[len(PER_LAYER_PARTS):]
    if args.markdown:
        print("| per layer | " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * len(cols))
    for row, key in zip(rows, keys):
        cells = [f"{tables[c][key][0]:g} ({tables[c][key][1]:g})" for c in cols]
        print(f"| {row} | " + " | ".join(cells) + " |" if args.markdown else f"  {row:44s} " + "  ".join(
            f"{x:>12s}" for x in cells))
    print()
    if args.markdown:
        print("| whole step | " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * len(cols))
    for label in list(PARTS.values()) + ["total"]:
        cells = []
        for c in cols:
            d = runs[c].total_dispatches if label == "total" else runs[c].dispatches[label]
            y = runs[c].total_syncs if label == "total" else runs[c].syncs[label]
            cells.append(f"{d} ({y})")
        print(f"| {label} | " + " | ".join(cells) + " |" if args.markdown else f"  {label:44s} " + "  ".join(
            f"{x:>12s}" for x in cells))
    n36, n12 = RELEASED_LAYERS["linear_attention"], RELEASED_LAYERS["indexed_attention"]
    for c in cols:
        t = tables[c]
        model_parts = (n36 * t["linear_attention layer"][0] + n12 * t["indexed_attention layer"][0] + t["ple"][0])
        print(f"{c}: at 48 layers (36 linear, 12 indexed, 1 PLE) the layers dispatch {model_parts:.0f} ops "
              f"({model_parts / 48:.1f} per layer) plus embedding, head and engine")
    for c in cols:
        print_counts(c, runs[c], not args.no_sites)


def print_counts(title: str, counts: StepCounts, sites: bool) -> None:
    print(f"\n{title}")
    print(f"  {'part':40s} {'dispatches':>10s} {'syncs':>6s} {'uploads':>8s}")
    for part, d, s, u in counts.table():
        print(f"  {part:40s} {d:10d} {s:6d} {u:8d}")
    if counts.fallbacks:
        print("  hebrus ops run as their reference:", {f"{p}: {op}": n for (p, op), n in counts.fallbacks.items()})
    for what, found in (("ops without an MPS kernel", counts.no_kernel),
                        ("composites that read the device", counts.composite_reads)):
        if found:
            print(f"  {what}:", {f"{p}: {op}": n for (p, op), n in found.items()})
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
    parser.add_argument("--released", action="store_true", help="the released checkpoint's structure (see above)")
    parser.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 64],
                        help="--released: requests decoding, comma-separated")
    parser.add_argument("--inter", type=int, default=64, help="--released: expert / shared-expert intermediate")
    parser.add_argument("--dtype", default="bfloat16", help="--released: weight dtype")
    parser.add_argument("--quantize", type=int, choices=(4, 8), default=None,
                        help="--released: the converter's weights quantized to this many bits (group 32)")
    parser.add_argument("--check-widths", action="store_true", help="--released: recount at twice the widths")
    parser.add_argument("--markdown", action="store_true", help="--released: RESULTS.md table rows")
    args = parser.parse_args()
    if args.released:
        if "--hidden" not in sys.argv:
            args.hidden = 256
        if "--prompt" not in sys.argv:
            args.prompt = 512
        torch.set_num_threads(args.threads)
        if args.fallback:
            _emulate.NATIVE_OPS[args.device] = _emulate.NATIVE_OPS[args.device] - set(args.fallback)
        released_report(args)
        return
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

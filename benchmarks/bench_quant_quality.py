"""What 4- and 8-bit weights do to Qwen4Exp's next-token distribution (issue 36): mean KL(P_full || P_quant) and
top-1 agreement against the unquantized model over a fixed text, teacher-forced, in fp32, for this project's
affine format (hebrus_torch/moe/quantize.py) at 4 and 8 bits with groups of 32, 64 and 128, beside MLX's affine
format of the same bits and groups and GGUF's (llama.cpp) Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, on the same weights.

    pip install gguf "mlx[cpu]"      # optional: the rows of a format whose package is missing are skipped
    python benchmarks/bench_quant_quality.py --work-dir /tmp/hebrus-quality [--threads 1] [--json out.json]

Two models, both transformers 5.23.0 ``Qwen4ExpForCausalLM`` run in fp32 from bf16-stored weights (the
released dtype; every format quantizes those bf16 values, the affine ones with bf16 scales and biases):

- ``trained``: a small Qwen4Exp (hidden 128, 4 layers linear/indexed, 8 experts x 128 top 2, shared expert 128,
  byte-level vocabulary of 256) trained on the start of Python's ``pydoc_data/topics.py`` (the reference
  manual's text, present in every CPython installation), evaluated on a held-out stretch of it. The trained
  checkpoint is cached in --work-dir under a name that hashes the config, the steps and the text, so reruns
  skip training; ``--train-device cuda`` trains on a GPU.
- ``random``: random weights at the released shapes per layer (hidden 2560, experts x 640 top 10, GDN 16/48
  heads of 128, attention 24/2 heads of 256, indexer 4 x 128, hyper-connections 4 / 320; the shapes of
  benchmarks/bench_ple_disk.py) with 2 layers (linear, indexed), --random-experts experts and a 32768
  vocabulary, on a shorter text.

Each model gets two row sets: the experts (routed + shared) quantized, and the experts plus the attention / GDN
/ indexer / hyper-connection projections (hebrus_torch/quality.py says which weights; norms, router, embeddings,
PLE and lm_head stay). A weight whose input dimension is no multiple of a format's group (the hyper-connections'
``input_mix_weight_up``, 320 wide at the released shape, at group 128) stays unquantized in that row: the
table's "kept" column counts them. Bits per weight: codes plus per-group scale (and bias/min) storage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from hebrus_torch.moe.quantize import dequantize, quantize, unpack  # noqa: E402
from hebrus_torch.quality import fake_quantize_, next_token_kl, select_weights, top1_agreement  # noqa: E402

ROW_SETS = {"experts": ("routed_experts", "shared_expert"),
            "experts+proj": ("routed_experts", "shared_expert", "projections")}
CHUNK_ROWS = 4096            # rows quantized at a time (bounds the fp32 / int64 working set)


# ------------------------------------------------------------------------------------------ the text
def text_bytes(path: Path | None = None) -> tuple[bytes, str]:
    """The text (by default the reference manual's, shipped with CPython as pydoc_data/topics.py) and its
    sha256."""
    if path is None:
        import pydoc_data.topics as topics

        path = Path(topics.__file__)
    data = path.read_bytes()
    return data, hashlib.sha256(data).hexdigest()


def split_text(data: bytes, held_out: int = 1 << 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte ids: the training part and the held-out last ``held_out`` bytes."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return ids[:-held_out], ids[-held_out:]


# ------------------------------------------------------------------------------------------ the models
def trained_config():
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(
        vocab_size=256, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention"] * 2, ple_layer_ids=[1, 3],
        ple_embed_dim=128, eos_token_id=0, pad_token_id=0, bos_token_id=0, hc_count=2, hc_lowrank=128,
        ngram_vocab_size_base=1000, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=128,
        indexer_compress_ratio=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096)
    config._attn_implementation = "eager"
    return config


def train(train_ids: torch.Tensor, steps: int, batch: int, seq: int, lr: float, device: str, seed: int = 0):
    """AdamW with warmup and cosine decay on random windows of ``train_ids``; returns the fp32 model (CPU) and
    the loss of each step."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = m.Qwen4ExpForCausalLM(trained_config())
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + torch.cos(torch.tensor(torch.pi * min(s, steps) / steps)).item()) + 0.02)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(train_ids) - seq, (batch,), generator=gen)
        x = torch.stack([train_ids[s:s + seq] for s in starts]).to(device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"  step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return model.cpu().eval(), losses


def trained_model(work_dir: Path, args, data: bytes, sha: str):
    """The cached trained checkpoint (bf16) under work_dir, trained first if absent; returns (model, info)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m

    key = json.dumps([trained_config().to_dict(), args.train_steps, args.train_batch, args.train_seq, args.lr,
                      args.train_device, sha],
                     sort_keys=True, default=str)
    directory = work_dir / f"trained-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (directory / "config.json").exists():
        train_ids, _ = split_text(data)
        print(f"training {directory.name}: {args.train_steps} steps of {args.train_batch} x {args.train_seq} "
              f"bytes on {args.train_device}", flush=True)
        t0 = time.perf_counter()
        model, losses = train(train_ids, args.train_steps, args.train_batch, args.train_seq, args.lr,
                              args.train_device)
        info = {"steps": args.train_steps, "batch": args.train_batch, "seq": args.train_seq, "lr": args.lr,
                "device": args.train_device, "train_seconds": time.perf_counter() - t0,
                "first_loss": losses[0], "last_losses": losses[-10:]}
        tmp = directory.with_name(directory.name + ".tmp")
        model.to(torch.bfloat16).save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(info, indent=2))
        tmp.rename(directory)
    info = json.loads((directory / "training.json").read_text())
    model = m.Qwen4ExpForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval(), info | {"checkpoint": str(directory)}


def random_released_model(experts: int):
    """Random weights at the released shapes per layer (bench_ple_disk's), 2 layers, ``experts`` experts, stored
    bf16 (rounded, then run in fp32)."""
    from bench_ple_disk import released_shapes
    from tiny_qwen4exp import random_model

    shapes = released_shapes(experts, 1000).to_dict()
    keep = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "hc_count", "hc_lowrank", "indexer_n_heads", "indexer_kv_heads",
            "indexer_head_dim", "indexer_budget", "indexer_compress_ratio", "ngram_size", "heads_per_ngram",
            "ngram_vocab_size_base", "ple_embed_dim", "ple_conv_kernel_size", "max_position_embeddings")
    overrides = {k: shapes[k] for k in keep} | dict(
        num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], ple_layer_ids=[1],
        split_ngram_parts=1, eos_token_id=3, pad_token_id=0, bos_token_id=1)
    return random_model(0, **overrides).to(torch.bfloat16).float()


# ------------------------------------------------------------------------------------------ the formats
def _rows(w: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn over ``w`` [..., in] viewed as 2-D rows, CHUNK_ROWS at a time, back in w's shape (fp32)."""
    flat = w.reshape(-1, w.shape[-1])
    return torch.cat([fn(flat[i:i + CHUNK_ROWS]) for i in range(0, flat.shape[0], CHUNK_ROWS)]).reshape(w.shape)


def ours(bits: int, group: int):
    def round_trip(w: torch.Tensor) -> torch.Tensor | None:
        if w.shape[-1] % group:
            return None
        return _rows(w, lambda r: dequantize(*quantize(r.to(torch.bfloat16), bits, group), bits, group))
    return round_trip


def mlx_codes(w: torch.Tensor, bits: int, group: int):
    """mlx's quantize of ``w`` [rows, in] (bf16 or fp32): (codes as int32 words, scales, biases in w's dtype)."""
    import mlx.core as mx
    import numpy as np

    a = mx.array(w.float().numpy())
    q, s, b = mx.quantize(a.astype(mx.bfloat16) if w.dtype == torch.bfloat16 else a, group_size=group, bits=bits)
    as_torch = lambda x: torch.from_numpy(np.array(x.astype(mx.float32))).to(w.dtype)  # noqa: E731
    return torch.from_numpy(np.array(q).view(np.int32)), as_torch(s), as_torch(b)


def mlx_affine(bits: int, group: int):
    """mlx's codes, scales and biases, dequantized in fp32 by mx.dequantize (scales and biases upcast first)."""
    def round_trip(w: torch.Tensor) -> torch.Tensor | None:
        import mlx.core as mx
        import numpy as np

        if w.shape[-1] % group:
            return None

        def one(r):
            q, s, b = mx.quantize(mx.array(r.float().numpy()).astype(mx.bfloat16), group_size=group, bits=bits)
            d = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
            return torch.from_numpy(np.array(d))
        return _rows(w, one)
    return round_trip


def gguf_format(name: str):
    def round_trip(w: torch.Tensor) -> torch.Tensor | None:
        from gguf import GGMLQuantizationType, quants

        kind = GGMLQuantizationType[name]
        if w.shape[-1] % quants.GGML_QUANT_SIZES[kind][0]:
            return None
        return _rows(w, lambda r: torch.from_numpy(quants.dequantize(quants.quantize(r.float().numpy(), kind), kind)))
    return round_trip


def gguf_bits(name: str) -> float:
    from gguf import GGMLQuantizationType, quants

    block, size = quants.GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    return 8 * size / block


def formats(only: list[str] | None) -> tuple[list[tuple[str, float, Callable]], list[str]]:
    """[(label, bits per weight, round trip)] of every format whose package is installed, and notes on the rest."""
    rows, notes = [], []
    affine = [(b, g) for b in (4, 8) for g in (32, 64, 128)]
    rows += [(f"ours affine {b}-bit g{g}", b + 32 / g, ours(b, g)) for b, g in affine]
    try:
        import mlx.core  # noqa: F401
        rows += [(f"mlx affine {b}-bit g{g}", b + 32 / g, mlx_affine(b, g)) for b, g in affine]
    except ImportError as e:
        notes.append(f"mlx not installed ({e}): no mlx rows (pip install 'mlx[cpu]')")
    try:
        from importlib.metadata import version

        from gguf import GGMLQuantizationType, quants
        import numpy as np

        for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
            try:
                quants.quantize(np.zeros((1, 256), np.float32), GGMLQuantizationType[name])
            except NotImplementedError:
                notes.append(f"gguf {version('gguf')} cannot quantize {name} in Python (NotImplementedError): "
                             "no row")
                continue
            rows.append((f"gguf {name}", gguf_bits(name), gguf_format(name)))
    except ImportError as e:
        notes.append(f"gguf not installed ({e}): no gguf rows (pip install gguf)")
    if only:
        rows = [r for r in rows if any(o in r[0] for o in only)]
    return rows, notes


# ------------------------------------------------------------------------------------------ measuring
@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids[None]).logits[0].float()


def evaluate(model, ids: torch.Tensor, fmts, label: str) -> dict:
    """Reference logits, then for every row set and format: quantize-dequantize, forward, compare, restore."""
    t0 = time.perf_counter()
    ref = logits_of(model, ids)
    every = select_weights(model, ROW_SETS["experts+proj"])
    saved = {name: p.detach().clone() for name, p in every.items()}
    out = {"model": label, "tokens": int(ids.numel()), "forward_seconds": time.perf_counter() - t0,
           "reference_nll": torch.nn.functional.cross_entropy(ref[:-1], ids[1:]).item(),
           "quantized_params": {k: sum(p.numel() for p in select_weights(model, v).values())
                                for k, v in ROW_SETS.items()},
           "params": sum(p.numel() for p in model.parameters()), "rows": []}
    print(f"{label}: {out['params'] / 1e6:.1f} M parameters, {ids.numel()} tokens, reference forward "
          f"{out['forward_seconds']:.1f} s, its loss on the text {out['reference_nll']:.3f} nats/token", flush=True)
    per_position: dict[tuple[str, str], torch.Tensor] = {}
    for set_name, sets in ROW_SETS.items():
        for fmt, bpw, round_trip in fmts:
            t0 = time.perf_counter()
            status = fake_quantize_(model, sets, round_trip)
            logits = logits_of(model, ids)
            kl = next_token_kl(ref, logits)
            per_position[(set_name, fmt)] = kl
            row = {"set": set_name, "format": fmt, "bits_per_weight": bpw, "kl_mean": kl.mean().item(),
                   "kl_median": kl.median().item(), "kl_p99": kl.quantile(0.99).item(),
                   "top1": top1_agreement(ref, logits),
                   "kept": sum(v == "kept" for v in status.values()), "seconds": time.perf_counter() - t0}
            out["rows"].append(row)
            print(f"  {set_name:13s} {fmt:22s} {bpw:5.2f} bpw  KL {row['kl_mean']:.3e}  top-1 {row['top1']:.4f}  "
                  f"kept {row['kept']}  ({row['seconds']:.0f} s)", flush=True)
            with torch.no_grad():
                for name, p in every.items():
                    p.copy_(saved[name])
    out["ours_minus_mlx"] = paired_differences(per_position)
    return out


def paired_differences(per_position: dict[tuple[str, str], torch.Tensor]) -> list[dict]:
    """Ours against mlx at the same bits and group, position by position: the mean of KL(ours) - KL(mlx) and its
    standard error (positive: ours is worse)."""
    out = []
    for (set_name, fmt), kl in per_position.items():
        other = per_position.get((set_name, fmt.replace("ours", "mlx")))
        if fmt.startswith("ours") and other is not None:
            d = (kl - other).double()
            out.append({"set": set_name, "format": fmt.replace("ours ", ""), "mean": d.mean().item(),
                        "stderr": (d.std() / d.numel() ** 0.5).item(),
                        "positions_ours_lower": int((d < 0).sum()), "positions": d.numel()})
    return out


@torch.no_grad()
def op_check(model, ids: torch.Tensor) -> dict:
    """4-bit g64 routed experts through the real op (QuantizedExperts, hebrus::moe_experts_quantized) against the
    same weights quantize-dequantized in place: the fake-quantized rows measure what the op computes."""
    from hebrus_torch.moe.quantized_experts import quantize_experts

    import copy
    fake = copy.deepcopy(model)
    fake_quantize_(fake, ["routed_experts"], ours(4, 64))
    fake_logits = logits_of(fake, ids)
    del fake
    real = quantize_experts(copy.deepcopy(model), bits=4, group_size=64)
    real_logits = logits_of(real, ids)
    return {"max_abs_logit_diff": (real_logits - fake_logits).abs().max().item(),
            "kl_mean": next_token_kl(fake_logits, real_logits).mean().item(),
            "top1": top1_agreement(fake_logits, real_logits)}


def mlx_bitwise(model, groups=(32, 64, 128), bits=(4, 8), tensors: int = 4) -> dict:
    """Our codes, scales and biases against mlx's on the first ``tensors`` expert and projection weights (their
    first 2048 rows), per bits and group: how many tensors match bitwise as bf16 (the stored dtype) and as fp32,
    the codes that differ (bf16) and each format's summed squared error of the dequantized bf16 weights."""
    import mlx.core  # noqa: F401

    names = list(select_weights(model, ["routed_experts"]))[:tensors // 2] + \
        list(select_weights(model, ["projections"]))[:tensors - tensors // 2]
    params = dict(model.named_parameters())
    out = {}
    for b in bits:
        for g in groups:
            compared, equal, equal_fp32, differing_codes, total_codes, err_ours, err_mlx = 0, 0, 0, 0, 0, 0.0, 0.0
            for name in names:
                w = params[name].detach().reshape(-1, params[name].shape[-1])[:2048].to(torch.bfloat16)
                if w.shape[-1] % g:
                    continue
                compared += 1
                qo, so, bo = quantize(w, b, g)
                qm, sm, bm = mlx_codes(w, b, g)
                same = torch.equal(qo, qm) and torch.equal(so.view(torch.int16), sm.view(torch.int16)) and \
                    torch.equal(bo.view(torch.int16), bm.view(torch.int16))
                equal += same
                ours32, mlx32 = quantize(w.float(), b, g), mlx_codes(w.float(), b, g)
                equal_fp32 += all(torch.equal(x, y) for x, y in zip(ours32, mlx32))
                co, cm = unpack(qo, b), unpack(qm, b)
                differing_codes += int((co != cm).sum())
                total_codes += co.numel()
                err_ours += float(((dequantize(qo, so, bo, b, g) - w.float()) ** 2).sum())
                err_mlx += float(((dequantize(qm, sm, bm, b, g) - w.float()) ** 2).sum())
            out[f"{b}-bit g{g}"] = {"tensors": compared, "bitwise_equal": equal,
                                    "bitwise_equal_as_fp32": equal_fp32, "differing_codes": differing_codes,
                                    "codes": total_codes, "sq_error_ours": err_ours, "sq_error_mlx": err_mlx}
    return out


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": installed("transformers"), "mlx": installed("mlx"), "gguf": installed("gguf"),
            "loadavg_start": os.getloadavg()}


def markdown(entry: dict) -> str:
    """One model's rows as a markdown table (what RESULTS.md copies)."""
    lines = ["| weights quantized | format | bits/weight | mean KL (nats) | median KL | KL p99 | top-1 agreement "
             "| kept |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['set']} | {r['format']} | {r['bits_per_weight']:.2f} | {r['kl_mean']:.2e} | "
              f"{r['kl_median']:.2e} | {r['kl_p99']:.2e} | {100 * r['top1']:.2f}% | {r['kept']} |"
              for r in entry["rows"]]
    lines += ["", "| weights quantized | format | mean KL(ours) - KL(mlx) | standard error "
              "| positions where ours is lower |", "|---|---|---|---|---|"]
    lines += [f"| {d['set']} | {d['format']} | {d['mean']:+.2e} | {d['stderr']:.2e} | "
              f"{d['positions_ours_lower']} of {d['positions']} |" for d in entry["ours_minus_mlx"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="cache of the trained checkpoint")
    parser.add_argument("--models", default="trained,random", help="comma list of: trained, random")
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--train-batch", type=int, default=1)
    parser.add_argument("--train-seq", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--train-device", default="cpu")
    parser.add_argument("--train-only", action="store_true", help="train (and cache) the checkpoint, then stop")
    parser.add_argument("--eval-tokens", type=int, default=4096, help="text length for the trained model")
    parser.add_argument("--eval-offset", type=int, default=0, help="where in the held-out text both evaluations start")
    parser.add_argument("--random-tokens", type=int, default=192, help="text length for the random model")
    parser.add_argument("--random-experts", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", type=Path, help="the text (default: this Python's pydoc_data/topics.py)")
    parser.add_argument("--formats", default="", help="comma list of substrings: only formats whose label has one")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    data, sha = text_bytes(args.text)
    _, held_out = split_text(data)
    fmts, notes = formats([f for f in args.formats.split(",") if f])
    result = {"machine": machine(), "text": {"file": str(args.text or "pydoc_data/topics.py"), "sha256": sha},
              "notes": notes, "models": []}
    for note in notes:
        print("note:", note)
    for which in args.models.split(","):
        if which == "trained":
            model, info = trained_model(args.work_dir, args, data, sha)
            if args.train_only:
                print(json.dumps(info, indent=2))
                return info
            ids = held_out[args.eval_offset:args.eval_offset + args.eval_tokens]
        elif which == "random":
            model, info = random_released_model(args.random_experts), {"experts": args.random_experts}
            ids = held_out[args.eval_offset:args.eval_offset + args.random_tokens]
        else:
            raise SystemExit(f"unknown model {which!r}")
        entry = evaluate(model, ids, fmts, which) | {"info": info}
        if any(f[0].startswith("mlx") for f in fmts):
            entry["mlx_bitwise"] = mlx_bitwise(model)
            print("  ours vs mlx, bitwise:", entry["mlx_bitwise"], flush=True)
        entry["op_check"] = op_check(model, ids)
        print("  op check (4-bit g64 routed experts, op vs in-place dequantize):", entry["op_check"], flush=True)
        result["models"].append(entry)
        print(markdown(entry), flush=True)
        del model
    result["machine"]["loadavg_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""``python -m hebrus_torch``: which ops run natively where, a chunked-prefill PLE demo on the best device,
then (with transformers installed, ``pip install -e .[hf]``) a tiny random Qwen4Exp run through
transformers as is and through ``hebrus_torch.integrations.transformers.apply`` (parity and speed), and
a batch of prompts of mixed lengths through continuous batching (``hebrus_torch.engine``), checked
against per-prompt ``generate`` and timed against sequential and padded-batch ``generate``.
``--model DIR`` runs the continuous-batching part on a local Qwen4Exp checkpoint; ``--report`` prints only the
torch, whether the native extension is in use (and why not) and the op table (exit status 1 without it)."""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import hebrus_torch as ht
from hebrus_torch import _extension
from hebrus_torch._op_registry import OPS, has_native_kernel
from hebrus_torch._torch_support import supported_range_text, unsupported_torch


def available_devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def kernel_table() -> str:
    devices = available_devices()
    width = max(map(len, OPS)) + 2
    lines = [f"{'op':<{width}}" + "".join(f"{d:>12}" for d in devices)]
    for op, spec in OPS.items():
        cells = ["native" if has_native_kernel(op, d)
                 else "native+copy" if spec.composite_via and has_native_kernel(spec.composite_via, d)
                 else "reference" for d in devices]
        lines.append(f"{op:<{width}}" + "".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


def extension_report() -> str:
    """The torch this runs on, whether it is a supported one, and whether the compiled extension (the
    native kernels) is in use: what it was built against, or plainly why not and what to do."""
    lines = [f"hebrus_torch {ht.__version__} on torch {torch.__version__}"
             + ("" if unsupported_torch(torch.__version__) is None
                else f" (outside the supported range: {supported_range_text()})")]
    if _extension.EXTENSION_ERROR is None:
        info = _extension.build_info() or {}
        built = [f"built against torch {info['torch']}"] if info.get("torch") else []
        built += [f"-std={info['cxx']}"] if info.get("cxx") else []
        lines.append("native extension: loaded" + (f" ({', '.join(built)})" if built else ""))
    else:
        lines.append("native extension: NOT USED: every op runs its PyTorch reference (the slow path)")
        lines.append(f"  why: {_extension.EXTENSION_ERROR}")
    return "\n".join(lines)


def progress(done: int, total: int, width: int = 32, label: str = "") -> None:
    filled = width * done // max(total, 1)
    sys.stdout.write(f"\r  {label}[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens")
    sys.stdout.flush()


def ple_demo(device: str, tokens: int, channels: int, layers: int, seed: int) -> bool:
    """A random token stream (with EOS) through PLEState in random chunks, checked against one shot."""
    gen = torch.Generator().manual_seed(seed)
    vocab, eos = 32000, 2
    params = [ht.PLEHashParams(torch.randint(1, 1 << 40, (3,), generator=gen) * 2 + 1,
                               torch.randint(50_000, 60_000, (16,), generator=gen),
                               torch.arange(16) * 60_000) for _ in range(layers)]
    weights = [torch.randn(channels, 4, generator=gen).to(device) for _ in range(layers)]

    def make() -> ht.PLEState:
        return ht.PLEState(layers, channels, vocab_size=vocab, eos_token_id=eos, max_sequences=2,
                           device=device, hash_params=params, conv_weights=weights)

    stream = torch.randint(0, vocab, (tokens,), generator=gen)
    stream[torch.rand(tokens, generator=gen) < 0.02] = eos
    x = torch.randn(tokens, channels, generator=gen).to(device)
    stream = stream.to(device)

    def run(state: ht.PLEState, seq: ht.SeqHandle, start: int, stop: int):
        cu = torch.tensor([0, stop - start], dtype=torch.int32, device=device)
        with ht.transaction(state):
            outs = [(state.ngram_ids(i, [seq], stream[start:stop], cu), state.conv(i, [seq], x[start:stop], cu))
                    for i in range(layers)]
        return outs

    one_shot = make()
    seq = one_shot.new_sequence()
    expected = run(one_shot, seq, 0, tokens)

    chunked = make()
    seq = chunked.new_sequence()
    rng = random.Random(seed)
    got, start = [], 0
    t0 = time.perf_counter()
    while start < tokens:
        stop = min(tokens, start + rng.choice([1, 2, 3, 17, 64, 256]))
        got.append(run(chunked, seq, start, stop))
        start = stop
        progress(start, tokens)
    if device == "mps":
        torch.mps.synchronize()
    elapsed = time.perf_counter() - t0
    print()
    same = all(torch.equal(torch.cat([g[i][j] for g in got]), expected[i][j]) for i in range(layers) for j in (0, 1))
    same = same and chunked.digest() == one_shot.digest()
    print(f"  {len(got)} random chunks vs one shot: ids, conv outputs, state digest "
          f"{'bitwise identical' if same else 'DIFFER'}")
    print(f"  chunked throughput: {tokens / elapsed:,.0f} tokens/s ({layers} PLE layers, C = {channels}, {device})")
    return same


def model_demo(device: str, prompt_len: int, new_tokens: int, seed: int) -> bool:
    """The same left-padded prompts through a tiny random Qwen4Exp, unpatched and patched: greedy decode."""
    from transformers.cache_utils import DynamicCache

    from hebrus_torch._demo import demo_model

    model = demo_model(seed, device)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, cfg.vocab_size, (2, prompt_len), generator=gen)
    prompt[:, 29::41] = cfg.eos_token_id                        # EOS inside the prompts
    pad = prompt_len // 4
    mask = torch.ones(2, prompt_len, dtype=torch.long)
    prompt[1, :pad], mask[1, :pad] = cfg.pad_token_id, 0        # second prompt left-padded
    prompt, mask = prompt.to(device), mask.to(device)
    print(f"  random Qwen4ExpForCausalLM ({cfg.num_hidden_layers} layers: {cfg.layer_types.count('indexed_attention')} "
          f"indexed, PLE on 1-based layers {cfg.ple_layer_ids}), indexer budget {cfg.indexer_budget} = top "
          f"{cfg.indexer_budget // cfg.indexer_compress_ratio} groups of {cfg.indexer_compress_ratio}; prompts of "
          f"{prompt_len} and {prompt_len - pad} tokens (left-padded), {new_tokens} greedy tokens each")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
        elif device == "mps":
            torch.mps.synchronize()

    def run(label: str):
        cache = DynamicCache(config=cfg)
        sync()
        t0 = time.perf_counter()
        out = model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
        sync()
        t_prefill = time.perf_counter() - t0
        logits, generated, am = [out.logits[:, -1]], [], mask
        t0 = time.perf_counter()
        for step in range(new_tokens):
            nxt = logits[-1].argmax(-1, keepdim=True)
            generated.append(nxt)
            am = torch.cat([am, am.new_ones(2, 1)], dim=1)
            logits.append(model(nxt, attention_mask=am, past_key_values=cache, use_cache=True).logits[:, -1])
            sync()
            progress(step + 1, new_tokens, label=f"{label:<16}")
        t_decode = time.perf_counter() - t0
        print()
        return t_prefill, t_decode, torch.cat(generated, 1), torch.stack(logits), out.logits

    threads, tf32 = torch.get_num_threads(), torch.backends.cudnn.allow_tf32
    if device == "cpu":
        torch.set_num_threads(1)        # a tiny model is thousands of tiny ops: threads only add sync cost
    # fp32 parity: cuDNN's default TF32 convolutions (transformers' conv1d on CUDA) differ by ~1e-4
    torch.backends.cudnn.allow_tf32 = False
    try:
        return _model_demo_runs(model, run, prompt, mask, new_tokens, prompt_len)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.allow_tf32 = tf32


def _near_ties(indexer, args, tol: float = 1e-4) -> torch.Tensor:
    """[B, T] bool: queries whose top-k boundary is an exact or near tie in transformers' own scores.

    Recomputes transformers' indexer math (5.23.0) after its forward, from the call's inputs and the
    cache's raw keys: per query, the groups of its visible tokens, pooled and roped at their first token,
    scored ``sum_h relu(q_h . k_g) / sqrt(D)``; a tie is a gap between the k-th and the (k+1)-th score of
    at most ``tol`` relative to the k-th. Only there may two valid top-k sets differ (SPEC §5.5)."""
    import math

    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling

    hidden, (full_cos, full_sin), attention_mask, cache = args
    batch, length, _ = hidden.shape
    dim, ratio, top_k = indexer.index_head_dim, indexer.compress_ratio, indexer.block_topk
    q, keys = torch.split(indexer.index_qk_proj(hidden), [indexer.index_n_heads * dim, indexer.index_kv_heads * dim],
                          dim=-1)
    q = indexer.q_layernorm(q.reshape(batch, length, -1, dim))
    q = modeling.apply_rotary_pos_emb(q, cos=full_cos[:, -length:], sin=full_sin[:, -length:], unsqueeze_dim=2)
    keys = cache.layers[indexer.layer_idx].indexer_keys if cache is not None else keys.reshape(batch, length, dim)
    visible = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
    ties = torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        for t in range(length):
            idx = torch.nonzero(visible[b, t]).flatten()
            groups = idx.shape[0] // ratio
            if groups <= top_k:
                continue                # every group is selected: no boundary
            cells = idx[:groups * ratio].view(groups, ratio)
            pooled = indexer.k_layernorm(keys[b].index_select(0, cells.flatten()).view(groups, ratio, dim)
                                         .float().mean(1).to(keys.dtype))
            pooled = modeling.apply_rotary_pos_emb(pooled.unsqueeze(1), cos=full_cos[b].index_select(0, cells[:, 0]),
                                                   sin=full_sin[b].index_select(0, cells[:, 0])).squeeze(1)
            scores = torch.relu(q[b, t].float() @ pooled.float().T).sum(0) / math.sqrt(dim)
            kth, nxt = scores.topk(top_k + 1).values[-2:].tolist()
            ties[b, t] = kth - nxt <= tol * max(abs(kth), 1e-30)
    return ties


def _model_demo_runs(model, run, prompt, mask, new_tokens, prompt_len) -> bool:
    """Parity of the patched run with transformers': selections equal except at (near) ties of transformers'
    scores, logits within 1e-4 wherever every selection they depend on is equal, tokens identical up to the
    first differing selection of their row."""
    from hebrus_torch.integrations import transformers as htx

    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling

    masks: list[torch.Tensor] = []
    ties: list[torch.Tensor] = []
    record_ties = [False]

    def hook(mod, args, out):
        masks.append(htx.selection_mask(out).cpu())
        if record_ties[0]:
            ties.append(_near_ties(mod, args))

    hooks = [mod.register_forward_hook(hook) for mod in model.modules() if isinstance(mod, modeling.Qwen4ExpTextQSAIndexer)]
    with torch.no_grad():
        warm = prompt[:, :16]                                   # first-call costs out of the timings
        for patched in (False, True):
            (htx.apply if patched else htx.revert)(model)
            model(warm)
        htx.revert(model)
        masks.clear()
        ref = run("transformers")
        ref_masks, masks[:] = list(masks), []
        htx.apply(model)
        htx.reset_stats()
        got = run("hebrus apply()")
        stats = htx.stats()
        got_masks, masks[:] = list(masks), []
        htx.revert(model)
        record_ties[0] = True                                  # transformers' scores, off the clock
        run("tie check")
    for h in hooks:
        h.remove()
    batch = prompt.shape[0]
    layers = sum(isinstance(m, modeling.Qwen4ExpTextQSAIndexer) for m in model.modules())
    rows = sum(m.shape[0] * m.shape[2] for m in ref_masks)
    # Differing selections per batch row as (indexed layer, position, at a tie). A difference at (l, p) is
    # downstream of one at (l' < l, p' <= p): its inputs differ already, so only the others must be ties.
    diffs: list[list[tuple[int, int, bool]]] = [[] for _ in range(batch)]
    differ = 0
    for call, (a, b, tie) in enumerate(zip(ref_masks, got_masks, ties)):
        bad = (a != b).any(-1)[:, 0]                                              # [B, T]
        differ += int(bad.sum())
        layer = call % layers
        offset = 0 if call < layers else prompt_len + (call - layers) // layers
        for r, t in torch.nonzero(bad).tolist():
            diffs[r].append((layer, offset + t, bool(tie[r, t])))
    untied = sum(1 for row in diffs for (l, p, tie) in row
                 if not tie and not any(l2 < l and p2 <= p for l2, p2, _ in row))
    # Logits at position p depend on every selection at positions <= p.
    first_diff = [min((p for _, p, _ in row), default=prompt_len + new_tokens + 1) for row in diffs]
    real = mask.bool().cpu()
    diff = 0.0
    same = True
    for r in range(batch):
        upto = min(first_diff[r], prompt_len)
        keep = real[r, :upto]
        if keep.any():
            diff = max(diff, (got[4][r, :upto][keep] - ref[4][r, :upto][keep]).abs().max().item())
        steps = max(0, min(first_diff[r] - prompt_len + 1, new_tokens + 1))     # logits[s] sees positions < prompt_len + s
        if steps:
            diff = max(diff, (got[3][:steps, r] - ref[3][:steps, r]).abs().max().item())
        same = same and torch.equal(got[2][r, :steps], ref[2][r, :steps])
    fallbacks = {k: v for k, v in stats.items() if k.startswith("qsa_fallback")}
    print(f"  parity: max |logit difference| {diff:.2e} where every selection they depend on is equal (prefill + "
          f"{new_tokens} steps, fp32); generated tokens {'identical' if same else 'DIFFER'}; indexer selections "
          f"identical for {rows - differ} of {rows} query rows"
          + ("" if not differ else " (the first of each row at an exact or near score tie, the others downstream)"
             if not untied else f"; {untied} of them NOT at a score tie nor downstream of one"))
    print(f"  hebrus path: {stats.get('qsa_hebrus', 0)} indexer calls, {stats.get('qsa_queries_selected', 0)} queries "
          f"selected sparsely, {stats.get('qsa_groups_pooled', 0)} groups pooled once each, "
          f"{stats.get('sparse_attention_calls', 0)} attention calls as qsa_attention"
          f"{'; fallbacks ' + str(fallbacks) if fallbacks else ''}")
    print(f"\n  {'phase':<26}{'transformers':>14}{'hebrus':>10}{'speedup':>9}")
    for name, i in ((f"prefill 2 x {prompt_len} tokens", 0), (f"decode {new_tokens} steps x 2", 1)):
        print(f"  {name:<26}{ref[i]:>12.3f} s{got[i]:>8.3f} s{ref[i] / got[i]:>8.1f}x")
    return same and untied == 0 and diff < 1e-4 and len(ties) == len(ref_masks) == len(got_masks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hebrus_torch", description=__doc__)
    parser.add_argument("--device", default=None, help="cpu, mps or cuda (default: the best available)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--channels", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", type=int, default=512, help="model demo: prompt length")
    parser.add_argument("--new-tokens", type=int, default=48, help="model demo: greedy tokens to generate")
    parser.add_argument("--report", action="store_true",
                        help="only print the torch, the extension's state and the op table; exit status 1 when the "
                             "extension is not in use")
    parser.add_argument("--no-model", action="store_true", help="skip the transformers model demos")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="continuous batching on this local Qwen4Exp checkpoint (only that part runs)")
    parser.add_argument("--ple-table", choices=("auto", "disk", "memory"), default="auto",
                        help="--model: the PLE n-gram table read from the checkpoint's files (disk), held in memory, "
                             "or auto (disk past a quarter of physical memory); docs/ple.md")
    parser.add_argument("--requests", type=int, default=16, help="continuous batching: concurrent requests")
    parser.add_argument("--cb-new-tokens", type=int, default=24, help="continuous batching: tokens per request")
    parser.add_argument("--max-batch-tokens", type=int, default=64, help="continuous batching: tokens per step")
    args = parser.parse_args(argv)
    if args.model is not None and not args.report:
        return cb_demo(args, checkpoint=args.model)
    print(extension_report())
    print(kernel_table())
    if args.report:
        return 0 if _extension.EXTENSION_ERROR is None else 1
    device = args.device or available_devices()[-1]
    print(f"\nPLE demo on {device}:")
    ok = ple_demo(device, args.tokens, args.channels, args.layers, args.seed)
    if args.no_model:
        return 0 if ok else 1
    try:
        import transformers  # noqa: F401
        from transformers.models.qwen4_exp import modeling_qwen4_exp  # noqa: F401
    except ImportError:
        print("\nModel demo skipped: it runs a tiny Qwen4Exp through Hugging Face transformers, which is not "
              "installed.\nInstall it with `pip install -e .[hf]` (transformers==5.23.0) and run "
              "`python -m hebrus_torch` again.")
        return 0 if ok else 1
    print(f"\nModel demo on {device}: transformers' Qwen4Exp as is vs hebrus_torch.integrations.transformers.apply")
    ok = model_demo(device, args.prompt, args.new_tokens, args.seed) and ok
    ok = cb_demo(args, device=device) == 0 and ok
    return 0 if ok else 1


def _load_checkpoint(checkpoint: str, device: str, ple_table: str):
    """A Qwen4Exp checkpoint loaded in place (hebrus_torch.from_pretrained, saying where its PLE table is);
    any other causal LM through transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if AutoConfig.from_pretrained(checkpoint).model_type in ("qwen4_exp", "qwen4_exp_text"):
        model = ht.from_pretrained(checkpoint, device=device, ple_table=ple_table)
        loaded = model.hebrus_checkpoint
        where = "read from the checkpoint's files" if loaded.ple_table == "disk" else "in memory"
        print(f"Loaded {checkpoint} in place; PLE n-gram table ({loaded.ple_table_bytes / 2**30:.2f} GiB) {where} "
              f"(--ple-table {ple_table})")
        return model, f"{checkpoint} ({type(model).__name__}, PLE table {loaded.ple_table})"
    model = AutoModelForCausalLM.from_pretrained(checkpoint).to(device).eval()
    return model, f"{checkpoint} ({type(model).__name__})"


def cb_demo(args: argparse.Namespace, checkpoint: str | None = None, device: str | None = None) -> int:
    """Continuous batching of mixed-length prompts vs generate, on the demo model or a local checkpoint."""
    from hebrus_torch.engine import EngineConfig, demo

    device = device or args.device or available_devices()[-1]
    if checkpoint is not None:
        model, what = _load_checkpoint(checkpoint, device, args.ple_table)
    else:
        model = demo.demo_model(args.seed, device)
        what = "a small random Qwen4Exp (6 layers, indexer budget 32)"
    vocab = model.config.get_text_config().vocab_size
    eos = model.config.get_text_config().eos_token_id
    prompts = demo.mixed_prompts(args.requests, vocab, 8, 256, args.seed,
                                 avoid=tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ())
    config = EngineConfig(capacity_tokens=sum(len(p) + args.cb_new_tokens for p in prompts) + 64,
                          max_sequences=args.requests, max_batch_tokens=args.max_batch_tokens, block_size=16)
    print(f"\nContinuous batching on {device}: {args.requests} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens through hebrus_torch.engine on {what}, {args.cb_new_tokens} greedy "
          f"tokens each")
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)        # (a tiny model: see model_demo)
    try:
        return 0 if demo.run(model, prompts, args.cb_new_tokens, config) else 1
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())

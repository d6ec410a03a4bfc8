"""Model drop-in benchmark: a random Qwen4ExpForCausalLM, transformers' own forward vs ``apply(model)``.

The model is small (few layers, hidden 256) but the patched paths run at Qwen4Exp sizes: indexer 4
heads x 128 dims, budget 2048 (512 groups of 4), PLE with N = 3 and 8 heads per n-gram order. Phases:
one-shot prefill of 2048 and 8192 tokens, then 128 greedy-length decode steps after each prompt.
Patched and unpatched run in the same process on the same weights and inputs. Module time is measured
with forward hooks around the indexers and PLE layers inside the model run.

Everything is measured by default. For machines or prompt lengths where transformers' per-query
indexer loop is too slow, ``--extrapolate-above N`` EXTRAPOLATES its prefill time above N tokens: the
original indexer runs on chunks of queries sampled at evenly spaced positions (the same work those
queries do in the full run: same keys, mask and positions) and the per-query cost is integrated over
positions (midpoint rule); rows so computed are marked. Every measured prefill also reports that
estimator next to the measurement. Writes the "Model drop-in (issue 5)" section of RESULTS.md.

    python benchmarks/bench_model.py [--tokens 2048 8192] [--decode 128] [--threads 1] [--repeat 2]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

from common import machine, sync, table, write_section
from tiny_qwen4exp import random_model

from hebrus_torch.integrations import transformers as htx


def build(device: str, layers: int):
    layer_types = ["linear_attention", "indexed_attention"] * (layers // 2)
    return random_model(
        0, device=device, attn_implementation="sdpa", embed_shift=2.0, index_shift=1.0,
        vocab_size=32000, hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        num_hidden_layers=len(layer_types), layer_types=layer_types,
        ple_layer_ids=[i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
        ple_embed_dim=256, ngram_vocab_size_base=50_000, ngram_size=3, heads_per_ngram=8,
        indexer_n_heads=4, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=4,
        hc_lowrank=32, eos_token_id=2, pad_token_id=0, bos_token_id=1)


class ModuleClock:
    """Wall time spent inside the indexers and the PLE layers (forward hooks, synchronised)."""

    def __init__(self, model, device: str):
        from transformers.models.qwen4_exp import modeling_qwen4_exp as m

        self.device = device
        self.total = {"indexer": 0.0, "ple": 0.0}
        self.handles = []
        for mod in model.modules():
            name = ("indexer" if isinstance(mod, m.Qwen4ExpTextQSAIndexer) else
                    "ple" if isinstance(mod, m.Qwen4ExpTextPLELayer) else None)
            if name is not None:
                self.handles.append(mod.register_forward_pre_hook(self._start))
                self.handles.append(mod.register_forward_hook(self._stop(name)))
        self._t0 = 0.0
        self.enabled = True              # off: the hooks do nothing (no synchronization: whole-step timings)

    def _start(self, mod, args):
        if self.enabled:
            sync(self.device)
            self._t0 = time.perf_counter()

    def _stop(self, name):
        def hook(mod, args, out):
            if self.enabled:
                sync(self.device)
                self.total[name] += time.perf_counter() - self._t0
        return hook

    def reset(self):
        self.total = {k: 0.0 for k in self.total}


class KeysReplay:
    """Hands the original indexer the full raw keys, as the cache would after update_indexer."""

    def __init__(self, keys):
        self.keys = keys

    def update_indexer(self, states, layer_idx):
        return self.keys


def sampled_indexer_seconds(model, captured, samples: int, chunk: int, device: str) -> float:
    """Unpatched indexer time of a one-shot prefill, integrated from sampled query chunks."""
    total = 0.0
    for indexer, (hidden, (cos, sin), mask) in captured:
        length = hidden.shape[1]
        d = indexer.index_head_dim
        keys = indexer.index_qk_proj(hidden)[..., indexer.index_n_heads * d:].reshape(hidden.shape[0], length, d)
        for i in range(samples):
            mid = int((i + 0.5) * length / samples)
            start = max(0, min(length - chunk, mid - chunk // 2))
            stop = start + chunk
            sync(device)
            t0 = time.perf_counter()
            indexer(hidden[:, start:stop], (cos[:, :stop], sin[:, :stop]), mask[:, :, start:stop, :stop],
                    KeysReplay(keys[:, :stop]))
            sync(device)
            total += (time.perf_counter() - t0) / chunk * (length / samples)
    return total


def capture_indexer_inputs(model):
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m

    captured, handles = [], []
    for mod in model.modules():
        if isinstance(mod, m.Qwen4ExpTextQSAIndexer):
            handles.append(mod.register_forward_pre_hook(
                lambda mod, args: captured.append((mod, (args[0], args[1], args[2])))))
    return captured, handles


def timed(fn, device, repeat: int = 1):
    """(min seconds over ``repeat`` calls, last result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


class MaskRecorder:
    """Keeps the selection mask every indexer call returns (on the host)."""

    def __init__(self, model):
        from transformers.models.qwen4_exp import modeling_qwen4_exp as m

        from hebrus_torch.integrations.transformers import selection_mask

        self.masks: list[torch.Tensor] = []
        self.handles = [mod.register_forward_hook(lambda mod, a, out: self.masks.append(selection_mask(out).cpu()))
                        for mod in model.modules() if isinstance(mod, m.Qwen4ExpTextQSAIndexer)]

    def stop(self) -> list[torch.Tensor]:
        for h in self.handles:
            h.remove()
        return self.masks


def compare_masks(ref: list[torch.Tensor], got: list[torch.Tensor]) -> str:
    rows = sum(int(m.shape[0] * m.shape[2]) for m in ref)
    differ = sum(int((a != b).any(-1).sum()) for a, b in zip(ref, got)) if len(ref) == len(got) else rows
    return f"selections identical for {rows - differ} of {rows} query rows"


def tie_report(captured, ref: list[torch.Tensor], got: list[torch.Tensor]) -> str:
    """Per indexed layer: rows whose selections differ, and how far apart the swapped groups' scores are
    (scored with the unpatched run's inputs to that layer)."""
    import math

    from transformers.models.qwen4_exp import modeling_qwen4_exp as m

    parts = []
    for (ind, (hidden, (cos, sin), mask)), a, b in zip(captured, ref, got):
        a, b = a[0, 0], b[0, 0]
        differing = torch.nonzero((a != b).any(-1)).flatten().tolist()
        if not differing:
            parts.append(f"layer {ind.layer_idx}: 0 rows differ")
            continue
        d, r = ind.index_head_dim, ind.compress_ratio
        q, k = torch.split(ind.index_qk_proj(hidden), [ind.index_n_heads * d, d], -1)
        q = m.apply_rotary_pos_emb(ind.q_layernorm(q.unflatten(-1, (-1, d))), cos=cos, sin=sin, unsqueeze_dim=2)
        worst, zero_ties = 0.0, 0
        for t in differing:
            visible = mask[0, 0, t] if mask.dtype == torch.bool else mask[0, 0, t] == 0
            first, n = int(visible.to(torch.uint8).argmax()), int(visible.sum())
            g = n // r
            pooled = ind.k_layernorm(k[0, first:first + r * g].view(g, r, -1).float().mean(1).to(k.dtype))
            starts = torch.arange(g, device=k.device) * r + first
            pooled = m.apply_rotary_pos_emb(pooled[:, None], cos=cos[0, starts], sin=sin[0, starts])[:, 0]
            scores = torch.relu(q[0, t].float() @ pooled.float().T).sum(0) / math.sqrt(d)
            ga = a[t, first:first + r * g].view(g, r)[:, 0]
            gb = b[t, first:first + r * g].view(g, r)[:, 0]
            sa, sb = scores[ga & ~gb].sort().values, scores[gb & ~ga].sort().values
            if sa.numel() != sb.numel():
                worst = float("inf")
                continue
            zero_ties += int(bool((sa == 0).all() and (sb == 0).all()))
            worst = max(worst, float((sa - sb).abs().max() / scores.abs().max().clamp_min(1e-30)))
        parts.append(f"layer {ind.layer_idx}: {len(differing)} rows differ ({zero_ties} exact ties at score 0; "
                     f"swapped groups' scores within {worst:.0e} relative)")
    return "; ".join(parts)


HEADERS = ["phase", "path", "total s", "indexers s", "PLE s", "ms/step", "speedup", "indexer speedup",
           "ms/step, no hooks", "speedup, no hooks"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4, help="even; half linear+PLE, half indexed")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per cell (min)")
    parser.add_argument("--extrapolate-above", type=int, default=None,
                        help="prompt lengths above this get transformers' prefill indexer time extrapolated "
                             "from sampled query chunks instead of measured (for slow machines / long prompts)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads; 1 by default: on a shared machine 2-thread regions stall "
                             "whenever another process holds a core, which punishes op-heavy code erratically")
    args = parser.parse_args()
    dev = args.device
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(dev, args.layers)
    n_indexed = sum(t == "indexed_attention" for t in model.config.layer_types)
    clock = ModuleClock(model, dev)
    gen = torch.Generator().manual_seed(0)
    rows, notes = [], []

    def ratio(x: float) -> str:
        return f"{x:.1f}x" if x < 10 else f"{x:.0f}x"

    def row(phase, path, seconds, indexer, ple, per="", base=None, base_idx=None, mark="", free=None,
            base_free=None):
        rows.append([phase, path, f"{seconds:.2f}{mark}", f"{indexer:.2f}{mark}", f"{ple:.3f}", per,
                     "" if base is None else f"{ratio(base / seconds)}{mark}",
                     "" if base_idx is None else f"{ratio(base_idx / max(indexer, 1e-9))}{mark}",
                     "" if free is None else f"{free / args.decode * 1e3:.1f}",
                     "" if base_free is None else f"{base_free / free:.2f}x"])

    def run(patched: bool, fn, record: bool = True, unhooked: bool = False):
        """(seconds, indexer s, PLE s, output) of the fastest of args.repeat calls, all from that call, and
        the indexer masks of one more, untimed call (turning a selection into a mask costs time). With
        ``unhooked``, the first entry is instead the fastest of args.repeat more calls with the module
        clock off: the module hooks synchronize the device around every indexer and PLE layer, which a
        launch-bound device pays for, and which no user's model does."""
        (htx.apply if patched else htx.revert)(model)
        best = None
        for _ in range(args.repeat):
            clock.reset()
            seconds, out = timed(fn, dev)
            if best is None or seconds < best[0]:
                best = (seconds, clock.total["indexer"], clock.total["ple"], out)
        if unhooked:
            clock.enabled = False
            try:
                best = (*best, min(timed(fn, dev)[0] for _ in range(args.repeat)))
            finally:
                clock.enabled = True
        masks = []
        if record:
            recorder = MaskRecorder(model)
            try:
                fn()
            finally:
                masks = recorder.stop()
        return (*best, masks)

    t_start = time.perf_counter()
    with torch.no_grad():
        # First-call costs (allocator growth, lazy inits) out of the timings: both paths on a short prompt,
        # then one patched prefill at the largest length.
        warm = torch.randint(4, 32000, (1, 64), generator=gen).to(dev)
        for patched in (False, True):
            (htx.apply if patched else htx.revert)(model)
            model(warm, use_cache=True)
        model(torch.randint(4, 32000, (1, max(args.tokens)), generator=gen).to(dev), use_cache=True)
        for length in args.tokens:
            ids = torch.randint(4, 32000, (1, length), generator=gen)
            ids[0, torch.randperm(length, generator=gen)[:length // 200]] = 2              # some EOS
            ids = ids.to(dev)
            phase = f"prefill {length}"
            box = {}

            def prefill():
                out = model(ids, use_cache=True)
                box["cache"] = out.past_key_values                                         # kept for decode
                return out.logits[:, -1]

            measure = args.extrapolate_above is None or length <= args.extrapolate_above
            captured, handles = capture_indexer_inputs(model)
            t_p, p_idx, p_ple, logits_p, masks_p = run(True, prefill)
            if measure:                                     # keep the unpatched run's indexer inputs instead
                captured.clear()
                t_u, u_idx, u_ple, logits_u, masks_u = run(False, lambda: model(ids, use_cache=True).logits[:, -1])
            for h in handles:
                h.remove()
            captured = captured[:n_indexed]
            if measure:
                row(phase, "transformers", t_u, u_idx, u_ple)
                row(phase, "hebrus apply()", t_p, p_idx, p_ple, base=t_u, base_idx=u_idx)
                est = sampled_indexer_seconds(model, captured, args.samples, args.chunk, dev)
                ref_m, got_m = masks_u[:n_indexed], masks_p[:n_indexed]
                notes.append(f"prefill {length}: max |logit difference| {(logits_p - logits_u).abs().max().item():.1e} "
                             f"(last token; |logits| up to {logits_u.abs().max().item():.1f}); "
                             f"{compare_masks(ref_m, got_m)} ({tie_report(captured, ref_m, got_m)}); sampled-chunk "
                             f"estimate of transformers' indexer {est:.2f} s vs measured {u_idx:.2f} s")
                del masks_u
            else:
                htx.revert(model)
                est = sampled_indexer_seconds(model, captured, args.samples, args.chunk, dev)
                clock.reset()
                ple_only(model, ids, dev)
                u_ple = clock.total["ple"]
                t_u = t_p - p_idx - p_ple + est + u_ple
                rows.append([phase, "transformers (extrapolated*)", f"{t_u:.1f}*", f"{est:.1f}*", f"{u_ple:.3f}",
                             "", "", "", "", ""])
                row(phase, "hebrus apply()", t_p, p_idx, p_ple)
                rows[-1][6] = f"{ratio(t_u / t_p)}*"
                rows[-1][7] = f"{ratio(est / max(p_idx, 1e-9))}*"
            del captured, masks_p
            if args.decode:
                steps = torch.randint(4, 32000, (1, args.decode), generator=gen).to(dev)
                base_cache = box.pop("cache")
                results = {}
                for patched in (False, True):
                    def decode():
                        cache = copy.deepcopy(base_cache)
                        return torch.cat([model(steps[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1]
                                          for i in range(args.decode)])

                    results[patched] = run(patched, decode, unhooked=True)
                htx.revert(model)
                (t_u, u_idx, u_ple, l_u, f_u, m_u), (t_p, p_idx, p_ple, l_p, f_p, m_p) = results[False], results[True]
                dphase = f"decode {args.decode} after {length}"
                row(dphase, "transformers", t_u, u_idx, u_ple, per=f"{t_u / args.decode * 1e3:.1f}", free=f_u)
                row(dphase, "hebrus apply()", t_p, p_idx, p_ple, per=f"{t_p / args.decode * 1e3:.1f}", base=t_u,
                    base_idx=u_idx, free=f_p, base_free=f_u)
                notes.append(f"{dphase}: max |logit difference| {(l_p - l_u).abs().max().item():.1e} over "
                             f"{args.decode} steps (|logits| up to {l_u.abs().max().item():.1f}); "
                             f"{compare_masks(m_u, m_p)}")
                del base_cache
            print(table(HEADERS, rows), flush=True)
    total = time.perf_counter() - t_start

    cfg = model.config
    body = (
        f"Machine: {machine(dev)}; device `{dev}`. Random-weight `Qwen4ExpForCausalLM` (transformers {transformers.__version__}, "
        f"fp32, sdpa), {cfg.num_hidden_layers} layers ({n_indexed} indexed, {len(cfg.ple_layer_ids)} linear with "
        f"PLE), hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; indexer {cfg.indexer_n_heads} heads x "
        f"{cfg.indexer_head_dim}, budget {cfg.indexer_budget}, ratio {cfg.indexer_compress_ratio} "
        f"(top {cfg.indexer_budget // cfg.indexer_compress_ratio} groups); PLE N = {cfg.ngram_size}, "
        f"{cfg.heads_per_ngram} heads per order, C = {cfg.hidden_size * cfg.hc_count}; random weights with a "
        f"shared embedding direction that keeps indexer scores positive and spread (plain random weights give "
        f"many exact 0 scores, whose order transformers' topk leaves unspecified). Batch 1, "
        f"{args.threads} thread(s), the fastest of {args.repeat} runs per cell (its module times too; the "
        f"parity masks come from one more, untimed run), whole benchmark {total:.0f} s. "
        f"'indexers s' / 'PLE s': time inside those modules (forward hooks, summed over layers and steps); "
        f"the rest of each step (gated delta net reference kernels, MoE, attention) is transformers' code "
        f"in both rows. Decode: {args.decode} single-token steps on a copy of the patched prefill's cache "
        f"(the patched copy keeps its pooled groups, so each step pools only the group it completes).\n\n")
    body += table(HEADERS, rows)
    body += ("\n\n'no hooks': the same decode without the module clock, whose hooks synchronize the device around "
             "every indexer and PLE layer (a launch-bound device pays for each; no user's model has them); "
             "fastest of the same number of runs.")
    if dev != "cpu":
        body += ("\n\nOn `" + dev + "` the hebrus ops run their pure-PyTorch reference (no native kernels for this "
                 "device) with device-side value checks and no host synchronization; on CUDA the drop-in's decode "
                 "calls (the indexer's selection, the PLE rows forms) replay captured CUDA graphs "
                 "(hebrus_torch/integrations/qwen4_exp/cuda_graphs.py).")
    if any("*" in r[2] for r in rows):
        body += ("\n\n\\* extrapolated, not measured end to end: transformers' indexer time is integrated from "
                 f"{args.samples} chunks of {args.chunk} queries at evenly spaced positions of the same prompt "
                 "(the original indexer run on exactly those queries' keys, mask and positions); the rest of "
                 "the model is the patched run's time outside the patched modules, plus transformers' PLE "
                 "measured on the same tokens.")
    body += ("\n\nParity: hebrus breaks exact score ties by the lower group index (SPEC §3), transformers' "
             "`torch.topk` in an unspecified order, and fp32 rounding differs between the two score paths, so "
             "the two may pick different members of a (near-)tie. The first indexed layer sees the same inputs "
             "on both paths, so its differing rows are the tie cases themselves; later layers' inputs already "
             "differ where an earlier layer picked another tied group, so their gaps are larger.\n\n")
    body += "\n".join(f"- {n}" for n in notes)
    write_section("Model drop-in (issue 5)" + ("" if dev == "cpu" else f", {dev}"), body)
    print(body)


def ple_only(model, ids, dev):
    """transformers' PLE layers alone on the prefill tokens (cache-free: the same work as one-shot)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m

    hidden = torch.randn(ids.shape[0], ids.shape[1], model.config.hidden_size * model.config.hc_count,
                         device=dev) * 0.1
    for mod in model.modules():
        if isinstance(mod, m.Qwen4ExpTextPLELayer):
            mod(hidden, ids, None)


if __name__ == "__main__":
    main()

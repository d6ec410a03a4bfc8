"""The continuous-batching part of ``python -m hebrus_torch``: a batch of prompts of mixed lengths through
the engine, checked against per-prompt ``generate``, timed against sequential and padded-batch ``generate``.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from .engine import Engine, EngineConfig


def _bar(done: int, total: int, label: str, width: int = 32) -> None:
    filled = width * done // max(total, 1)
    sys.stdout.write(f"\r  {label:<22}[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens")
    sys.stdout.flush()


class _FirstToken:
    """A generate streamer that records when the first new token comes out (call 1 is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def demo_model(seed: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A small random Qwen4ExpForCausalLM for the continuous-batching demo (fp32).

    6 layers (linear, indexed, linear, linear, indexed, linear) with PLE on four of them, GQA, 8 experts,
    indexer budget 32 (r 4: prompts over 35 tokens select). transformers initialises norms and the PLE
    conv to zero and the output layer with std 0.02, which leaves the next-token logits within ~0.01 of
    each other: ties everywhere, so greedy tokens would depend on the last bit of any sum. Norms and PLE
    convs get random weights and the output layer a wider spread, so greedy picks are well defined.
    """
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layer_types=["linear_attention", "indexed_attention", "linear_attention"] * 2,
        ple_layer_ids=[1, 3, 4, 6], ple_embed_dim=64, eos_token_id=3, pad_token_id=0, bos_token_id=1, hc_count=2,
        hc_lowrank=16, ngram_vocab_size_base=1000, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32,
        indexer_budget=32, indexer_compress_ratio=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        max_position_embeddings=65536)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = modeling.Qwen4ExpForCausalLM(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "conv1d" in name or "norm" in name:
                    p.normal_(0, 0.3)
            model.lm_head.weight.normal_(0, 1.0)
    return model.to(device)


def mixed_prompts(count: int, vocab: int, shortest: int, longest: int, seed: int,
                  avoid: tuple[int, ...] = ()) -> list[list[int]]:
    """``count`` random prompts whose lengths spread geometrically over [shortest, longest]."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = round(shortest * (longest / shortest) ** (i / max(count - 1, 1)))
        ids = torch.randint(0, vocab, (n,), generator=gen)
        for tok in avoid:          # (EOS inside a prompt is fine; a prompt ending the stream early is not)
            ids[-1:] = torch.where(ids[-1:] == tok, (ids[-1:] + 1) % vocab, ids[-1:])
        out.append(ids.tolist())
    order = torch.randperm(count, generator=gen).tolist()
    return [out[i] for i in order]


def run(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, config: EngineConfig) -> bool:
    """Engine vs per-prompt generate (tokens), then the timings. True when every request's tokens equal
    generate's, or differ first where transformers' own uncached forward picks the engine's token."""
    device = next(model.parameters()).device
    total = new_tokens * len(prompts)
    gen_kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    with torch.inference_mode():
        warm = Engine(model, EngineConfig(capacity_tokens=64, max_sequences=2, max_batch_tokens=16))
        warm.add_request(prompts[0][:8], max_new_tokens=2, eos_token_id=-1)
        warm.run()
        model.generate(torch.tensor([prompts[0][:8]], device=device), **{**gen_kwargs, "max_new_tokens": 2,
                                                                          "min_new_tokens": 2})

        engine = Engine(model, config)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=new_tokens, eos_token_id=-1)
        done = 0
        while engine.has_unfinished():
            done += sum(len(o.new_tokens) for o in engine.step())
            _bar(done, total, "continuous batching")
        _sync(device)
        cb_wall = time.perf_counter() - t0
        print()
        reqs = [engine.requests[f"r{i}"] for i in range(len(prompts))]
        cb_ttft = [r.first_token_time - t0 for r in reqs]

        seq_out, seq_ttft = [], []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            streamer = _FirstToken()
            out = model.generate(torch.tensor([p], device=device), streamer=streamer, **gen_kwargs)
            seq_out.append(out[0, len(p):].tolist())
            seq_ttft.append(streamer.first - t0)
            _bar((i + 1) * new_tokens, total, "sequential generate")
        _sync(device)
        seq_wall = time.perf_counter() - t0
        print()

        length = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), length), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, length - len(p):], mask[i, length - len(p):] = torch.tensor(p), 1
        streamer = _FirstToken()
        t0 = time.perf_counter()
        model.generate(ids.to(device), attention_mask=mask.to(device), streamer=streamer, **gen_kwargs)
        _sync(device)
        pad_wall = time.perf_counter() - t0
        pad_ttft = streamer.first - t0
        _bar(total, total, "padded-batch generate")
        print()

    same = sum(r.generated == s for r, s in zip(reqs, seq_out))
    # Where they differ: at the first differing token, does transformers' own uncached forward over the
    # common prefix pick the engine's token? Then transformers' cached decode and its own forward disagree
    # there (a near tie of indexer scores or logits), not the engine and transformers.
    inconsistent = 0
    with torch.inference_mode():
        for r, s, p in zip(reqs, seq_out, prompts):
            if r.generated == s:
                continue
            k = next(j for j, (a, b) in enumerate(zip(r.generated, s)) if a != b)
            logits = model(torch.tensor([p + s[:k]], device=device)).logits[0, -1]
            inconsistent += int(logits.argmax()) == r.generated[k]
    print(f"  tokens: {same} of {len(prompts)} requests equal to per-prompt generate (greedy, {new_tokens} tokens each)"
          + (f"; at the first difference of {inconsistent} of the other {len(prompts) - same}, transformers' own "
             f"uncached forward picks the engine's token (its cached decode and its forward disagree there)"
             if same < len(prompts) else ""))
    c = engine.counters
    print(f"  engine: {c.steps} steps, {c.prefill_tokens} prompt tokens prefilled in chunks of at most "
          f"{config.max_batch_tokens}, {c.decode_tokens} decode tokens, {c.prefix_hit_tokens} prompt tokens "
          f"shared, {c.preemptions} preemptions")
    print(f"\n  {'path':<24}{'tokens/s':>10}{'TTFT median':>13}{'wall':>9}{'engine is':>11}")
    for name, wall, ttft in (("continuous batching", cb_wall, statistics.median(cb_ttft)),
                             ("sequential generate", seq_wall, statistics.median(seq_ttft)),
                             ("padded-batch generate", pad_wall, pad_ttft)):
        print(f"  {name:<24}{total / wall:>10.1f}{ttft:>11.2f} s{wall:>7.2f} s{wall / cb_wall:>10.2f}x")
    return same + inconsistent == len(prompts)

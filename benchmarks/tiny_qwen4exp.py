"""A tiny random-weight Qwen4Exp for the tests and the benchmarks (one copy: tests import it through
tests/hf_models.py). Needs transformers==5.23.0; not part of the hebrus_torch package."""

from __future__ import annotations

import torch


def random_model(seed: int = 0, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attn_implementation: str = "eager", positive_index_scores: bool = True, conv_std: float = 0.3,
                 embed_shift: float = 8.0, index_shift: float = 3.0, **overrides):
    """A small random-weight ``Qwen4ExpForCausalLM`` (transformers 5.23.0) in eval mode.

    Defaults: 4 layers (linear, indexed, linear, indexed), PLE on decoder layers 0 and 2 (the config's
    1-based ``ple_layer_ids`` [1, 3]), indexer budget 8 with compress ratio 4 (top 2 groups), so
    prompts of a few dozen tokens already select sparsely. The PLE
    conv weights, zero-initialised by transformers, are randomised.

    ``positive_index_scores``: with random weights many indexer scores ``sum_h relu(q_h . k)`` are
    exactly 0, and transformers' ``torch.topk`` breaks such ties in an unspecified order while hebrus
    picks the lower group index (SPEC §3). A shared direction added to every token embedding
    (``embed_shift`` x the mean row norm) and read by the indexer's un-roped dims (``index_shift`` x the
    mean row norm of ``index_qk_proj``) keeps scores positive and distinct, so both pick the same groups.
    ``conv_std``: standard deviation of the randomised PLE conv weights. ``overrides``: config fields.
    """
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    kwargs = dict(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention"] * 2, ple_layer_ids=[1, 3],
        ple_embed_dim=32, eos_token_id=3, pad_token_id=0, bos_token_id=1, hc_count=2, hc_lowrank=8,
        ngram_vocab_size_base=1000, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32,
        indexer_budget=8, indexer_compress_ratio=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, max_position_embeddings=65536,
    )
    kwargs.update(overrides)
    config = Qwen4ExpTextConfig(**kwargs)
    config._attn_implementation = attn_implementation
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = m.Qwen4ExpForCausalLM(config)
    model.eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, m.Qwen4ExpTextPLELayer):
                mod.conv1d.weight.copy_(torch.randn(mod.conv1d.weight.shape, generator=gen) * conv_std)
        if positive_index_scores:
            embed = model.model.embed_tokens.weight
            direction = torch.randn(config.hidden_size, generator=gen)
            direction /= direction.norm()
            embed.add_(direction * embed_shift * embed.norm(dim=1).mean())
            rotary = 2 * model.model.rotary_emb.inv_freq.shape[0]
            for mod in model.modules():
                if isinstance(mod, m.Qwen4ExpTextQSAIndexer):
                    dim, weight = mod.index_head_dim, mod.index_qk_proj.weight
                    scale = index_shift * weight.norm(dim=1).mean()
                    for head in range(mod.index_n_heads + mod.index_kv_heads):
                        weight[head * dim + rotary:(head + 1) * dim] += scale * direction
    return model.to(device=device, dtype=dtype)


# The released checkpoint's layer pattern (REAL_MODEL.md: every 4th layer indexed; 36 + 12 of 48).
RELEASED_LAYER_TYPES = ["linear_attention"] * 3 + ["indexed_attention"]


def released_structure_model(hidden: int = 256, inter: int = 64, *, dtype: torch.dtype = torch.bfloat16,
                             layers: int = 4, vocab: int = 32000, seed: int = 0):
    """Random weights in the released checkpoint's structure (REAL_MODEL.md): ``layers`` layers of its
    pattern (3 linear-attention, then an indexed one), PLE on decoder layer 1 (16 n-gram heads); 512
    experts, top 10; hc_count 4, hc_lowrank 320; attention 24 heads x 256 with the sigmoid output gate,
    2 KV heads, partial rotary 0.25, rope_theta 1e7; GDN 16 key / 48 value heads of 128; indexer 4 + 1
    heads of 128, budget 2048, compress ratio 4. Only what sizes weights is smaller: ``hidden`` (the
    PLE embedding too), the expert and shared-expert intermediate ``inter``, the vocabulary and the
    n-gram table (base 50,000): what a step dispatches does not depend on them."""
    layer_types = (RELEASED_LAYER_TYPES * ((layers + 3) // 4))[:layers]
    return random_model(
        seed, attn_implementation="sdpa", embed_shift=2.0, index_shift=1.0, dtype=dtype, vocab_size=vocab,
        hidden_size=hidden, num_attention_heads=24, num_key_value_heads=2, head_dim=256, output_gate_type="sigmoid",
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10]},
        num_hidden_layers=layers, layer_types=layer_types, ple_layer_ids=[2], ple_embed_dim=hidden,
        ngram_vocab_size_base=50_000, ngram_size=3, heads_per_ngram=8, split_ngram_parts=128,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=inter, shared_expert_intermediate_size=inter,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
        hc_count=4, hc_lowrank=320, eos_token_id=2, pad_token_id=0, bos_token_id=1, max_position_embeddings=65536)

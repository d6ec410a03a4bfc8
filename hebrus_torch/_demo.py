"""The model of ``python -m hebrus_torch``'s demo (needs transformers==5.23.0; nothing else uses it).

A tiny random-weight ``Qwen4ExpForCausalLM`` in eval mode: 4 layers (linear, indexed, linear, indexed),
PLE on decoder layers 0 and 2 (1-based ``ple_layer_ids`` [1, 3]) with random conv weights (transformers
zero-initialises them), indexer budget 8 with compress ratio 4 (top 2 groups), so prompts of a few dozen
tokens already select sparsely. With plain random weights many indexer scores ``sum_h relu(q_h . k)``
are exactly 0, a tie that transformers' ``topk`` breaks in an unspecified order: a direction shared by
every token embedding, read by the indexers' un-roped dims, keeps the scores positive and distinct, so
the demo's parity check compares selections that are well defined. The tests and benchmarks build
their models with ``benchmarks/tiny_qwen4exp.py`` (more knobs), not with this.
"""

from __future__ import annotations

import torch

_CONFIG = dict(
    vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=4,
    layer_types=["linear_attention", "indexed_attention"] * 2, ple_layer_ids=[1, 3], ple_embed_dim=32,
    eos_token_id=3, pad_token_id=0, bos_token_id=1, hc_count=2, hc_lowrank=8, ngram_vocab_size_base=1000,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8, indexer_compress_ratio=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
    max_position_embeddings=65536,
)


def demo_model(seed: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The demo's model, deterministic in ``seed``, fp32, eager attention."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(**_CONFIG)
    config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = modeling.Qwen4ExpForCausalLM(config).eval()
    with torch.no_grad():      # (the draws and arithmetic of benchmarks/tiny_qwen4exp.random_model(seed))
        for mod in model.modules():
            if isinstance(mod, modeling.Qwen4ExpTextPLELayer):
                mod.conv1d.weight.copy_(torch.randn(mod.conv1d.weight.shape, generator=gen) * 0.3)
        shared = torch.randn(config.hidden_size, generator=gen)
        shared /= shared.norm()
        embed = model.model.embed_tokens.weight
        embed.add_(shared * 8.0 * embed.norm(dim=1).mean())                 # every token leans the same way
        rotary = 2 * model.model.rotary_emb.inv_freq.shape[0]
        for mod in model.modules():
            if isinstance(mod, modeling.Qwen4ExpTextQSAIndexer):         # ... and the indexers read it
                weight, dim = mod.index_qk_proj.weight, mod.index_head_dim
                lift = 3.0 * weight.norm(dim=1).mean()
                for head in range(mod.index_n_heads + mod.index_kv_heads):
                    weight[head * dim + rotary:(head + 1) * dim] += lift * shared
    return model.to(device)

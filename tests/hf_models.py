"""Tiny random Qwen4Exp configs and modules from transformers==5.23.0 (the `hf` extra)."""

from __future__ import annotations

import os
import sys

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers==5.23.0 (pip install -e .[hf])")
from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling  # noqa: E402
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402

# The tests' and the benchmarks' one tiny random Qwen4ExpForCausalLM (benchmarks/tiny_qwen4exp.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from tiny_qwen4exp import random_model  # noqa: E402,F401


def tiny_config(**overrides) -> "Qwen4ExpTextConfig":
    """A small text config with two PLE layers and an indexer with a small budget."""
    kwargs = dict(
        vocab_size=50, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_hidden_layers=2, ple_layer_ids=[1, 2], ple_embed_dim=32, eos_token_id=3, hc_count=2,
        ngram_vocab_size_base=1000, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=8, indexer_compress_ratio=4,
    )
    kwargs.update(overrides)
    return Qwen4ExpTextConfig(**kwargs)


def tiny_indexer_config(**overrides) -> "Qwen4ExpTextConfig":
    """A tiny text config whose decoder layer 1 is an "indexed_attention" layer (QSA indexer).

    Layer 0 is linear attention and carries the only PLE layer (PLE is linear-attention only); the MoE
    and the linear attention are shrunk so that a whole-model forward takes milliseconds.
    """
    kwargs = dict(
        layer_types=["linear_attention", "indexed_attention"], ple_layer_ids=[1], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        hc_lowrank=8,
    )
    kwargs.update(overrides)
    return tiny_config(**kwargs)

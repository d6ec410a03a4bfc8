"""Which stored tensors of a Qwen4Exp checkpoint the converter quantizes (docs/quantization.md).

Quantized (affine, :mod:`hebrus_torch.moe.quantize`): the routed experts (``mlp.experts.{e}.*_proj``), the
shared expert, the attention, GDN (``linear_attn``), indexer, hyper-connection and PLE projections, and
``lm_head`` when asked; in the MTP block (``mtp.*``) the same ones by the same patterns (its one decoder layer is
``mtp.layers.0``), and its ``fc_embedding`` / ``fc_hidden``. A projection whose input dimension is not a multiple of the group size is kept as it
is (named in ``quantization_config["not_quantized"]``); routed experts that cannot be quantized make the
checkpoint unconvertible. Everything else (norms, the router ``mlp.gate``, ``shared_expert_gate``, biases,
the embedding, the PLE n-gram table, convolutions, ``A_log`` / ``dt_bias`` and the vision tower; the MTP block's norms and router)
is copied byte for byte.
"""

from __future__ import annotations

import re

from hebrus_torch.loading.keymap import _text_name

__all__ = ["CATEGORIES", "category_of", "rule_name", "EXPERT", "MTP_PREFIX"]

MTP_PREFIX = "mtp."
EXPERT = re.compile(r"(^|\.)mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# (category, pattern on the text model's name), in the order of quantization_config["quantized"]
_PROJECTIONS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("shared_expert", re.compile(r"\.mlp\.shared_expert\.(gate|up|down)_proj\.weight$")),
    ("attention", re.compile(r"\.self_attn\.(q|k|v|o)_proj\.weight$")),
    ("linear_attention", re.compile(r"\.linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight$")),
    ("indexer", re.compile(r"\.self_attn\.indexer\.index_qk_proj\.weight$")),
    ("hyper_connection", re.compile(r"(^|\.)(attn_hyper_connection|mlp_hyper_connection|hyper_connection_mixer)\."
                                    r"(input_mix_weight_down|input_mix_weight_up|block_inject_weight)\.weight$")),
    ("ple_projection", re.compile(r"\.ple\.(key_proj|value_proj)\.weight$")),
    ("mtp_fusion", re.compile(r"^mtp\.fc_(embedding|hidden)\.weight$")),
)
CATEGORIES = ("routed_experts",) + tuple(name for name, _ in _PROJECTIONS) + ("lm_head",)


def rule_name(key: str) -> str | None:
    """The name :func:`category_of` takes for a checkpoint key: the text model's (``model.layers.0...``), the key
    itself for the MTP block's (``mtp.layers.0...``), None for the vision tower's."""
    return key if key.startswith(MTP_PREFIX) else _text_name(key)


def category_of(text_name: str, quantize_lm_head: bool) -> str | None:
    """The category of a weight the converter quantizes (a name of :data:`CATEGORIES`), or None to copy it.
    ``text_name``: the key as the text model names it (``model.layers.0...``, ``lm_head.weight``) or an MTP
    block's key with its prefix (``mtp.layers.0.mlp.experts.3.up_proj.weight``, :func:`rule_name`)."""
    if EXPERT.search(text_name):
        return "routed_experts"
    for name, pattern in _PROJECTIONS:
        if pattern.search(text_name):
            return name
    if text_name == "lm_head.weight" and quantize_lm_head:
        return "lm_head"
    return None

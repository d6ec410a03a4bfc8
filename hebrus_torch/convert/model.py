"""The converter's quantization applied to a model in memory: what a checkpoint written by
``python -m hebrus_torch.convert`` loads as, from the unquantized weights (same rules, same codes)."""

from __future__ import annotations

import torch

from hebrus_torch.moe.quantize import check_quant_options
from hebrus_torch.moe.quantized_experts import quantize_experts
from hebrus_torch.moe.quantized_linear import quantize_linears

from .rules import category_of

__all__ = ["quantize_model"]


def quantize_model(model: torch.nn.Module, bits: int = 4, group_size: int = 64,
                   quantize_lm_head: bool = False) -> torch.nn.Module:
    """Quantize a transformers Qwen4Exp causal LM in place as the converter quantizes its checkpoint: the routed
    experts (:class:`QuantizedExperts`) and every bias-free projection :mod:`hebrus_torch.convert.rules` names
    whose input dimension is a multiple of ``group_size`` (:class:`QuantizedLinear`); ``lm_head`` only when
    asked and not tied to the embedding. An MTP block set on the model as ``model.mtp`` (its modules are then
    named ``mtp.*``, as the checkpoint names its weights) is quantized by the same rules. Returns ``model``."""
    check_quant_options(bits, group_size, op="quantize_model")
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = embedding is not None and getattr(model, "lm_head", None) is not None and \
        model.lm_head.weight is embedding.weight
    names = [name for name, module in model.named_modules()
             if type(module) is torch.nn.Linear and module.bias is None and module.in_features % group_size == 0
             and category_of(name + ".weight", quantize_lm_head and not tied) not in (None, "routed_experts")]
    quantize_experts(model, bits, group_size)
    return quantize_linears(model, names, bits, group_size)

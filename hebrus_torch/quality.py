"""Measuring what quantization does to a model's next-token distribution (issue 36): the metrics (mean KL
divergence from the unquantized model, top-1 agreement) and an in-memory quantize-dequantize of a Qwen4Exp's
chosen weights, so that any weight format (this project's affine one, MLX's, GGUF's) can be compared on the
same model by the same fp32 forward pass.

Which weights a format touches, by parameter name (transformers 5.23.0's ``Qwen4ExpForCausalLM``):

- ``"routed_experts"``: ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I];
- ``"shared_expert"``: ``mlp.shared_expert.{gate,up,down}_proj.weight``;
- ``"projections"``: the linear-attention (GDN) ``in_proj_qkv / in_proj_z / in_proj_b / in_proj_a /
  out_proj``, the attention ``q/k/v/o_proj``, the indexer's ``index_qk_proj`` and every hyper-connection's
  ``input_mix_weight_down / input_mix_weight_up / block_inject_weight``.

Everything else stays as it is: norms, the router (``mlp.gate``), the shared expert's gate, the GDN's conv,
``dt_bias`` and ``A_log``, the embeddings, the PLE layer (its table and projections) and ``lm_head``.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import torch

from .errors import HebrusError

__all__ = ["WEIGHT_SETS", "select_weights", "fake_quantize_", "next_token_kl", "top1_agreement"]

_ROUTED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_SHARED = re.compile(r"\.mlp\.shared_expert\.(gate|up|down)_proj\.weight$")
_PROJECTIONS = re.compile(
    r"\.(linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)|self_attn\.[qkvo]_proj"
    r"|indexer\.index_qk_proj|(attn_|mlp_)?hyper_connection(_mixer)?\.(input_mix_weight_down|input_mix_weight_up"
    r"|block_inject_weight))\.weight$")
WEIGHT_SETS = {"routed_experts": _ROUTED, "shared_expert": _SHARED, "projections": _PROJECTIONS}


def select_weights(model: torch.nn.Module, sets: Iterable[str]) -> dict[str, torch.nn.Parameter]:
    """The parameters of ``model`` in the named weight sets (keys of :data:`WEIGHT_SETS`: ``"routed_experts"``,
    ``"shared_expert"``, ``"projections"``; module docstring), by name, in the model's order. An unknown set
    name raises HebrusError."""
    sets = list(sets)
    unknown = [s for s in sets if s not in WEIGHT_SETS]
    if unknown:
        raise HebrusError(f"select_weights: unknown weight set(s) {unknown}; known: {sorted(WEIGHT_SETS)}")
    patterns = [WEIGHT_SETS[s] for s in sets]
    return {name: p for name, p in model.named_parameters() if any(pat.search(name) for pat in patterns)}


def fake_quantize_(model: torch.nn.Module, sets: Iterable[str],
                   round_trip: Callable[[torch.Tensor], torch.Tensor | None]) -> dict[str, str]:
    """Replace, in place, every weight of the named sets by ``round_trip(weight)``: its quantized-then-dequantized
    value (same shape, any float dtype; cast to the parameter's dtype). ``round_trip`` returns None for a weight
    its format cannot hold (say an input dimension that is no multiple of its group size), which then stays
    as it is. Every round trip is computed before any weight is written. Returns ``{name: "quantized" or
    "kept"}`` for the selected weights."""
    chosen = select_weights(model, sets)
    new = {}
    for name, p in chosen.items():
        w = round_trip(p.detach())
        if w is not None and tuple(w.shape) != tuple(p.shape):
            raise HebrusError(f"fake_quantize_: the round trip of {name} {tuple(p.shape)} has shape {tuple(w.shape)}")
        new[name] = w
    with torch.no_grad():
        for name, w in new.items():
            if w is not None:
                chosen[name].copy_(w.to(chosen[name].dtype))
    return {name: "kept" if w is None else "quantized" for name, w in new.items()}


def _check_logits(ref_logits: torch.Tensor, logits: torch.Tensor) -> None:
    if ref_logits.shape != logits.shape or ref_logits.dim() < 1:
        raise HebrusError(f"logits of the reference {tuple(ref_logits.shape)} and of the model {tuple(logits.shape)} "
                          "must have one shape [..., vocab]")


def next_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``KL(P_ref || P)`` of the next-token distributions at every position, in fp32 (nats).

    Args: ref_logits, logits: Tensor[..., vocab] (any float dtype; both softmaxed in fp32).
    Returns: Tensor[...] float32, ``sum_v P_ref(v) * (log P_ref(v) - log P(v))``, >= 0 up to rounding."""
    _check_logits(ref_logits, logits)
    log_p = torch.log_softmax(ref_logits.float(), dim=-1)
    log_q = torch.log_softmax(logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """The fraction of positions whose most likely next token (argmax of the logits) is the reference's.

    Args: ref_logits, logits: Tensor[..., vocab]. Returns: a float in [0, 1]."""
    _check_logits(ref_logits, logits)
    return (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()

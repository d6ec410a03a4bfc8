"""Qwen4Exp's RMSNorms as one ``hebrus::hc_rms_norm`` dispatch each (:func:`fused_norm`: the
hyper-connections' ``hc_norm``, attention's ``q_norm`` / ``k_norm``, the indexer's ``q_layernorm``, PLE's
three norms), and the hyper-connection pre-mix of a decoder layer (transformers'
``Qwen4ExpTextGatedResidual``) over packed rows with its norm fused (:func:`hyper_premix`).

The module's own ``nn.Linear`` projections still run as module calls (a user's quantized or
LoRA-wrapped projections keep working); only the norms, nine element-wise ops each (ten in bf16),
are fused, and only where the norm is transformers' own ``Qwen4ExpTextRMSNorm`` without hooks (any
other norm module runs as itself). On CPU the fused norm gives the module's bits
(tests/test_hc_ops.py), so the engine's outputs are unchanged there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import hc_rms_norm

__all__ = ["hyper_premix", "fused_norm"]


def _is_stock_rms_norm(norm: torch.nn.Module) -> bool:
    cls = type(norm)
    return cls.__name__ == "Qwen4ExpTextRMSNorm" and cls.__module__.startswith("transformers.") \
        and not norm._forward_hooks and not norm._forward_pre_hooks


def fused_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for x [..., D]: one ``hc_rms_norm`` over the rows of x where ``norm`` is transformers'
    Qwen4Exp RMSNorm (any other module: its own call)."""
    if not _is_stock_rms_norm(norm) or x.dim() < 1:
        return norm(x)
    group = norm.group_size if norm.group_size is not None else x.shape[-1]
    return hc_rms_norm(x, norm.weight, group, float(norm.eps))


def hyper_premix(hc: torch.nn.Module, h: torch.Tensor):
    """``hc(h)`` of a ``Qwen4ExpTextGatedResidual`` for h [T, hc * hidden]: (mixed [T, hidden], h,
    injection weights [T, hc]), or only mixed where the module has no ``block_inject_weight``."""
    if type(hc).__name__ != "Qwen4ExpTextGatedResidual" or not type(hc).__module__.startswith("transformers.") \
            or hc._forward_hooks or hc._forward_pre_hooks or h.dim() != 2 \
            or h.shape[-1] != hc.hc_count * hc.hidden_size:
        return hc(h)
    normed = fused_norm(hc.hc_norm, h)
    weight = F.silu(hc.input_mix_weight_down(normed) / hc.hc_count)
    weight = torch.sigmoid(hc.input_mix_weight_up(weight)).unflatten(-1, (hc.hc_count, hc.hidden_size))
    mixed = (weight * normed.unflatten(-1, (hc.hc_count, hc.hidden_size))).mean(dim=-2)
    if hc.block_inject_weight is None:
        return mixed
    return mixed, h, 2 * torch.sigmoid(hc.block_inject_weight(normed) / hc.hc_count)

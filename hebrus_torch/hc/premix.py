"""Qwen4Exp's RMSNorms as one ``hebrus::hc_rms_norm`` dispatch each (:func:`fused_norm`: the
hyper-connections' ``hc_norm``, attention's ``q_norm`` / ``k_norm``, the indexer's ``q_layernorm``, PLE's
three norms), and the hyper-connections of a decoder layer over packed rows: the pre-mix (transformers'
``Qwen4ExpTextGatedResidual``) as one ``hebrus::hc_premix`` dispatch (:func:`hyper_premix`) and the
post-combine as one ``hebrus::hc_post_combine`` (:func:`post_combine`).

The pre-mix is fused whole only where its norm is transformers' own ``Qwen4ExpTextRMSNorm`` and its
three projections are plain ``nn.Linear`` without bias, in h's dtype (``hebrus::hc_premix``), or all
:class:`~hebrus_torch.moe.quantized_linear.QuantizedLinear` of one bits and group size with scales in h's dtype
(``hebrus::hc_premix_quantized``: the converter's 4/8-bit checkpoints), each module's call being its class's forward
(``module_calls.runs_forward_only``: no module or global hooks, no compiled call, no forward of the instance's own);
otherwise (a mix of the two, a LoRA-wrapped projection, a hooked module, a forward replaced on the instance) the
projections run as module calls and only the norm is fused where it can be. On CPU the fused ops compute in
hebrus's own row arithmetic, within a tolerance of the modules and each row independent of the others
(docs/engine.md, "The CPU fused ops' arithmetic"; tests/test_hc_ops.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..module_calls import plain_linear_weight, runs_forward_only, submodule
from ..moe.quantized_linear import QuantizedLinear
from .ops import hc_post_combine, hc_premix, hc_premix_quantized, hc_rms_norm

__all__ = ["hyper_premix", "post_combine", "fused_norm", "premix_by_modules", "post_combine_by_ops",
           "stock_gated_residual", "premix_params"]


_TRANSFORMERS_CLASS: dict[type, str | None] = {}
"""Class -> its name where the class is one of transformers' own (defined in a ``transformers.`` module), else
None: a fact of the class, asked once per class rather than per call."""


def _transformers_name(cls: type) -> str | None:
    if cls in _TRANSFORMERS_CLASS:
        return _TRANSFORMERS_CLASS[cls]
    name = cls.__name__ if cls.__module__.startswith("transformers.") else None
    _TRANSFORMERS_CLASS[cls] = name
    return name


def _is_stock_rms_norm(norm: torch.nn.Module) -> bool:
    return _transformers_name(type(norm)) == "Qwen4ExpTextRMSNorm" and runs_forward_only(norm)


def fused_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for x [..., D]: one ``hc_rms_norm`` over the rows of x where ``norm`` is transformers'
    Qwen4Exp RMSNorm (any other module: its own call)."""
    if not _is_stock_rms_norm(norm) or x.dim() < 1:
        return norm(x)
    group = norm.group_size if norm.group_size is not None else x.shape[-1]
    return hc_rms_norm(x, norm.weight, group, float(norm.eps))


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _projections(hc: torch.nn.Module) -> list[torch.nn.Module]:
    return [p for p in (submodule(hc, "input_mix_weight_down"), submodule(hc, "input_mix_weight_up"),
                        submodule(hc, "block_inject_weight")) if p is not None]


def _stock_norm(hc: torch.nn.Module, h: torch.Tensor) -> bool:
    norm = submodule(hc, "hc_norm")
    return _is_stock_rms_norm(norm) and norm.group_size == hc.hidden_size \
        and norm._parameters["weight"].dtype in _FLOATS and h.dtype in _FLOATS


def _fusable_premix(hc: torch.nn.Module, h: torch.Tensor) -> bool:
    """Whether ``hc(h)`` is exactly ``hebrus::hc_premix`` of its weights (stock norm, plain projections)."""
    if not _stock_norm(hc, h):
        return False
    dtype = h.dtype
    for p in _projections(hc):
        if plain_linear_weight(p, dtype) is None:
            return False
    return True


def _is_quantized_linear(linear: torch.nn.Module, dtype: torch.dtype, bits: int, group_size: int) -> bool:
    return type(linear) is QuantizedLinear and linear.bits == bits and linear.group_size == group_size \
        and linear.scales.dtype == dtype and runs_forward_only(linear)


def _fusable_quantized_premix(hc: torch.nn.Module, h: torch.Tensor) -> bool:
    """Whether ``hc(h)`` is exactly ``hebrus::hc_premix_quantized`` of its weights (stock norm, every projection a
    QuantizedLinear of one bits and group size)."""
    down = submodule(hc, "input_mix_weight_down")
    if not _stock_norm(hc, h) or type(down) is not QuantizedLinear:
        return False
    return all(_is_quantized_linear(p, h.dtype, down.bits, down.group_size) for p in _projections(hc))


def stock_gated_residual(hc: torch.nn.Module, h: torch.Tensor) -> bool:
    """``hc`` is transformers' own ``Qwen4ExpTextGatedResidual`` whose call runs its class's forward (no module or
    global hooks, no forward of the instance's own: ``runs_forward_only``, as for every module this file fuses), over
    h [T, hc * hidden]: what :func:`hyper_premix` (and the native layers' resolution) asks before looking at its
    submodules."""
    return _transformers_name(type(hc)) == "Qwen4ExpTextGatedResidual" and runs_forward_only(hc) \
        and h.dim() == 2 and h.shape[-1] == hc.hc_count * hc.hidden_size


def premix_params(hc: torch.nn.Module) -> tuple:
    """``hc_premix``'s weights of a stock pre-mix (:func:`_fusable_premix`): (hc_norm weight, down, up, the injection
    weight or None, the norm's eps)."""
    inj = submodule(hc, "block_inject_weight")
    norm = submodule(hc, "hc_norm")
    return (norm._parameters["weight"], submodule(hc, "input_mix_weight_down")._parameters["weight"],
            submodule(hc, "input_mix_weight_up")._parameters["weight"],
            inj._parameters["weight"] if inj is not None else None, float(norm.eps))


def hyper_premix(hc: torch.nn.Module, h: torch.Tensor):
    """``hc(h)`` of a ``Qwen4ExpTextGatedResidual`` for h [T, hc * hidden]: (mixed [T, hidden], h,
    injection weights [T, hc]), or only mixed where the module has no ``block_inject_weight``. One
    ``hc_premix`` dispatch where the module is stock (:func:`_fusable_premix`), one ``hc_premix_quantized``
    where its projections are the converter's QuantizedLinear (:func:`_fusable_quantized_premix`).

    Called for every hyper-connection of every layer and step: the checks read the modules' own dicts
    (``_modules``, ``_parameters``) rather than through ``nn.Module.__getattr__`` (the same objects), and the
    class test is cached per class; hooks, submodules and weights are read afresh on every call, so a module
    wrapped or hooked between steps takes the module path from its next call."""
    if not stock_gated_residual(hc, h):
        return hc(h)
    if _fusable_premix(hc, h):
        norm_weight, down, up, inject, eps = premix_params(hc)
        mixed, weights = hc_premix(h, norm_weight, down, up, inject, hc.hc_count, eps)
        return mixed if inject is None else (mixed, h, weights)
    if _fusable_quantized_premix(hc, h):
        inj = submodule(hc, "block_inject_weight")
        inject = (inj.weight, inj.scales, inj.biases) if inj is not None else (None, None, None)
        norm = submodule(hc, "hc_norm")
        down, up = submodule(hc, "input_mix_weight_down"), submodule(hc, "input_mix_weight_up")
        mixed, weights = hc_premix_quantized(h, norm._parameters["weight"], down.weight, down.scales, down.biases,
                                             up.weight, up.scales, up.biases, *inject, hc.hc_count, float(norm.eps),
                                             down.group_size, down.bits)
        return mixed if inj is None else (mixed, h, weights)
    return premix_by_modules(hc, h)


def premix_by_modules(hc: torch.nn.Module, h: torch.Tensor):
    """``hc(h)`` with the projections as module calls and only the norm fused (where it can be): what
    :func:`hyper_premix` runs for a module it cannot fuse whole (and benchmarks/bench_hc.py's baseline)."""
    normed = fused_norm(hc.hc_norm, h)
    weight = F.silu(hc.input_mix_weight_down(normed) / hc.hc_count)
    weight = torch.sigmoid(hc.input_mix_weight_up(weight)).unflatten(-1, (hc.hc_count, hc.hidden_size))
    mixed = (weight * normed.unflatten(-1, (hc.hc_count, hc.hidden_size))).mean(dim=-2)
    if hc.block_inject_weight is None:
        return mixed
    return mixed, h, 2 * torch.sigmoid(hc.block_inject_weight(normed) / hc.hc_count)


def post_combine(hyper: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """A sublayer's output added back into every stream: hyper Tensor[T, hc * hidden] + out Tensor[T, hidden]
    weighted per stream by inject Tensor[T, hc]; one ``hc_post_combine`` dispatch where the three share
    a float dtype (the decoder layer's two ops otherwise, with their type promotion)."""
    if hyper.dim() == 2 and out.dim() == 2 and inject.dim() == 2 and hyper.dtype == out.dtype == inject.dtype \
            and hyper.dtype in _FLOATS:
        return hc_post_combine(hyper, out, inject)
    return post_combine_by_ops(hyper, out, inject)


def post_combine_by_ops(hyper: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """The decoder layer's own post-combine, two ops (a mul and an add)."""
    return hyper + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)

"""A checkpoint written by ``python -m hebrus_torch.convert`` (docs/quantization.md): its ``quantization_config``
read and checked, and the meta model's modules swapped for their quantized forms before the weights are
planned, so that the loader fills :class:`~hebrus_torch.moe.quantized_experts.QuantizedExperts` and
:class:`~hebrus_torch.moe.quantized_linear.QuantizedLinear` buffers as it fills any other weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointError
from .files import CheckpointFiles
from .keymap import _EXPERT, _text_name

__all__ = ["QuantSpec", "quantization_of", "refuse_unannounced", "swap_quantized_modules"]

QUANT_METHOD = "hebrus_affine"    # hebrus_torch.convert.QUANT_METHOD (not imported: the converter imports this package)


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int


def quantization_of(config: Any, where: str) -> QuantSpec | None:
    """The checkpoint's ``quantization_config`` (None when it has none); CheckpointError for one this loader does
    not read."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method, bits, group = qc.get("quant_method"), qc.get("bits"), qc.get("group_size")
    if method != QUANT_METHOD:
        raise CheckpointError(f"{where}: quantization_config quant_method {method!r} is not supported (this loader "
                              f"reads {QUANT_METHOD!r}, written by python -m hebrus_torch.convert)")
    if bits not in (4, 8) or group not in (32, 64, 128) or qc.get("mode", "affine") != "affine":
        raise CheckpointError(f"{where}: quantization_config bits={bits!r}, group_size={group!r}, "
                              f"mode={qc.get('mode')!r}: bits 4 or 8, group_size 32, 64 or 128, mode affine")
    return QuantSpec(int(bits), int(group))


def refuse_unannounced(files: CheckpointFiles, where: str) -> None:
    """A checkpoint with quantized weights (``*.scales``) but no quantization_config: CheckpointError."""
    scales = next((key for key in files.tensors if key.endswith(".scales") and _text_name(key) is not None), None)
    if scales is not None:
        raise CheckpointError(f"{where} has no quantization_config, but the checkpoint stores quantized weights "
                              f"({scales!r})")


def swap_quantized_modules(model: torch.nn.Module, files: CheckpointFiles, spec: QuantSpec,
                           dtype: torch.dtype) -> None:
    """On the meta model: every transformers experts module becomes a QuantizedExperts, and every module whose
    ``.scales`` the checkpoint stores a QuantizedLinear (buffers on meta, of the shapes the format gives)."""
    from hebrus_torch.integrations.qwen4_exp.common import _modeling
    from hebrus_torch.moe.quantized_experts import QuantizedExperts
    from hebrus_torch.moe.quantized_linear import QuantizedLinear

    experts_type = _modeling().Qwen4ExpTextExperts
    linears = sorted({name[:-len(".scales")] for key in files.tensors
                      if (name := _text_name(key)) is not None and name.endswith(".scales")
                      and not _EXPERT.match(name)})
    for name in linears:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if type(module) is not torch.nn.Linear or module.bias is not None:
            raise CheckpointError(f"{files.directory}: the checkpoint stores {name}.scales, but {name} is not a "
                                  f"bias-free linear of the config's model")
        if module.in_features % spec.group_size:
            raise CheckpointError(f"{files.directory}: {name} is stored quantized, but its input dimension "
                                  f"{module.in_features} is not a multiple of group_size {spec.group_size}")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                QuantizedLinear.empty(module.in_features, module.out_features, spec.bits, spec.group_size, dtype,
                                      device="meta"))
    for parent in list(model.modules()):
        for leaf, child in list(parent.named_children()):
            if type(child) is not experts_type:
                continue
            num, two_i, hidden = child.gate_up_proj.shape
            inter = child.down_proj.shape[2]
            if hidden % spec.group_size or inter % spec.group_size:
                raise CheckpointError(f"{files.directory}: the routed experts ({hidden} x {inter}) cannot be "
                                      f"quantized at group_size {spec.group_size}")

            def empty(*shape, int_codes=False):
                return torch.empty(shape, dtype=torch.int32 if int_codes else dtype, device="meta")

            per_word = 32 // spec.bits
            setattr(parent, leaf, QuantizedExperts(
                empty(num, two_i, hidden // per_word, int_codes=True), empty(num, two_i, hidden // spec.group_size),
                empty(num, two_i, hidden // spec.group_size), empty(num, hidden, inter // per_word, int_codes=True),
                empty(num, hidden, inter // spec.group_size), empty(num, hidden, inter // spec.group_size),
                spec.bits, spec.group_size))

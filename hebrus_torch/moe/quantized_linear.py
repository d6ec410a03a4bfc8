"""A linear layer with affine-quantized weights (issue 36): :class:`QuantizedLinear`, a drop-in for a bias-free
``torch.nn.Linear`` that runs ``hebrus::quantized_linear``, and :func:`quantize_linears`, which swaps it in.

It lives beside :class:`~hebrus_torch.moe.quantized_experts.QuantizedExperts` because both read the one format
of :mod:`hebrus_torch.moe.quantize` and their kernels share code (csrc/cpu/moe_kernels.cpp).
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import HebrusError
from .quantize import check_quant_options, quantize

__all__ = ["QuantizedLinear", "quantize_linears"]


class QuantizedLinear(torch.nn.Module):
    """``y = x W^T`` with ``W [out, in]`` stored quantized (:mod:`hebrus_torch.moe.quantize`).

    Buffers (the names the converter writes, ``<module>.weight`` / ``.scales`` / ``.biases``): ``weight``
    [out, in * bits / 32] int32 (packed codes), ``scales`` and ``biases`` [out, in / group_size] in the model's
    dtype. ``forward(x [..., in]) -> [..., out]`` in x's dtype (x's dtype must be the scales').
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
                 group_size: int) -> None:
        super().__init__()
        check_quant_options(bits, group_size)
        self.bits, self.group_size = int(bits), int(group_size)
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1] * 32 // self.bits
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("biases", biases)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bits: int, group_size: int, dtype: torch.dtype,
              device: torch.device | str | None = None) -> "QuantizedLinear":
        """Uninitialised buffers of the right shapes (``device="meta"`` for a loader to fill)."""
        check_quant_options(bits, group_size, in_features, op="QuantizedLinear")
        groups = in_features // group_size
        return cls(torch.empty(out_features, in_features * bits // 32, dtype=torch.int32, device=device),
                   torch.empty(out_features, groups, dtype=dtype, device=device),
                   torch.empty(out_features, groups, dtype=dtype, device=device), bits, group_size)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, bits: int = 4, group_size: int = 64) -> "QuantizedLinear":
        """Quantize a bias-free ``nn.Linear``'s weight (HebrusError for one with a bias or an input dimension
        that is not a multiple of ``group_size``)."""
        if linear.bias is not None:
            raise HebrusError("hebrus::QuantizedLinear: a linear with a bias is not supported")
        return cls(*quantize(linear.weight.detach(), bits, group_size), bits, group_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .ops import quantized_linear

        flat = x.reshape(-1, x.shape[-1])
        return quantized_linear(flat, self.weight, self.scales, self.biases, self.group_size,
                                self.bits).view(*x.shape[:-1], self.out_features)


def quantize_linears(model: torch.nn.Module, names: Iterable[str], bits: int = 4,
                     group_size: int = 64) -> torch.nn.Module:
    """Replace the ``nn.Linear`` modules of ``model`` named ``names`` by their :class:`QuantizedLinear`, in place
    (every one is checked before any is replaced); returns ``model``."""
    targets = []
    for name in names:
        module = model.get_submodule(name)
        if type(module) is not torch.nn.Linear or module.bias is not None:
            raise HebrusError(f"hebrus::quantize_linears: {name} is a {type(module).__name__}"
                              f"{' with a bias' if isinstance(module, torch.nn.Linear) else ''}, not a bias-free "
                              f"nn.Linear")
        check_quant_options(bits, group_size, module.in_features, op="quantize_linears")
        parent, _, leaf = name.rpartition(".")
        targets.append((model.get_submodule(parent), leaf, module))
    for parent, leaf, module in targets:
        setattr(parent, leaf, QuantizedLinear.from_linear(module, bits, group_size))
    return model

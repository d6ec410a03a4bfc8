"""How close the CPU fused ops come to transformers' modules. Their CPU kernels compute the norms, gates and
activations in hebrus's own row arithmetic (csrc/cpu/row_math.h: fp32, fixed orders, rounded to the dtype where the
modules' ops round), not in the modules' ATen sequence, so they agree with the modules to a tolerance, not bit for
bit (docs/engine.md, "The CPU fused ops' arithmetic"): SPEC §5's 1e-5 for fp32 outputs, and for 16-bit ones a unit
or two in the last place (a value on either side of a rounding boundary). What stays bitwise is tested as such:
each row's result independent of the other rows of the call."""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def near(got: torch.Tensor, want: torch.Tensor, like: torch.dtype | None = None) -> bool:
    """got has want's shape and dtype and is within the tolerance of ``like`` (default: want's dtype), relative and
    absolute, of want."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    tol = TOLERANCE[like or want.dtype]
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)

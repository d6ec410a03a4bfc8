"""Which kernel the CPU ops' dense products of a few rows take: hebrus' row kernel (the default) or ATen's ``mm``.

Inside the fused CPU ops (the native decoder-layer calls, ``hc_premix``, the MoE block's shared expert) a float32
projection ``x @ W.T`` of at most 8 rows (a decode step's: one token per request) is computed by the row kernel
(``csrc/cpu/row_math.cpp``): each output one dot product in a fixed order (16 lanes, then the lanes combined
pairwise), so a row's bits depend on that row alone, never on how many rows the call has, the threads or the CPU's
vector width; and on one core it is faster than MKL's small-row products where MKL takes its generic code (an AMD
CPU: 1.4x for a 1-row ``lm_head`` inside a decode step, 1.4-1.8x at 2-8 rows; benchmarks/RESULTS.md). Its bits are not ATen's: ``nn.Linear`` of the same rows differs in the last bits
(within float32 rounding of the sum; SPEC §8 compares such products with a tolerance).

With it off, those products are ``at::mm`` (more rows always are): the bits of the model's own ``nn.Linear``,
which the suites that compare a fused op with the model's modules bit for bit ask for.

The setting is process-wide (not per thread); a build without the compiled extension has no such products.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _extension

__all__ = ["dense_row_kernel", "row_kernel_enabled", "set_dense_row_kernel"]

_enabled = True


def set_dense_row_kernel(enabled: bool) -> bool:
    """Turn the row kernel on (True) or off (False) for every thread; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    if _extension._C is not None:
        _extension._C._set_row_kernel(_enabled)
    return previous


def row_kernel_enabled() -> bool:
    """Whether the CPU ops' dense products of a few rows take the row kernel now."""
    return _enabled


@contextlib.contextmanager
def dense_row_kernel(enabled: bool) -> Iterator[None]:
    """``with dense_row_kernel(False): ...`` runs the block with the setting given, then restores the previous one."""
    previous = set_dense_row_kernel(enabled)
    try:
        yield
    finally:
        set_dense_row_kernel(previous)

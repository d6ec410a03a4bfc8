"""Host copies of small device tensors that the host built itself (row boundaries, positions).

A holder that needs the values of a tensor it was handed (``cu_seqlens``) to check or plan on the
host would read it back from the device: a sync on GPUs. Where the tensor was built on the host from
Python ints in the first place (``Batch.pack``), the builder records those ints with :func:`mirror`
and readers take them with :func:`host_ints`, which falls back to reading the tensor when there is
no mirror or the tensor was written since (its version counter moved; an inference-mode tensor has
none, and its mirror is taken as it is: mirror only tensors nobody writes after building them).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["mirror", "host_ints"]

_ATTR = "_hebrus_host_values"


def mirror(t: torch.Tensor, values: Sequence[int]) -> torch.Tensor:
    """Record that the 1-D tensor ``t`` holds ``values`` (the ints it was built from); returns ``t``."""
    values = tuple(map(int, values))
    if t.dim() != 1 or t.shape[0] != len(values):
        raise ValueError(f"host_mirror: {len(values)} values for a tensor of shape {list(t.shape)}")
    setattr(t, _ATTR, (_version(t), values))
    return t


def _version(t: torch.Tensor) -> int | None:
    # inference tensors track no version (reading it raises, and a raise costs ~6 us a call)
    return None if t.is_inference() else t._version


def host_ints(t: torch.Tensor) -> list[int]:
    """The values of the 1-D integer tensor ``t`` as Python ints: its mirror when one is current, else
    read from ``t`` (on a GPU that read waits for the device)."""
    held = getattr(t, _ATTR, None)
    if held is not None and held[0] == _version(t):
        return list(held[1])
    return [int(v) for v in t.tolist()]

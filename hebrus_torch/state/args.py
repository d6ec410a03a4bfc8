"""Argument checks of the holders' public methods: a wrong type is bad input, a HebrusError."""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..errors import HebrusError


def as_int(what: str, value: Any) -> int:
    """``value`` as a Python int (ints and integer tensors of one element; not bools, not floats)."""
    if isinstance(value, bool):
        raise HebrusError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise HebrusError(f"{what} must be an integer, got {value!r}") from None


def as_tensor(what: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise HebrusError(f"{what} must be a Tensor, got {type(value).__name__}")
    return value

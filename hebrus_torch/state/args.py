"""Argument checks of the holders' public methods: a wrong type is bad input, a HebrusError."""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from .._validate import FLOAT_DTYPES  # the dtypes the kernels take: holders keep their state in them
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


def check_cast(owner: str, fn: Callable[[torch.Tensor], torch.Tensor], float_dtype: torch.dtype,
               device: torch.device) -> None:
    """Refuse, before ``nn.Module._apply(fn)`` changes anything, a move or cast (``.to``, ``.half``,
    ``.double``, ``.type``, ...) that would give the holder's floating-point state a dtype outside
    float32/float16/bfloat16, or change the dtype of its integer and bool tensors. ``fn`` runs on empty
    tensors of each kind (so a move to an unavailable device fails here too)."""
    for dtype in (float_dtype, torch.int64, torch.int32, torch.bool):
        got = fn(torch.empty(0, dtype=dtype, device=device)).dtype
        if dtype is float_dtype and got not in FLOAT_DTYPES:
            raise HebrusError(f"{owner}: cannot cast the state to {got}; holders keep float32, float16 or bfloat16")
        if dtype is not float_dtype and got != dtype:
            raise HebrusError(f"{owner}: cannot cast its {dtype} tensors (slot tables, ids, positions) to {got}")


def conv_weight(op: str, layer: int, weight: Any, registered: list | None, channels: tuple[str, int], kernel: int,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A depthwise conv's weight as the slot ops take it, ``[C, K]`` in ``dtype`` on ``device``: ``weight`` (``[C, K]``
    or transformers' ``[C, 1, K]``), else layer ``layer``'s of ``registered``. ``channels``: (C's name in messages,
    C)."""
    if weight is None:
        if registered is None:
            raise HebrusError(f"{op}: no weight passed and none registered")
        weight = registered[layer]
    name, c = channels
    want = (c, kernel)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) not in (want, (c, 1, kernel)):
        got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise HebrusError(f"{op}: layer {layer} weight must be [{name}, K] = {list(want)} (or transformers' "
                          f"[{name}, 1, K]), got {got}")
    # (Each call below only where it changes something: at decode the holder's own tensor ops cost more, with cold
    # caches, than moving the bytes; the same weight reaches the op.)
    if weight.shape != want:
        weight = weight.reshape(want)
    if weight.dtype != dtype or weight.device != device:
        weight = weight.to(device=device, dtype=dtype)
    return weight

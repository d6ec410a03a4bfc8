"""Exceptions raised by hebrus_torch.

Every error is a :class:`HebrusError`, itself a :class:`ValueError`, so code that already catches
``ValueError`` for bad input keeps working. C++ kernels raise ``ValueError`` whose message starts
with ``[<ClassName>]``; :func:`translate` turns those into the matching subclass.
"""

from __future__ import annotations

import contextlib
import re
from typing import ContextManager

import torch


class HebrusError(ValueError):
    """Base class of every error hebrus_torch raises for bad input or bad state."""


class HoleError(HebrusError):
    """A logical position is missing inside a sequence's contiguous run."""


class NonSuccessorError(HebrusError):
    """An append did not target ``frontier + 1`` of the sequence's run."""


class StaleHandleError(HebrusError):
    """A ``SeqHandle`` refers to a slot that was freed or reset since it was issued."""


class CapacityError(HebrusError):
    """No free slot or cell is left."""


class CorruptStateError(HebrusError):
    """A saved blob or state dict is truncated, tampered with or of another format."""


class DuplicateSequenceError(HebrusError):
    """One sequence given two rows of one batch (each row reads and advances its sequence's state: a
    second row of it would be lost or run from the wrong state)."""


_BY_NAME = {
    cls.__name__: cls
    for cls in (HebrusError, HoleError, NonSuccessorError, StaleHandleError, CapacityError, CorruptStateError)
}
_TAG = re.compile(r"\[(\w+Error)\]\s*")


def translate(exc: BaseException) -> BaseException:
    """Map a kernel's tagged ``ValueError``/``RuntimeError`` to its ``HebrusError`` subclass.

    Returns ``exc`` itself when it carries no hebrus tag.
    """
    if isinstance(exc, HebrusError) or not isinstance(exc, (ValueError, RuntimeError)):
        return exc
    text = str(exc)
    match = _TAG.search(text)
    if match is None or match.group(1) not in _BY_NAME:
        return exc
    # Drop the C++ backtrace torch appends in debug builds; keep the first line of the message.
    message = text[match.end():].split("\nException raised from")[0].strip()
    return _BY_NAME[match.group(1)](message)


class _Translated:
    """The context of :func:`translated`: stateless, so one instance serves every (nested) use. A class rather
    than a generator context manager: every hebrus op call enters one, ~60 a decode step."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, (ValueError, RuntimeError)):
            return False
        mapped = translate(exc)
        if mapped is exc:
            return False
        raise mapped from None


_TRANSLATED = _Translated()


def translated() -> ContextManager[None]:
    """Context manager re-raising tagged kernel errors as ``HebrusError`` subclasses (a ``nullcontext`` while
    ``torch.compile`` traces: dynamo enters only context managers it knows, and a compiled graph's kernels run
    after the trace, outside it, anyway)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _TRANSLATED


__all__ = [
    "HebrusError",
    "HoleError",
    "NonSuccessorError",
    "StaleHandleError",
    "CapacityError",
    "CorruptStateError",
    "translate",
    "translated",
]

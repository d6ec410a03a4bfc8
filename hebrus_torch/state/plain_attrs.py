"""Bookkeeping attributes of the state holders set without ``nn.Module.__setattr__``'s checks.

A holder sets a few attributes on every transaction and operation (its undo log, its transaction, memos, its
allocation heads). They are never parameters, buffers or modules, and ``nn.Module.__setattr__`` ends with a plain
``object.__setattr__`` for such a name after checking the value against each of those kinds (~1.5 us a set, ~25
sets a decode step). A holder lists those names in ``_PLAIN_ATTRS``; any other name takes the module's path.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PlainAttrs"]


class PlainAttrs:
    """Mixin placed before ``torch.nn.Module`` in a holder's bases: the names in ``_PLAIN_ATTRS`` are set as plain
    attributes."""

    _PLAIN_ATTRS: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self)._PLAIN_ATTRS:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

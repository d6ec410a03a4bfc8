"""Per-layer views of a holder's state tensors, kept between steps.

A step's native calls take each layer's slice of a holder's stacked state (``keys[l]``, ``conv_state[l]``, ...): a
``select`` each, ~4 us inside a step whose weights have pushed the dispatcher out of the caches, a dozen a step. A
view stays the layer's slice while its base is the same tensor object (the holders replace a state tensor, never
re-point one in place: growth, device and dtype moves and savepoint restores all assign a new object), so the views
are made once and made again when any base is another object.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

__all__ = ["LayerViews"]


class LayerViews:
    """``views(bases, layer)``: ``[t[layer] for t in bases]``, kept while ``bases`` are the same objects."""

    __slots__ = ("_bases", "_views")

    def __init__(self) -> None:
        self._bases: tuple = ()
        self._views: dict[int, list[torch.Tensor]] = {}

    def views(self, bases: Sequence[torch.Tensor], layer: int) -> list[torch.Tensor]:
        kept = self._bases
        if len(kept) != len(bases) or not all(map(operator.is_, kept, bases)):
            self._bases, self._views = tuple(bases), {}
        found = self._views.get(layer)
        if found is None:
            found = self._views[layer] = [t[layer] for t in bases]
        return found

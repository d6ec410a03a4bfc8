"""Sequence handles: a slot plus a generation, so a freed or reset slot cannot be reached by an old handle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CapacityError, HebrusError, StaleHandleError


@dataclass(frozen=True, order=True)
class SeqHandle:
    """Names one sequence: ``slot`` is where its state lives, ``generation`` which owner of the slot it is."""

    slot: int
    generation: int

    def __repr__(self) -> str:
        return f"SeqHandle(slot={self.slot}, generation={self.generation})"


class SlotTable:
    """Live flags and generations of ``capacity`` slots.

    ``generation[slot]`` only grows: freeing or resetting a slot bumps it, so every handle issued
    before is stale from then on. The two tensors are what a holder saves in its ``state_dict``.
    """

    def __init__(self, capacity: int, owner: str):
        if capacity < 1:
            raise HebrusError(f"{owner}: max_sequences must be >= 1, got {capacity}")
        self.owner = owner
        self.generation = torch.zeros(capacity, dtype=torch.int64)
        self.live = torch.zeros(capacity, dtype=torch.bool)

    @property
    def capacity(self) -> int:
        return self.generation.shape[0]

    def live_handles(self) -> list[SeqHandle]:
        return [SeqHandle(s, int(self.generation[s])) for s in torch.nonzero(self.live).flatten().tolist()]

    def check(self, handle: SeqHandle) -> int:
        """Returns the slot of a live, current handle; raises StaleHandleError otherwise."""
        if not isinstance(handle, SeqHandle):
            raise HebrusError(f"{self.owner}: expected a SeqHandle, got {type(handle).__name__}")
        slot = handle.slot
        if not 0 <= slot < self.capacity:
            raise StaleHandleError(f"{self.owner}: {handle} names slot {slot} outside [0, {self.capacity})")
        if not bool(self.live[slot]) or int(self.generation[slot]) != handle.generation:
            state = "free" if not bool(self.live[slot]) else f"at generation {int(self.generation[slot])}"
            raise StaleHandleError(f"{self.owner}: {handle} is stale (slot {slot} is {state})")
        return slot

    def next_free(self, handle: SeqHandle | None = None) -> SeqHandle:
        """The handle ``claim`` would issue, without claiming it."""
        if handle is not None:
            slot = handle.slot
            if not 0 <= slot < self.capacity:
                raise CapacityError(f"{self.owner}: slot {slot} outside [0, {self.capacity})")
            if bool(self.live[slot]):
                raise HebrusError(f"{self.owner}: slot {slot} is already in use by "
                                  f"{SeqHandle(slot, int(self.generation[slot]))}")
            if handle.generation < int(self.generation[slot]):
                raise StaleHandleError(f"{self.owner}: {handle} is older than slot {slot}'s generation "
                                       f"{int(self.generation[slot])}")
            return handle
        free = torch.nonzero(~self.live).flatten()
        if free.numel() == 0:
            raise CapacityError(f"{self.owner}: all {self.capacity} sequence slots are in use")
        slot = int(free[0])
        return SeqHandle(slot, int(self.generation[slot]))

    def claim(self, handle: SeqHandle | None = None) -> SeqHandle:
        """Marks a free slot live. With ``handle``, adopts exactly that slot and generation
        (how a ModelCache makes its holders share handles)."""
        handle = self.next_free(handle)
        self.generation[handle.slot] = handle.generation
        self.live[handle.slot] = True
        return handle

    def release(self, handle: SeqHandle) -> None:
        slot = self.check(handle)
        self.live[slot] = False
        self.generation[slot] += 1

    def load(self, generation: torch.Tensor, live: torch.Tensor) -> None:
        self.generation = generation.clone()
        self.live = live.clone()

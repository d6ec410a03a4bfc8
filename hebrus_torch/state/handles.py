"""Sequence handles: a slot plus a generation, so a freed or reset slot cannot be reached by an old handle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CapacityError, HebrusError, StaleHandleError
from .args import as_int
from .blob import short

MAX_GENERATION = 2**62 - 1
"""The largest generation a slot may reach. A slot at it is retired (never issued again), so a live
handle's generation is below it and freeing bumps it to at most this: no generation, nor a small sum
of one, ever overflows int64 (the dtype of the ``generation`` buffers)."""
_BOUND = "2**62 - 1"


def generation_problem(generation: list, live: list) -> str | None:
    """What is wrong with a slot table read from saved state (None if nothing): every generation an int
    in [0, MAX_GENERATION], every live flag a bool, and a live slot's generation below MAX_GENERATION."""
    for slot, (g, on) in enumerate(zip(generation, live)):
        if type(g) is not int or not 0 <= g <= MAX_GENERATION:
            return f"slot {slot} has generation {short(g)}; generations are integers in [0, {_BOUND}]"
        if type(on) is not bool:
            return f"slot {slot} has live flag {short(on)}, not a bool"
        if on and g == MAX_GENERATION:
            return (f"slot {slot} is live at generation {_BOUND}, the largest; a live sequence's generation is "
                    f"below it (freeing bumps it)")
    return None


@dataclass(frozen=True, order=True)
class SeqHandle:
    """Names one sequence: ``slot`` is where its state lives, ``generation`` which owner of the slot it is."""

    slot: int
    generation: int

    def __post_init__(self) -> None:
        # Plain ints only (an integer tensor or numpy integer is converted): a float, bool, str or None
        # would be adopted by a holder and then fail to match its own int64 slot table.
        for name in ("slot", "generation"):
            value = getattr(self, name)
            if type(value) is not int:
                object.__setattr__(self, name, as_int(f"SeqHandle.{name}", value))

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
        # Python lists: checked on every call of a hot path, where tensor element reads cost microseconds.
        self._generation = [0] * capacity
        self._live = [False] * capacity

    @property
    def capacity(self) -> int:
        return len(self._generation)

    @property
    def generation(self) -> torch.Tensor:
        """Tensor[capacity] int64 (a copy)."""
        return torch.tensor(self._generation, dtype=torch.int64)

    @property
    def live(self) -> torch.Tensor:
        """Tensor[capacity] bool (a copy)."""
        return torch.tensor(self._live, dtype=torch.bool)

    def live_handles(self) -> list[SeqHandle]:
        return [SeqHandle(s, g) for s, (g, on) in enumerate(zip(self._generation, self._live)) if on]

    def check(self, handle: SeqHandle) -> int:
        """Returns the slot of a live, current handle; raises StaleHandleError otherwise."""
        if not isinstance(handle, SeqHandle):
            raise HebrusError(f"{self.owner}: expected a SeqHandle, got {type(handle).__name__}")
        slot = handle.slot
        if not 0 <= slot < self.capacity:
            raise StaleHandleError(f"{self.owner}: {handle} names slot {slot} outside [0, {self.capacity})")
        if not self._live[slot] or self._generation[slot] != handle.generation:
            state = "free" if not self._live[slot] else f"at generation {self._generation[slot]}"
            raise StaleHandleError(f"{self.owner}: {handle} is stale (slot {slot} is {state})")
        return slot

    def check_all(self, handles) -> list[int]:
        """``[check(h) for h in handles]``, with the check of a live, current handle inline (a decode step
        checks every sequence of the batch once per layer); any other handle goes through ``check``,
        which raises as it always does."""
        generation, live, capacity = self._generation, self._live, len(self._generation)
        slots = []
        for handle in handles:
            if type(handle) is SeqHandle:
                slot = handle.slot
                if 0 <= slot < capacity and live[slot] and generation[slot] == handle.generation:
                    slots.append(slot)
                    continue
            slots.append(self.check(handle))
        return slots

    def lists(self) -> tuple[list[int], list[bool]]:
        """Copies of the generations and live flags as lists (what a savepoint keeps; ``load`` takes them)."""
        return list(self._generation), list(self._live)

    def next_free(self, handle: SeqHandle | None = None) -> SeqHandle:
        """The handle ``claim`` would issue, without claiming it. A slot whose generation reached
        ``MAX_GENERATION`` is retired: it is never issued again."""
        if handle is not None:
            if not isinstance(handle, SeqHandle):
                raise HebrusError(f"{self.owner}: expected a SeqHandle, got {type(handle).__name__}")
            slot = handle.slot
            if not 0 <= slot < self.capacity:
                raise CapacityError(f"{self.owner}: slot {slot} outside [0, {self.capacity})")
            if handle.generation < self._generation[slot]:   # stale, whether the slot is free or reused
                raise StaleHandleError(f"{self.owner}: {handle} is older than slot {slot}'s generation "
                                       f"{self._generation[slot]}")
            if self._live[slot]:
                raise HebrusError(f"{self.owner}: slot {slot} is already in use by "
                                  f"{SeqHandle(slot, self._generation[slot])}")
            if handle.generation >= MAX_GENERATION:
                raise HebrusError(f"{self.owner}: {handle} cannot be issued: a live sequence's generation is below "
                                  f"{_BOUND} (a slot that reaches it is retired)")
            return handle
        for slot, on in enumerate(self._live):
            if not on and self._generation[slot] < MAX_GENERATION:
                return SeqHandle(slot, self._generation[slot])
        retired = sum(g >= MAX_GENERATION for g in self._generation)
        raise CapacityError(f"{self.owner}: all {self.capacity} sequence slots are in use"
                            + (f" ({retired} retired at generation {_BOUND})" if retired else ""))

    def claim(self, handle: SeqHandle | None = None) -> SeqHandle:
        """Marks a free slot live. With ``handle``, adopts exactly that slot and generation
        (how a ModelCache makes its holders share handles)."""
        handle = self.next_free(handle)
        self._generation[handle.slot] = handle.generation
        self._live[handle.slot] = True
        return handle

    def release(self, handle: SeqHandle) -> None:
        slot = self.check(handle)
        self._live[slot] = False
        self._generation[slot] += 1

    def assign(self, generation: list[int], live: list[bool]) -> None:
        """Take two lists ``load`` has built (or checked) as they are: the step of a publish that cannot fail."""
        self._generation, self._live = generation, live

    def load(self, generation: torch.Tensor | list[int], live: torch.Tensor | list[bool]) -> None:
        generation = [int(g) for g in (generation.tolist() if isinstance(generation, torch.Tensor) else generation)]
        live = [bool(v) for v in (live.tolist() if isinstance(live, torch.Tensor) else live)]
        if len(generation) != self.capacity or len(live) != self.capacity:
            raise HebrusError(f"{self.owner}: slot table of {len(generation)} entries, expected {self.capacity}")
        self._generation, self._live = generation, live

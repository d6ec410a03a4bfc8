"""The sequence lifecycle of a holder that keeps each sequence's state in one slot of its buffers
(PLEState, GDNState): new / free / reset / clear / copy / fork / keep, written once (SPEC §4).

Every method runs inside ``atomic(self)`` (hebrus_torch.state.transaction), so a failure part way
changes nothing; what a holder must define is listed on :class:`SlotLifecycle`.
"""

from __future__ import annotations

import torch

from .handles import SeqHandle, SlotTable
from .transaction import atomic


class SlotLifecycle:
    """Mixin: the lifecycle over the holder's slot primitives.

    The holder defines ``slots``, ``snapshot(seq)``, ``_snapshot_parts(snap)`` (a snapshot's tensors in
    ``_write_slot``'s order), ``_clear_slot(slot)`` (fresh state), ``_write_slot(slot, *parts)`` and
    ``_sync_slot_buffers()`` (after slots are claimed or released), and ``_drop_staged(slot)`` where an
    open transaction stages per-slot changes.
    """

    slots: SlotTable

    def _drop_staged(self, slot: int) -> None:
        """Forget the open transaction's staged changes of a slot (none by default)."""

    _index_cache: tuple | None = None

    def _slot_index(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """``slots`` as an int32 tensor on ``device`` (what the slot ops take): the last chunk's is reused
        while the sequences stay the same (every layer of a step, and most steps of a decode), so that
        the common case builds no tensor. Nothing writes it: the ops and the undo log only read it."""
        key = (tuple(slots), device)
        cached = self._index_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        index = torch.tensor(slots, dtype=torch.int32, device=device)
        self._index_cache = (key, index)
        return index

    # ------------------------------------------------------------------ the lifecycle
    def new_sequence(self, handle: SeqHandle | None = None) -> SeqHandle:
        """Claim a slot (``handle`` adopts a given one) with fresh state."""
        with atomic(self):
            handle = self.slots.claim(handle)
            self._clear_slot(handle.slot)
            self._sync_slot_buffers()
        return handle

    def free(self, seq: SeqHandle) -> None:
        with atomic(self):
            slot = self.slots.check(seq)
            self.slots.release(seq)
            self._drop_staged(slot)
            self._sync_slot_buffers()

    def reset(self, seq: SeqHandle) -> SeqHandle:
        """Fresh state for the sequence; its slot's generation is bumped, so the new handle is returned."""
        with atomic(self):
            self.slots.check(seq)
            self.slots.release(seq)
            handle = self.slots.claim(SeqHandle(seq.slot, seq.generation + 1))
            self._clear_slot(handle.slot)
            self._sync_slot_buffers()
        return handle

    def clear(self, seq: SeqHandle) -> None:
        """Fresh state for a live sequence, keeping its handle."""
        with atomic(self):
            self._clear_slot(self.slots.check(seq))

    def copy(self, src: SeqHandle, dst: SeqHandle) -> None:
        """dst's state becomes src's (as it would be published now)."""
        parts = self._snapshot_parts(self.snapshot(src))
        with atomic(self):
            self._write_slot(self.slots.check(dst), *parts)

    def fork(self, src: SeqHandle) -> SeqHandle:
        """A new sequence with a copy of src's state."""
        parts = self._snapshot_parts(self.snapshot(src))
        with atomic(self):
            handle = self.slots.claim()
            self._write_slot(handle.slot, *parts)
            self._sync_slot_buffers()
        return handle

    def keep(self, seq: SeqHandle) -> None:
        """llama.cpp ``seq_keep``: free every sequence but ``seq``."""
        with atomic(self):
            self.slots.check(seq)
            for other in self.slots.live_handles():
                if other != seq:
                    self.free(other)

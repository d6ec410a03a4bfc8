"""The value checks the references share (SPEC §4 "Errors on GPUs"): on CPU (and MPS) they raise at once
with the offending row and value; on devices with device-side checks (CUDA and other accelerators) they
are device-side asserts, so no op waits for the device."""

from __future__ import annotations

import torch

from ..errors import HebrusError

__all__ = ["checks_async", "assert_values", "check_cu_seqlens_values", "check_slot_values"]


def checks_async(device: torch.device) -> bool:
    """Whether value checks on ``device`` are device-side asserts (SPEC §4 "Errors on GPUs": CUDA and
    other accelerators report bad values at their next synchronization, no op waits for the device) or
    raise at once (CPU; MPS, whose native kernels run wherever the extension is built)."""
    return device.type not in ("cpu", "mps", "meta")


def assert_values(ok: torch.Tensor, op: str, rule: str) -> None:
    """Device-side check that every entry of the bool tensor ``ok`` holds (``torch._assert_async``): the
    host does not wait; a failure surfaces at the device's next synchronization, as PyTorch's own
    index errors do. The message names the op and the rule (the device cannot format values)."""
    torch._assert_async(ok.all(), f"hebrus::{op}: {rule}")


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, total: int, op: str) -> None:
    """cu_seqlens[0] == 0, non-decreasing, cu_seqlens[-1] == total (on CPU at once; on CUDA as a device-side
    assert, with no host synchronization)."""
    if checks_async(cu_seqlens.device):
        cu = cu_seqlens.long()
        ok = (cu[0] == 0) & (cu[-1] == total)
        if cu.numel() > 1:
            ok = ok & (cu[1:] >= cu[:-1]).all()
        assert_values(ok, op, f"cu_seqlens must start at 0, be non-decreasing and end at T = {total}")
        return
    cu = cu_seqlens.to("cpu", torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != total:
        raise HebrusError(f"hebrus::{op}: cu_seqlens must start at 0 and end at T = {total}, "
                          f"got {int(cu[0])} .. {int(cu[-1])}")
    if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
        row = int(torch.nonzero(cu[1:] < cu[:-1])[0])
        raise HebrusError(f"hebrus::{op}: cu_seqlens must be non-decreasing; row {row} has "
                          f"cu_seqlens[{row}] = {int(cu[row])} > cu_seqlens[{row + 1}] = {int(cu[row + 1])}")


def check_slot_values(slots: torch.Tensor, pool_slots: int, op: str) -> None:
    """Every slot in [0, S) and none twice (each row updates its slot in place). On CPU at once, with the
    row and value; on CUDA as a device-side assert (the state holders check the slots they own on the
    host before launching, SPEC §4)."""
    s = slots.long()
    if checks_async(slots.device):
        ok = ((s >= 0) & (s < pool_slots)).all()
        if s.numel() > 1:
            ordered = torch.sort(s).values
            ok = ok & (ordered[1:] != ordered[:-1]).all()
        assert_values(ok, op, f"slots must lie in [0, S={pool_slots}) and be distinct")
        return
    s = s.cpu().tolist()
    first: dict[int, int] = {}
    for row, v in enumerate(s):
        if not 0 <= v < pool_slots:
            raise HebrusError(f"hebrus::{op}: slots[{row}] = {v} is outside [0, S={pool_slots})")
        if v in first:
            raise HebrusError(f"hebrus::{op}: slot {v} appears twice in one batch (rows {first[v]} and {row}); "
                              f"each row updates its slot in place")
        first[v] = row

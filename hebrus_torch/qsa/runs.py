"""Runs of logical positions, written once: contiguity, window starts, groups + raw tail (SPEC §3).

A visible sequence is one contiguous run of positions ``[p0, p0 + n)``; its ``n // r`` complete groups
are ``[p0 + r*g, p0 + r*g + r)`` and the last ``n % r`` positions are its raw tail. These helpers are the
one statement of those rules for the cache, the reference and the drop-in:

* :func:`first_hole` — where a list of positions stops being one run (or several back to back).
* :func:`window_start` / :func:`window_starts` — the first position a query at p sees under a window.
* :func:`group_and_tail_offsets` — the offsets (within a query's run) of its selected groups' tokens
  followed by its raw tail.

It also holds the cache's persistent int64 vectors (``_Vec``) and run records (``_Run``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CorruptStateError, HoleError

__all__ = ["MAX_POSITION", "HoleInSavedStateError", "first_hole", "window_start", "window_starts",
           "group_and_tail_offsets"]

# Positions are int64: a run may reach, never pass, the largest one.
MAX_POSITION = 2**63 - 1


class HoleInSavedStateError(CorruptStateError, HoleError):
    """A saved sequence or state dict whose positions are not one contiguous run: corrupt state that
    describes a hole. It is both a :class:`CorruptStateError` and a :class:`HoleError`."""


def first_hole(positions: torch.Tensor, p0: int | torch.Tensor, counts: torch.Tensor | None = None) -> int | None:
    """The index of the first entry of ``positions`` that breaks contiguity, or None.

    Args:
        positions: Tensor[N] int64, the positions held, in run order.
        p0: the run's first position; or, with ``counts``, Tensor[B] int64 first positions of B runs
            laid back to back in ``positions``.
        counts: optional Tensor[B] int64, the length of each run (summing to N).

    Entry j of run i must be ``p0[i] + (j - start of run i)``; the expected value at a returned index is
    ``p0 + j`` for one run.
    """
    n = positions.numel()
    dev = positions.device
    if counts is None:
        expected = int(p0) + torch.arange(n, dtype=torch.int64, device=dev)
    else:
        base = torch.cumsum(counts, 0) - counts
        expected = (torch.repeat_interleave(p0 - base, counts, output_size=n)
                    + torch.arange(n, dtype=torch.int64, device=dev))
    bad = positions != expected
    if bool(bad.any()):
        return int(torch.nonzero(bad)[0])
    return None


def window_start(p0: int, p: int, window: int | None, r: int) -> int:
    """The first position a query at ``p`` sees over a run anchored at ``p0`` (SPEC §3): with a window,
    whole groups are evicted from the front until at most ``window`` positions remain."""
    if window is None:
        return p0
    over = p - p0 + 1 - window
    return p0 if over <= 0 else p0 + r * -(-over // r)


def window_starts(p0: torch.Tensor, p: torch.Tensor, window: int | None, r: int) -> torch.Tensor:
    """:func:`window_start` of Tensor[T] int64 anchors ``p0`` and query positions ``p``."""
    if window is None:
        return p0
    over = p - p0 + 1 - window
    return p0 + r * torch.clamp(-torch.div(-over, r, rounding_mode="floor"), min=0)


def group_and_tail_offsets(selected: torch.Tensor, q_groups: torch.Tensor, nvis: torch.Tensor, r: int) -> torch.Tensor:
    """Offsets within each query's run of the tokens it attends: its selected groups' r tokens each, in
    ascending group order, then its raw tail, then -1 padding.

    Args:
        selected: Tensor[T, top_k] int64, selected group indices within each query's run, -1 padded.
        q_groups: Tensor[T] int, complete groups of each query's run.
        nvis: Tensor[T] int64, positions in each query's run (q_groups = nvis // r).
        r: tokens per group.

    Returns:
        Tensor[T, top_k*r + r - 1] int64.
    """
    t = selected.shape[0]
    dev = selected.device
    g_offs = (r * selected[:, :, None] + torch.arange(r, device=dev)).reshape(t, -1)
    g_offs = torch.where(selected.repeat_interleave(r, dim=1) >= 0, g_offs, -1)
    t_offs = r * q_groups.to(torch.int64)[:, None] + torch.arange(r - 1, device=dev)[None, :]
    t_offs = torch.where(t_offs < nvis[:, None], t_offs, -1)
    offs = torch.cat((g_offs, t_offs), dim=1)
    order = torch.sort((offs < 0).to(torch.int8), dim=1, stable=True).indices
    return offs.gather(1, order)


# --------------------------------------------------------------------------------------------------
# Persistent append-only int64 vectors (cells of a run, group rows of a run)
# --------------------------------------------------------------------------------------------------

class _Buf:
    __slots__ = ("data", "claimed")

    def __init__(self, data: torch.Tensor, claimed: int):
        self.data = data
        self.claimed = claimed


class _Vec:
    """An immutable view ``buf.data[start:start+n]`` (host int64: a QSACache keeps its runs on the
    host). ``extend`` appends in place (amortised O(k)) when this view ends where the buffer's claimed
    region ends, and copies otherwise, so views shared by several runs (fork, savepoints) never see
    each other's appends."""

    __slots__ = ("buf", "start", "n")

    def __init__(self, buf: _Buf, start: int, n: int):
        self.buf, self.start, self.n = buf, start, n

    @staticmethod
    def empty() -> "_Vec":
        return _Vec(_Buf(torch.empty(0, dtype=torch.int64), 0), 0, 0)

    @staticmethod
    def of(t: torch.Tensor) -> "_Vec":
        t = t.to(torch.int64).contiguous()
        return _Vec(_Buf(t.clone(), t.numel()), 0, t.numel())

    def tensor(self) -> torch.Tensor:
        return self.buf.data[self.start:self.start + self.n]

    def __len__(self) -> int:
        return self.n

    def extend(self, new: torch.Tensor) -> "_Vec":
        k = new.numel()
        if k == 0:
            return self
        end = self.start + self.n
        data = self.buf.data
        if self.buf.claimed == end and end + k <= data.numel():
            data[end:end + k] = new
            self.buf.claimed = end + k
            return _Vec(self.buf, self.start, self.n + k)
        size = max(16, 2 * (self.n + k))
        fresh = torch.empty(size, dtype=torch.int64, device=data.device)
        fresh[:self.n] = self.tensor()
        fresh[self.n:self.n + k] = new
        return _Vec(_Buf(fresh, self.n + k), 0, self.n + k)

    def drop_front(self, k: int) -> "_Vec":
        return _Vec(self.buf, self.start + k, self.n - k)

    def truncate(self, n: int) -> "_Vec":
        return _Vec(self.buf, self.start, n)


class _RunTable(dict):
    """The cache's runs by slot: a dict that counts its changes (``version``), so that what is derived from
    the runs (a chunk's checks, its plan rows) is reused across layers until they change."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.version = 0

    def __setitem__(self, key, value):
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.version += 1
        super().__delitem__(key)

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def popitem(self):
        self.version += 1
        return super().popitem()

    def clear(self):
        self.version += 1
        super().clear()

    def update(self, *args, **kwargs):
        self.version += 1
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self.version += 1
        return super().setdefault(key, default)


@dataclass(frozen=True)
class _Run:
    """One sequence's run: positions ``[p0, p0+n)`` in ``cells`` (len n), groups in ``groups`` (len n//r).
    An empty run keeps ``p0`` as the default first position of its next append."""

    p0: int
    n: int
    cells: _Vec
    groups: _Vec

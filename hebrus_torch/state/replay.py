"""What a step gave the recurrent holders' in-place ops, kept so the step can be cut short afterwards.

Speculative decoding feeds a sequence its last token plus k drafted ones in one step and keeps only
the accepted prefix. The recurrent state (PLE n-gram history and conv tails, GDN conv tails and
recurrent state) cannot be recomputed backwards, and re-running the model on the accepted tokens
would cost what speculation saves. Instead, while a :class:`ReplayLog` is attached to a holder, each
of its in-place state ops (``PLEState.ngram_ids`` / ``conv``, ``GDNState.conv`` / ``delta_rule``)
records the packed inputs it was given and the rows of its pool it was about to overwrite: the rows
its transaction's undo log copied anyway (references, no copy; PLE's conv, whose undo entry keeps
only what a decode drops, copies its rows' small tails). :meth:`ReplayLog.rewind` writes those rows
back for chosen sequences, and :meth:`ReplayLog.replay` calls the same ops again on the first n
tokens of their rows: every op is bitwise chunk- and batch-invariant (the recurrent form), so the
state it leaves is the state that feeding only those n tokens would have left. Only the state ops run
again, never the model's projections, attention or MoE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .handles import SeqHandle
from .host_mirror import host_ints, mirror

__all__ = ["ReplayLog"]


@dataclass
class _Record:
    holder: Any
    method: str
    layer: int
    seqs: tuple[SeqHandle, ...]
    bounds: tuple[int, ...]                 # the call's row boundaries (cu_seqlens, on the host)
    packed: dict[str, torch.Tensor]         # inputs with one row per packed token
    pool: str                               # the holder's pool the op writes (layer ``layer`` of it) ...
    before: torch.Tensor                    # ... and its rows of ``seqs`` before the op, [B, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class ReplayLog:
    """The inputs of one step's in-place state ops for the rows of ``seqs`` (other steps' rows are not kept).

    Args:
        seqs: the sequences whose rows the step may cut short.
    """

    def __init__(self, seqs: Sequence[SeqHandle]):
        self.seqs = frozenset(seqs)
        self.records: list[_Record] = []

    def record(self, holder: Any, method: str, layer: int, seqs: Sequence[SeqHandle], cu_seqlens: torch.Tensor,
               packed: Mapping[str, torch.Tensor], before: tuple[str, torch.Tensor], **kwargs: Any) -> None:
        """Called by a holder's op before it writes: ``holder.method(layer, seqs, cu_seqlens=..., **packed,
        **kwargs)`` is what :meth:`replay` calls again; ``before`` = (pool, rows): the op writes layer
        ``layer`` of ``holder.<pool>``, whose rows of ``seqs`` were ``rows`` (nobody may write them later)."""
        if self.seqs.isdisjoint(seqs):
            return
        self.records.append(_Record(holder, method, layer, tuple(seqs), tuple(host_ints(cu_seqlens)),
                                    dict(packed), before[0], before[1], kwargs))

    def holds(self, rows: torch.Tensor) -> bool:
        """Whether a record refers to ``rows`` (a holder recycling its undo buffers must keep those)."""
        return any(rec.before is rows for rec in self.records)

    def rewind(self, keep: Mapping[SeqHandle, int]) -> None:
        """Write back the rows every recorded op found for the listed sequences: the latest record first, so
        that a sequence's rows end as the first op of the step found them (its state before the step)."""
        picks: dict[tuple, tuple[list[SeqHandle], torch.Tensor]] = {}     # (the calls of a step share their rows)
        for rec in reversed(self.records):
            key = (rec.seqs, rec.before.device)
            if key not in picks:
                rows = [i for i, s in enumerate(rec.seqs) if s in keep]
                picks[key] = ([rec.seqs[i] for i in rows],
                              torch.tensor(rows, dtype=torch.int64).to(rec.before.device))      # an upload, no wait
            seqs, picked = picks[key]
            if seqs:
                rec.holder.write_layer_rows(rec.pool, rec.layer, seqs, rec.before.index_select(0, picked))

    def release(self) -> None:
        """Forget the records; a holder that recycles its undo buffers takes back those the records held."""
        for rec in self.records:
            recycle = getattr(rec.holder, "recycle_undo_rows", None)
            if recycle is not None:
                recycle(rec.before)
        self.records = []

    def replay(self, keep: Mapping[SeqHandle, int]) -> None:
        """Run every recorded op again on the first ``keep[seq]`` tokens of each listed sequence's row (the
        holders must hold those sequences' state from before the step: :meth:`rewind`)."""
        picks: dict[tuple, tuple[list[SeqHandle], torch.Tensor, torch.Tensor]] = {}   # (shared by a step's calls)
        for rec in self.records:
            device = next(iter(rec.packed.values())).device
            key = (rec.seqs, rec.bounds, device)
            if key not in picks:
                rows = [(i, s) for i, s in enumerate(rec.seqs) if s in keep]
                index: list[int] = []
                bounds = [0]
                for i, seq in rows:
                    start = rec.bounds[i]
                    n = min(int(keep[seq]), rec.bounds[i + 1] - start)
                    index.extend(range(start, start + n))
                    bounds.append(bounds[-1] + n)
                picked = torch.tensor(index, dtype=torch.int64).to(device)          # uploads, no wait
                cu = mirror(torch.tensor(bounds, dtype=torch.int32).to(device), bounds)
                picks[key] = ([s for _, s in rows], picked, cu)
            seqs, picked, cu = picks[key]
            if not seqs:
                continue
            packed = {name: t.index_select(0, picked) for name, t in rec.packed.items()}
            getattr(rec.holder, rec.method)(rec.layer, seqs, cu_seqlens=cu, **packed, **rec.kwargs)

"""Where each row's logits sit in a packed step's logits: built once per plan, read by the runner (which
tokens' hidden states go through ``lm_head``), the sampler (the rows that sample one token) and the
verifier (the rows of a speculative verification, one logits row per fed token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .scheduler import ScheduledChunk

__all__ = ["LogitsLayout"]


@dataclass(frozen=True)
class LogitsLayout:
    """Row i of a step (one sequence's tokens) wants logits at its last ``wanted[i]`` tokens (0: none, 1: the
    token sampled after it, its width: a verification row); they are rows ``starts[i]`` to
    ``starts[i] + wanted[i] - 1`` of the step's ``Tensor[total, vocab]`` logits."""

    wanted: tuple[int, ...]
    starts: tuple[int, ...]

    @classmethod
    def of(cls, wanted: Sequence[bool | int]) -> "LogitsLayout":
        counts = tuple(int(w) for w in wanted)
        starts, at = [], 0
        for n in counts:
            starts.append(at)
            at += n
        return cls(counts, tuple(starts))

    @classmethod
    def of_plan(cls, chunks: Sequence["ScheduledChunk"]) -> "LogitsLayout":
        """A plan's layout: a verification row wants all its tokens' logits, a chunk that reaches the end of its
        request's stream its last token's, a prefill chunk short of it none."""
        return cls.of([c.width if c.drafts else int(c.needs_logits) for c in chunks])

    @property
    def total(self) -> int:
        """Rows of the step's logits."""
        return sum(self.wanted)

    def token_indices(self, widths: Sequence[int]) -> list[int]:
        """Indices into the packed tokens (row after row, ``widths[i]`` tokens each) whose logits are computed,
        in the order of the logits' rows."""
        picked: list[int] = []
        end = 0
        for n, want in zip(widths, self.wanted):
            end += n
            picked.extend(range(end - want, end))
        return picked

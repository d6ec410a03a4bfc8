"""Prefix index: which cached sequence holds the state at the end of a given token prefix.

A sequence is recorded at block boundaries it reached with a snapshot of its recurrent state (PLE,
GDN) taken there; its QSA cells are shared by refcount when a new request forks it, and the groups
are rebuilt from them. Lookups compare the tokens themselves, not only their hashes, so a request
whose prefix differs by even one token never starts from another's state.

Entries are keyed by the hash of the whole prefix up to each boundary (as vLLM's block hashes are):
``key(b) = hash((key(b - 1), tokens of block b))``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Sequence

from ..state.handles import SeqHandle

__all__ = ["PrefixIndex", "PrefixHit"]


@dataclass(frozen=True)
class PrefixHit:
    seq: SeqHandle
    tokens: int          # the prefix length (a multiple of the block size)


class PrefixIndex:
    """Block-boundary entries of cached sequences.

    Args:
        block_size: prefix lengths are multiples of it.
    """

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"PrefixIndex: block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._entries: dict[int, list[tuple[SeqHandle, tuple[int, ...]]]] = collections.defaultdict(list)
        self._by_seq: dict[SeqHandle, list[int]] = collections.defaultdict(list)
        self._frontiers: dict[SeqHandle, tuple[int, ...]] = {}

    def _keys(self, tokens: Sequence[int], upto: int) -> list[int]:
        keys, key, b = [], 0, self.block_size
        for end in range(b, upto + 1, b):
            key = hash((key, tuple(tokens[end - b:end])))
            keys.append(key)
        return keys

    def record(self, seq: SeqHandle, tokens: Sequence[int]) -> None:
        """``seq`` holds, with a snapshot, the state right after ``tokens`` (a whole number of blocks)."""
        if not tokens or len(tokens) % self.block_size:
            raise ValueError(f"PrefixIndex.record: {len(tokens)} tokens is not a whole number of blocks")
        key = self._keys(tokens, len(tokens))[-1]
        prefix = tuple(tokens)
        bucket = self._entries[key]
        if not any(s == seq and t == prefix for s, t in bucket):
            bucket.append((seq, prefix))
            self._by_seq[seq].append(key)

    def record_frontier(self, seq: SeqHandle, tokens: Sequence[int]) -> None:
        """``seq`` (kept, no longer growing) holds the state right after ``tokens``, any length."""
        if tokens:
            self._frontiers[seq] = tuple(tokens)

    def lookup(self, prompt: Sequence[int], max_tokens: int,
               accept: Callable[[SeqHandle, int], bool] | None = None) -> PrefixHit | None:
        """The longest recorded prefix of ``prompt`` of at most ``max_tokens`` tokens, or None; with
        ``accept``, only hits ``(seq, length)`` it accepts (the engine's chunk-alignment rule).

        A hit at a kept sequence's frontier needs no rewind (``PrefixHit.tokens`` is then that
        sequence's whole length); a block-boundary hit needs a rewind to the boundary.
        """
        best: PrefixHit | None = None
        for seq, tokens in self._frontiers.items():
            n = len(tokens)
            if (n <= max_tokens and (best is None or n > best.tokens) and tuple(prompt[:n]) == tokens
                    and (accept is None or accept(seq, n))):
                best = PrefixHit(seq, n)
        keys = self._keys(prompt, min(max_tokens, len(prompt)))
        for i in range(len(keys) - 1, -1, -1):
            length = (i + 1) * self.block_size
            if best is not None and best.tokens >= length:
                break
            want = tuple(prompt[:length])
            for seq, tokens in self._entries.get(keys[i], ()):
                if tokens == want and (accept is None or accept(seq, length)):
                    return PrefixHit(seq, length)
        return best

    def frontier(self, seq: SeqHandle) -> int | None:
        tokens = self._frontiers.get(seq)
        return None if tokens is None else len(tokens)

    def drop(self, seq: SeqHandle) -> None:
        """Forget every entry of ``seq`` (it is being freed or rewound)."""
        self._frontiers.pop(seq, None)
        for key in self._by_seq.pop(seq, []):
            bucket = [(s, t) for s, t in self._entries.get(key, []) if s != seq]
            if bucket:
                self._entries[key] = bucket
            else:
                self._entries.pop(key, None)

    def sequences(self) -> list[SeqHandle]:
        return list(self._by_seq)

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

"""All-or-nothing commits across state holders.

A holder takes part by implementing three hooks. ``_txn_begin`` opens a staging area (changes made
inside the block go there, or the holder takes a snapshot before its first in-place change),
``_txn_commit`` publishes it and must not fail, ``_txn_rollback`` drops it so that the holder is
bitwise what it was before (``digest()`` unchanged).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..errors import HebrusError


class Transactional:
    """Mixin of the hooks ``transaction`` drives, with the bookkeeping every holder needs."""

    _txn_depth_owner: object | None = None

    @property
    def in_transaction(self) -> bool:
        return self._txn_depth_owner is not None

    def _txn_begin(self) -> None:
        raise NotImplementedError

    def _txn_commit(self) -> None:
        raise NotImplementedError

    def _txn_rollback(self) -> None:
        raise NotImplementedError


@contextlib.contextmanager
def transaction(*holders: Transactional) -> Iterator[tuple[Transactional, ...]]:
    """Group every change made inside the block, across all ``holders``, into one commit.

    If the block raises, every holder is rolled back to exactly its state before the block and the
    exception propagates. Holders may not already be inside another transaction.
    """
    unique: list[Transactional] = []
    for holder in holders:
        if not isinstance(holder, Transactional):
            raise HebrusError(f"transaction: {type(holder).__name__} is not a hebrus state holder")
        if holder.in_transaction:
            raise HebrusError(f"transaction: {type(holder).__name__} is already inside a transaction")
        if all(holder is not u for u in unique):
            unique.append(holder)
    token = object()
    begun: list[Transactional] = []
    try:
        for holder in unique:
            holder._txn_begin()
            holder._txn_depth_owner = token
            begun.append(holder)
        yield tuple(unique)
    except BaseException:
        for holder in reversed(begun):
            try:
                holder._txn_rollback()
            finally:
                holder._txn_depth_owner = None
        raise
    else:
        for holder in begun:
            try:
                holder._txn_commit()
            finally:
                holder._txn_depth_owner = None


@contextlib.contextmanager
def autocommit(holder: Transactional) -> Iterator[None]:
    """Run one operation as its own transaction unless the holder is already inside one."""
    if holder.in_transaction:
        yield
    else:
        with transaction(holder):
            yield

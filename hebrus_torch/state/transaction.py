"""All-or-nothing commits across state holders.

A holder takes part by implementing the hooks below. ``_txn_begin`` opens a staging area (changes
made inside the block go there, or into an undo log), ``_txn_prepare`` does the work of the commit
that can still fail (it may change state, undoably; allocations belong here), ``_txn_commit``
publishes and should not fail, ``_txn_finish`` drops what the holder kept to undo the block and must
not fail, ``_txn_rollback`` drops everything so that the holder is bitwise what it was before
(``digest()`` unchanged). ``_txn_savepoint`` / ``_txn_restore`` mark and return to a point inside an
open transaction: what makes each lifecycle operation atomic on its own inside a larger block.

A holder's commit stays undoable until its ``_txn_finish``: should one holder's ``_txn_commit``
raise all the same (a device error), leaving that holder as it was before its commit, every holder
of the block, those already committed included, is rolled back, every transaction ends and the
error propagates. Only when all have committed does any finish.
"""

from __future__ import annotations

import contextlib
import operator
from itertools import repeat
from typing import Any, Iterator

from ..errors import HebrusError


class Transactional:
    """Mixin of the hooks ``transaction`` drives, with the bookkeeping every holder needs."""

    _txn_depth_owner: object | None = None

    @property
    def in_transaction(self) -> bool:
        return self._txn_depth_owner is not None

    def _txn_members(self) -> tuple["Transactional", ...]:
        """Every holder a transaction over this one must include (a ModelCache: itself and its holders)."""
        return (self,)

    def _txn_begin(self) -> None:
        raise NotImplementedError

    def _txn_prepare(self) -> None:
        """The fallible part of a commit; a failure here rolls every holder of the block back."""

    def _txn_commit(self) -> None:
        raise NotImplementedError

    def _txn_finish(self) -> None:
        """After every holder of the block committed: drop what undoes this commit (must not fail). A
        holder that keeps nothing to undo its commit need not implement it (its commit is then final)."""

    def _txn_rollback(self) -> None:
        """Back to the state before the block; also after ``_txn_commit``, until ``_txn_finish``."""
        raise NotImplementedError

    def _txn_savepoint(self) -> Any:
        raise NotImplementedError

    def _txn_restore(self, savepoint: Any) -> None:
        raise NotImplementedError


@contextlib.contextmanager
def transaction(*holders: Transactional) -> Iterator[tuple[Transactional, ...]]:
    """Group every change made inside the block, across all ``holders``, into one commit.

    A ``ModelCache`` stands for itself and both its holders. If the block raises, or the commit
    of any holder cannot complete, every holder is rolled back to exactly its state before the
    block and the exception propagates. Holders may not already be inside another transaction.
    """
    unique: list[Transactional] = []
    for holder in holders:
        if not isinstance(holder, Transactional):
            raise HebrusError(f"transaction: {type(holder).__name__} is not a hebrus state holder")
        for member in holder._txn_members():
            if member.in_transaction:
                raise HebrusError(f"transaction: {type(member).__name__} is already inside a transaction")
            if not any(map(operator.is_, repeat(member), unique)):
                unique.append(member)
    token = object()
    begun: list[Transactional] = []
    try:
        for holder in unique:
            holder._txn_begin()
            holder._txn_depth_owner = token
            begun.append(holder)
        yield tuple(unique)
        for holder in begun:
            holder._txn_prepare()
    except BaseException:
        _roll_back(reversed(begun))
        raise
    try:
        for holder in begun:
            holder._txn_commit()
    except BaseException:
        # Not expected (the fallible work ran in _txn_prepare): undo every holder, committed ones too.
        _roll_back(reversed(begun))
        raise
    _end(begun, "_txn_finish")


def _distinct(members) -> list[Transactional]:
    """``members`` in order, each object once (by identity)."""
    out: list[Transactional] = []
    for m in members:
        if all(m is not u for u in out):
            out.append(m)
    return out


def _roll_back(holders) -> None:
    _end(holders, "_txn_rollback")


def _end(holders, hook: str) -> None:
    """Run ``hook`` of every holder and end its transaction, even when one raises (the first such error
    is re-raised after all, chained to any being handled)."""
    error: BaseException | None = None
    for holder in holders:
        try:
            getattr(holder, hook)()
        except BaseException as exc:  # noqa: BLE001 (the others must still end their transactions)
            error = error or exc
        finally:
            holder._txn_depth_owner = None
    if error is not None:
        raise error


@contextlib.contextmanager
def atomic(*holders: Transactional) -> Iterator[None]:
    """Run one operation atomically: as its own transaction over ``holders`` when none is open, else
    between savepoints of the open one (a failure undoes this operation only, and re-raises)."""
    # (Every holder operation inside a step's transaction passes here: the common case, one holder whose one
    # member is in the open transaction, reads each flag once and builds no list it does not use.)
    if len(holders) == 1:
        members = holders[0]._txn_members()
        if len(members) > 1:
            members = _distinct(members)
    else:
        members = _distinct(m for holder in holders for m in holder._txn_members())
    inside = [m.in_transaction for m in members]
    if not any(inside):
        with transaction(*members):
            yield
        return
    if not all(inside):
        outside = [type(m).__name__ for m, on in zip(members, inside) if not on]
        raise HebrusError(f"an operation over {', '.join(type(m).__name__ for m in members)} runs inside a "
                          f"transaction that does not include {', '.join(outside)}")
    savepoints = [(m, m._txn_savepoint()) for m in members]
    try:
        yield
    except BaseException:
        for m, sp in reversed(savepoints):
            m._txn_restore(sp)
        raise

"""Building blocks shared by the state holders: handles, transactions, saved-state blobs, and the one
state-dict protocol (:class:`StateDictProtocol`, see ``protocol.py`` for how a new holder uses it)."""

from .handles import SeqHandle, SlotTable
from .protocol import StateDictProtocol
from .transaction import Transactional, transaction

__all__ = ["SeqHandle", "SlotTable", "StateDictProtocol", "Transactional", "transaction"]

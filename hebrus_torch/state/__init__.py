"""Building blocks shared by the state holders: handles, transactions, saved-state blobs."""

from .handles import SeqHandle, SlotTable
from .transaction import Transactional, transaction

__all__ = ["SeqHandle", "SlotTable", "Transactional", "transaction"]

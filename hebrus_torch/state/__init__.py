"""Building blocks shared by the state holders: handles, transactions, saved-state blobs, the one
state-dict protocol (:class:`StateDictProtocol`, see ``protocol.py`` for how a new holder uses it) and
the slot-pool holder base of PLEState and GDNState (:class:`SlotPoolHolder`, ``slot_pool.py``)."""

from .handles import SeqHandle, SlotTable
from .protocol import StateDictProtocol
from .slot_pool import SlotPoolHolder
from .transaction import Transactional, transaction

__all__ = ["SeqHandle", "SlotPoolHolder", "SlotTable", "StateDictProtocol", "Transactional", "transaction"]

"""hebrus_torch: custom ops and state holders for the stateful sparse paths of Qwen4Exp.

``import hebrus_torch`` registers ``torch.ops.hebrus.{ple_ngram_ids, ple_conv, qsa_pool, qsa_select}``.
"""

from . import _extension
from . import errors
from .errors import (CapacityError, CorruptStateError, HebrusError, HoleError, NonSuccessorError,
                     StaleHandleError)
from .ple.ops import ple_conv, ple_ngram_ids
from .qsa.ops import qsa_pool, qsa_select
from .ple.state import PLEHashParams, PLESnapshot, PLEState
from .state import SeqHandle, transaction

__version__ = "0.1.0"

__all__ = [
    "errors", "HebrusError", "HoleError", "NonSuccessorError", "StaleHandleError", "CapacityError",
    "CorruptStateError", "ple_ngram_ids", "ple_conv", "qsa_pool", "qsa_select",
    "PLEState", "PLESnapshot", "PLEHashParams", "SeqHandle", "transaction",
]

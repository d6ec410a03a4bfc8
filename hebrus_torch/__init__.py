"""hebrus_torch: custom ops and state holders for the stateful sparse paths of Qwen4Exp.

``hebrus_torch.from_pretrained(path, ple_table=...)`` loads a Qwen4Exp checkpoint in place, its PLE n-gram table
optionally left on disk (``hebrus_torch.loading``, docs/ple.md; imported on first use, so that
``import hebrus_torch`` stays light).

``import hebrus_torch`` registers ``torch.ops.hebrus.{ple_ngram_ids, ple_conv, qsa_pool, qsa_select,
qsa_attention, moe_experts, moe_experts_quantized, quantized_linear, ...}``: C++ kernels on CPU, Metal kernels
on MPS (macOS builds), the pure-PyTorch reference everywhere else. ``hebrus_torch.engine`` runs continuous
batching on the state holders. ``python -m hebrus_torch.convert`` writes a quantized checkpoint
(docs/quantization.md).
"""

from . import _extension
from . import errors
from .errors import (CapacityError, CorruptStateError, DuplicateSequenceError, HebrusError, HoleError,
                     NonSuccessorError, StaleHandleError)
from .ple.ops import ple_conv, ple_ngram_ids
from .qsa.ops import qsa_pool, qsa_select
from .qsa.attention import qsa_attention
from .moe.ops import (moe_experts, moe_experts_quantized, moe_route, moe_shared_expert, moe_shared_expert_quantized,
                      quantized_linear)
from .hc.ops import hc_post_combine, hc_premix, hc_premix_quantized, hc_rms_norm
from .ple.state import PLEHashParams, PLESnapshot, PLEState
from .qsa.cache import QSACache, QSAPlan, ReservedChunk
from .state import SeqHandle, transaction
from .gdn import GDNSnapshot, GDNState
from .gdn.fused import gdn_gated_rms_norm, gdn_gates
from .model_cache import Batch, CacheSnapshot, ChunkStep, ModelCache

__version__ = "0.1.0"

__all__ = [
    "errors", "HebrusError", "HoleError", "NonSuccessorError", "StaleHandleError", "CapacityError",
    "CorruptStateError", "DuplicateSequenceError", "ple_ngram_ids", "ple_conv", "qsa_pool", "qsa_select", "qsa_attention",
    "moe_experts", "moe_experts_quantized", "quantized_linear", "hc_rms_norm", "hc_premix",
    "hc_premix_quantized", "hc_post_combine",
    "moe_route", "moe_shared_expert", "moe_shared_expert_quantized",
    "PLEState", "PLESnapshot", "PLEHashParams", "QSACache", "QSAPlan", "ReservedChunk", "SeqHandle",
    "transaction", "ModelCache", "Batch", "ChunkStep", "CacheSnapshot", "GDNState", "GDNSnapshot",
    "from_pretrained",
    "gdn_gates", "gdn_gated_rms_norm",
]


def __getattr__(name: str):
    if name == "from_pretrained":   # needs transformers: imported on first use only
        from .loading import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'hebrus_torch' has no attribute {name!r}")

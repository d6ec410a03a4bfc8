"""Loading a Qwen4Exp checkpoint in place (issue 35, docs/ple.md):

- ``files.py``: the index and each safetensors file's header, every tensor's byte range, checked up front;
- ``keymap.py``: checkpoint keys -> the text model's weights as transformers maps them (experts fused, the
  n-gram table's shards concatenated, ``mtp.*`` kept aside);
- ``model.py``: ``from_pretrained`` (meta model, weights copied tensor by tensor from memory maps, the PLE
  table in memory or left on disk behind :class:`hebrus_torch.ple.row_store.DiskNgramEmbedding`);
- ``errors.py``: :class:`CheckpointError`.
"""

from .errors import CheckpointError
from .model import PLE_TABLE_CHOICES, LoadedCheckpoint, choose_ple_table, from_pretrained

__all__ = ["from_pretrained", "CheckpointError", "LoadedCheckpoint", "PLE_TABLE_CHOICES", "choose_ple_table"]

"""Qwen4Exp's layer math on packed rows, by concern; what the engine's runner calls, and what the drop-in
(:mod:`hebrus_torch.integrations.qwen4_exp`) shares.

- :mod:`.forward`: :class:`PackedQwen4Exp` (the decoder layers over a ``ChunkStep``: hyper-connections, MoE),
  :func:`packed_decoder_layer` (one layer, its token mixer passed in; ``torch.compile``-clean), :func:`find_text_model`
- :mod:`.ple`: the PLE layer (n-gram gating, dilated conv through the step)
- :mod:`.gdn`: the gated-delta-net layer (its conv and delta rule through state operations)
- :mod:`.attention`: indexed attention and its indexer (projections shared with the drop-in)
- :mod:`.rope`: rotary cos/sin of packed positions, independent of the batch
"""

from .forward import PackedQwen4Exp, find_text_model

__all__ = ["PackedQwen4Exp", "find_text_model"]

"""Drop-in for Hugging Face transformers' Qwen4Exp: ``apply(model)`` / ``revert(model)``.

``apply`` patches, per module instance (the model classes are never touched):

- ``Qwen4ExpTextNGramEmbedding.forward``: the n-gram hash of every PLE layer becomes one
  ``hebrus_torch.ple_ngram_ids`` call over the packed batch; the cache bookkeeping (the n-gram
  context kept in conv state 2 and its EOS padding rule) and the embedding lookup are unchanged.
- ``Qwen4ExpTextPLELayer._short_conv``: the dilated depthwise conv becomes one
  ``hebrus_torch.ple_conv`` call; the cache still runs its own ``update_conv_state`` as the original
  does, so ``record_past``/``crop`` and every other cache semantic is transformers' own.
- ``Qwen4ExpTextQSAIndexer.forward``: queries and raw keys are computed by the same calls as the
  original; the per-query Python loop becomes one ``hebrus_torch.qsa_pool`` call over the groups not
  pooled yet and one ``hebrus_torch.qsa_select`` call for every query of the chunk. Pooled groups are
  kept on the cache layer between calls, so a decode step pools only the groups its new token
  completes.
- ``Qwen4ExpTextAttention.forward`` (``apply(model, sparse_attention=True)``, the default): where the
  selection is narrower than the cache (``budget + r - 1 < K``) the indexer hands over the selected kv
  indices of every query instead of the dense mask, and attention is one ``hebrus::qsa_attention`` call
  over all queries of the batch on the cache's K/V; projections, norms, rope, the cache update and the
  output gate are transformers' own. Queries that see nothing (left padding) get transformers' result
  for a fully masked row. ``output_attentions``, attention dropout in training, autograd (the op has no
  backward: run under ``torch.no_grad()``/``inference_mode()``, as ``generate`` does), an indexer
  fallback (a dense mask) and ``torch.compile`` take the original attention. Forward hooks on the indexer then
  receive a selection object instead of the mask: :func:`selection_mask` turns it into the mask.

A forward hook on the text model's ``rotary_emb`` captures the position ids the indexer needs to
rope pooled keys (``group_pos``). Where the hebrus path cannot reproduce transformers exactly
(multimodal 3-D positions that differ across the 3 rows, ``attention_scaling != 1``, an indexer
called outside its text model, positions that are not consecutive inside a group), that call runs
the original forward; ``stats()`` counts both paths. A hole inside a query's visible run (a masked
position between visible ones) of a query that must select (it sees more than ``budget + r - 1``
tokens) runs the original forward, counted and warned once (SPEC §7); ``apply(model, on_hole="raise")``
raises :class:`hebrus_torch.HoleError` instead. A query that sees at most ``budget + r - 1`` tokens
selects all of them, holes or not: it never fails and never falls back.

While any model is applied, the lifecycle methods of transformers' indexed cache layers (``reset``,
``crop``, ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``) are wrapped to
drop the kept groups first; ``revert`` of the last applied model restores them.

Under ``torch.compile`` the indexer takes a static-shape path (no host syncs, no kept groups; see
``_indexer_traceable``), so the patched model compiles with ``fullgraph=True``.

The implementation lives in :mod:`hebrus_torch.integrations.qwen4_exp`, one module per concern; this
module is its public face. transformers is imported lazily: importing this module does not need it.
"""

from __future__ import annotations

from .qwen4_exp.cache_layers import _GROUPS  # noqa: F401
from .qwen4_exp.common import _CTX, _PATCH  # noqa: F401
from .qwen4_exp.patching import apply, is_applied, revert
from .qwen4_exp.selection import selection_mask
from .qwen4_exp.stats import HebrusFallbackWarning, reset_stats, stats

__all__ = ["apply", "revert", "is_applied", "stats", "reset_stats", "selection_mask", "HebrusFallbackWarning"]
# _PATCH, _CTX, _GROUPS: the attribute names the drop-in stores on modules and cache layers (tests read them).

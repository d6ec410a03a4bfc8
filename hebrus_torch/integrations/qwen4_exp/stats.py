"""Counters of the patched paths (:func:`stats`) and the once-per-cause fallback warning (SPEC §7)."""

from __future__ import annotations

import collections
import warnings

_STATS: collections.Counter = collections.Counter()


class HebrusFallbackWarning(UserWarning):
    """A patched call ran transformers' own code because the hebrus ops cannot reproduce it (SPEC §7)."""


def stats() -> dict[str, int]:
    """Counters of the patched paths: ``qsa_hebrus``, ``qsa_fallback:<reason>``, ``qsa_groups_pooled``,
    ``qsa_queries_selected``, ``qsa_sync_free``, ``qsa_cuda_graph``, ``ple_ngram``, ``ple_conv``,
    ``ple_cuda_graph``, ``sparse_attention_calls``, ``sparse_attention_skipped:<reason>``, ``moe_experts_calls``,
    ``moe_experts_skipped:<reason>``."""
    return dict(_STATS)


def reset_stats() -> None:
    """Clear the counters of :func:`stats` (and re-arm the once-per-cause fallback warnings)."""
    _STATS.clear()
    _WARNED.clear()


_WARNED: set[str] = set()


_FALLBACK_WHY = {
    "qsa_fallback:hole": "a masked position inside the visible run of a query that selects (a hole in a 4-D mask)",
    "qsa_fallback:multimodal_positions": "the 3 rows of the position ids differ (multimodal positions)",
    "qsa_fallback:kernel_limits": "the indexer's sizes exceed the native kernels' limits",
    "qsa_fallback:attention_scaling": "the rotary embedding has attention_scaling != 1",
    "qsa_fallback:positions_not_consecutive": "positions inside a group are not consecutive",
    "qsa_fallback:no_text_model": "an indexer called outside its text model (no captured positions)",
    "qsa_fallback:mask_shape": "an indexer called without a 4-D attention mask",
    "qsa_fallback:positions_unknown": "position embeddings other than the ones the text model's rotary made",
    "qsa_fallback:position_shape": "position ids of an unexpected shape",
    "ple_fallback:token_outside_vocab": "token ids outside the PLE vocabulary",
    "ple_fallback:dtype": "a PLE conv in a dtype other than float32/float16/bfloat16",
    "ple_fallback:conv_not_plain": "a PLE conv with a bias, padding or stride",
}


def _warn_once(cause: str) -> None:
    """SPEC §7: a call the ops cannot reproduce runs transformers' own code, counted and warned once per cause."""
    if cause in _WARNED or cause not in _FALLBACK_WHY:
        return
    _WARNED.add(cause)
    warnings.warn(f"hebrus_torch.integrations.transformers: {_FALLBACK_WHY[cause]}: such calls run transformers' "
                  f"own code (counted in stats()[{cause!r}])", HebrusFallbackWarning, stacklevel=3)

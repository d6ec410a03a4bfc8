"""transformers' indexed cache layers: the pooled groups the indexer keeps on them, and the lifecycle
wrappers (installed while any model is applied) that drop those groups when the cache changes."""

from __future__ import annotations

from typing import Any

from .common import _MISSING

_GROUPS = "_hebrus_qsa_groups"       # per indexed cache layer: pooled groups kept between calls


_INVALIDATING = ("reset", "crop", "reorder_cache", "batch_repeat_interleave", "batch_select_indices")
_cache_class_patches: dict[type, dict[str, Any]] = {}
_epoch = 0                           # bumped whenever the cache-layer wrappers are (re)installed


def _install_cache_wrappers() -> None:
    """Wrap the lifecycle methods of the indexed cache layers so they drop the pooled groups."""
    global _epoch
    if _cache_class_patches:
        return
    from transformers import cache_utils

    _epoch += 1
    for cls_name in ("DynamicIndexedLayer", "StaticIndexedLayer"):
        cls = getattr(cache_utils, cls_name, None)
        if cls is None:
            continue
        saved = {}
        for name in _INVALIDATING:
            inherited = getattr(cls, name, None)
            if inherited is None:
                continue
            saved[name] = cls.__dict__.get(name, _MISSING)
            setattr(cls, name, _invalidating(inherited))
        _cache_class_patches[cls] = saved


def _remove_cache_wrappers() -> None:
    for cls, saved in _cache_class_patches.items():
        for name, original in saved.items():
            if original is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
    _cache_class_patches.clear()


def _invalidating(method):
    def wrapper(self, *args, **kwargs):
        self.__dict__.pop(_GROUPS, None)
        return method(self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__qualname__ = getattr(method, "__qualname__", method.__name__)
    wrapper.__doc__ = method.__doc__
    wrapper.__wrapped__ = method
    return wrapper

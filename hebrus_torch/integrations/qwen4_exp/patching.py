"""apply / revert: per-instance patches of the Qwen4Exp modules (the classes are never touched), the
rotary hooks, and validation before any change (SPEC §7)."""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch

from hebrus_torch.errors import HebrusError

from . import cache_layers
from .attention import _attention_forward
from .common import _CTX, _MISSING, _PATCH, _modeling
from .context import _Context
from .indexer import _indexer_forward
from .moe import _experts_forward
from .ple import _ngram_forward, _short_conv

_applied_models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def is_applied(model: torch.nn.Module) -> bool:
    return any(_PATCH in m.__dict__ for m in model.modules())


def apply(model: torch.nn.Module, *, on_hole: str = "fallback", sparse_attention: bool = True) -> torch.nn.Module:
    """Route a transformers Qwen4Exp model's QSA indexer and PLE through hebrus ops, in place.

    Args:
        model: any module containing transformers 5.23.0 Qwen4Exp text modules (``Qwen4ExpForCausalLM``,
            ``Qwen4ExpTextModel``, the multimodal model, or a single layer).
        on_hole: what a hole does (a masked position inside the visible run of a query that must select,
            i.e. sees more than ``budget + r - 1`` tokens; a query that sees fewer selects every visible
            token and never fails): ``"fallback"`` (default): that call runs transformers' own indexer,
            counted in :func:`stats` and warned once; ``"raise"``: :class:`hebrus_torch.HoleError`.
        sparse_attention: ``True`` (default): the indexed-attention layers attend with one
            ``hebrus::qsa_attention`` call over the selected tokens where the selection (at most
            ``budget + r - 1`` tokens per query) is narrower than the cache; ``False``: transformers'
            masked dense attention over the selection mask.

    Returns:
        ``model`` itself. Idempotent: applying twice patches once (``on_hole``, ``sparse_attention`` updated).
    """
    if on_hole not in ("raise", "fallback"):
        raise HebrusError(f"hebrus_torch.integrations.transformers.apply: on_hole must be 'raise' or 'fallback', "
                          f"got {on_hole!r}")
    m = _modeling()
    text_models = [mod for mod in model.modules() if isinstance(mod, m.Qwen4ExpTextModel)]
    # Validate everything before changing anything (SPEC §7): a refused model keeps no hook and no patch.
    for text_model in text_models:
        rot = 2 * text_model.rotary_emb.inv_freq.shape[0]
        for mod in text_model.modules():
            if isinstance(mod, m.Qwen4ExpTextQSAIndexer) and rot > mod.index_head_dim:
                raise HebrusError(f"hebrus_torch.integrations.transformers: rotary dims {rot} exceed the indexer "
                                  f"head dim {mod.index_head_dim} of layer {mod.layer_idx}")
    owner: dict[int, Any] = {}
    text_of: dict[int, Any] = {}
    for text_model in text_models:
        for mod in text_model.modules():
            text_of[id(mod)] = weakref.ref(text_model)
    for text_model in text_models:
        ctx = text_model.__dict__.get(_CTX)
        if ctx is None:
            ctx = _Context(text_model.rotary_emb)
            ctx.handles = [text_model.rotary_emb.register_forward_hook(ctx.capture_rope, with_kwargs=True),
                           text_model.register_forward_hook(ctx.end_of_forward)]
            text_model.__dict__[_CTX] = ctx
        for mod in text_model.modules():
            owner[id(mod)] = ctx
    for mod in model.modules():
        if isinstance(mod, m.Qwen4ExpTextQSAIndexer):
            # rope is resolved here: importing transformers' lazy modules inside traced code breaks dynamo
            _patch(mod, "forward", _indexer_forward, ctx=owner.get(id(mod)), on_hole=on_hole,
                   rope=m.apply_rotary_pos_emb)
        elif isinstance(mod, m.Qwen4ExpTextAttention):
            _patch(mod, "forward", _attention_forward, sparse=bool(sparse_attention), rope=m.apply_rotary_pos_emb,
                   interfaces=m.ALL_ATTENTION_FUNCTIONS, eager=m.eager_attention_forward)
        elif isinstance(mod, m.Qwen4ExpTextNGramEmbedding):
            _patch(mod, "forward", _ngram_forward, text_model=text_of.get(id(mod)))
        elif isinstance(mod, m.Qwen4ExpTextPLELayer):
            _patch(mod, "_short_conv", _short_conv)
        elif type(mod) is m.Qwen4ExpTextExperts:
            _patch(mod, "forward", _experts_forward)
    if is_applied(model):
        _applied_models.add(model)
        cache_layers._install_cache_wrappers()
        if text_models and hasattr(model, "init_continuous_batching") and hasattr(model, "lm_head"):
            # transformers' generate_batch / init_continuous_batching / serve --continuous-batching run
            # on the hebrus engine (transformers' own paged cache refuses Qwen4Exp's layer types).
            from ...engine import manager as cb_manager

            cb_manager.install(model)
    return model


def revert(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply`: restore every patched method exactly and remove the hooks. Idempotent."""
    for mod in model.modules():
        record = mod.__dict__.pop(_PATCH, None)
        if record is not None:
            for name, original in record["methods"].items():
                if original is _MISSING:
                    mod.__dict__.pop(name, None)
                else:
                    mod.__dict__[name] = original
        ctx = mod.__dict__.pop(_CTX, None)
        if ctx is not None:
            for handle in ctx.handles:
                handle.remove()
            ctx.clear()
    if "_hebrus_cb_installed" in model.__dict__:
        from ...engine import manager as cb_manager

        cb_manager.uninstall(model)
    if model in _applied_models:
        _applied_models.discard(model)
    if not any(is_applied(m) for m in list(_applied_models)):
        cache_layers._remove_cache_wrappers()
    return model


def _patch(mod: torch.nn.Module, name: str, impl, **extra) -> bool:
    record = mod.__dict__.get(_PATCH)
    if record is not None and name in record["methods"]:
        record.update(extra)
        return False
    if record is None:
        record = mod.__dict__[_PATCH] = {"methods": {}}
    record["methods"][name] = mod.__dict__.get(name, _MISSING)
    record[f"original_{name}"] = getattr(mod, name)
    record.update(extra)
    mod.__dict__[name] = types.MethodType(impl, mod)
    return True

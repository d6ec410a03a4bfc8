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

transformers is imported lazily: importing this module does not need it.
"""

from __future__ import annotations

import collections
import types
import warnings
import weakref
from typing import Any

import torch

import hebrus_torch
from hebrus_torch._extension import has_native_kernel
from hebrus_torch._validate import FLOAT_DTYPES
from hebrus_torch.errors import HebrusError, HoleError


class HebrusFallbackWarning(UserWarning):
    """A patched call ran transformers' own code because the hebrus ops cannot reproduce it (SPEC §7)."""

__all__ = ["apply", "revert", "is_applied", "stats", "reset_stats", "selection_mask", "random_model"]

_PATCH = "_hebrus_patch"             # per patched module: what to restore
_CTX = "_hebrus_ctx"                 # per text model: the shared call context
_GROUPS = "_hebrus_qsa_groups"       # per indexed cache layer: pooled groups kept between calls
_INVALIDATING = ("reset", "crop", "reorder_cache", "batch_repeat_interleave", "batch_select_indices")

_STATS: collections.Counter = collections.Counter()
_applied_models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_cache_class_patches: dict[type, dict[str, Any]] = {}
_epoch = 0                           # bumped whenever the cache-layer wrappers are (re)installed


def stats() -> dict[str, int]:
    """Counters of the patched paths: ``qsa_hebrus``, ``qsa_fallback:<reason>``, ``qsa_groups_pooled``,
    ``qsa_queries_selected``, ``ple_ngram``, ``ple_conv``, ``sparse_attention_calls``,
    ``sparse_attention_skipped:<reason>``."""
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
    "ple_fallback:token_outside_vocab": "token ids outside the PLE vocabulary",
}


def _warn_once(cause: str) -> None:
    """SPEC §7: a call the ops cannot reproduce runs transformers' own code, counted and warned once per cause."""
    if cause in _WARNED or cause not in _FALLBACK_WHY:
        return
    _WARNED.add(cause)
    warnings.warn(f"hebrus_torch.integrations.transformers: {_FALLBACK_WHY[cause]}: such calls run transformers' "
                  f"own code (counted in stats()[{cause!r}])", HebrusFallbackWarning, stacklevel=3)


def _modeling():
    try:
        from transformers.models.qwen4_exp import modeling_qwen4_exp
    except ImportError as exc:
        raise ImportError("hebrus_torch.integrations.transformers needs transformers with Qwen4Exp "
                          "(transformers==5.23.0: pip install -e .[hf])") from exc
    return modeling_qwen4_exp


def is_applied(model: torch.nn.Module) -> bool:
    return any(_PATCH in m.__dict__ for m in model.modules())


# ------------------------------------------------------------------------------------------------
# apply / revert


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
            _patch(mod, "forward", _ngram_forward)
        elif isinstance(mod, m.Qwen4ExpTextPLELayer):
            _patch(mod, "_short_conv", _short_conv)
    if is_applied(model):
        _applied_models.add(model)
        _install_cache_wrappers()
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
    if model in _applied_models:
        _applied_models.discard(model)
    if not any(is_applied(m) for m in list(_applied_models)):
        _remove_cache_wrappers()
    return model


class _Missing:
    """Marks a method that was not in the instance ``__dict__`` before :func:`apply`; one object, which a
    deep copy or a pickle of a patched model keeps (``revert`` tests it by identity)."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "_MISSING"

    def __repr__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()


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


# ------------------------------------------------------------------------------------------------
# PLE


def _ngram_forward(self, input_ids: torch.Tensor, past_key_values) -> torch.Tensor:
    """Qwen4ExpTextNGramEmbedding.forward with the hash as one hebrus::ple_ngram_ids call.

    Token ids outside ``[0, vocab_size)`` (embeddings resized past the config's vocabulary) are bad
    input to the op (SPEC §2); transformers hashes them anyway, so such a call runs its forward."""
    original = self.__dict__[_PATCH]["original_forward"]
    raw_ids = input_ids
    input_ids = input_ids.long()
    batch, length = input_ids.shape
    ctx_len = self.context_len
    cached_ctx = past_key_values.get_conv_state(self.layer_idx, state_idx=2) if past_key_values is not None else None
    if cached_ctx is not None:
        # The shift rule reads at most N-1 tokens back (record_past may keep more columns; a shorter
        # history reads as EOS, as transformers' shift does past the start).
        history = cached_ctx[:, -ctx_len:].clone()
        if history.shape[1] < ctx_len:
            history = torch.nn.functional.pad(history, (ctx_len - history.shape[1], 0), value=self.eos_token_id)
    else:
        history = input_ids.new_full((batch, ctx_len), self.eos_token_id)

    cu_seqlens = torch.arange(batch + 1, device=input_ids.device, dtype=torch.int32) * length
    args = (input_ids.reshape(-1), cu_seqlens, history, self.layer_multipliers, self.ngram_heads_vocab_sizes,
            self.ngram_heads_offsets, int(self.eos_token_id), int(self.unigram_vocab_size))
    if torch.compiler.is_compiling():
        row_ids, _ = hebrus_torch.ple_ngram_ids(*args)
    else:
        try:   # the op checks the ids anyway: no extra host sync to find the rare call that falls back
            row_ids, _ = hebrus_torch.ple_ngram_ids(*args)
        except HebrusError as exc:
            if "outside [0, vocab=" not in str(exc):
                raise
            _STATS["ple_fallback:token_outside_vocab"] += 1
            _warn_once("ple_fallback:token_outside_vocab")
            return original(raw_ids, past_key_values)      # the cache is untouched so far

    # Cache bookkeeping exactly as transformers does it.
    if past_key_values is not None:
        input_ids_to_cache = input_ids
        if cached_ctx is None and length < ctx_len:
            input_ids_to_cache = torch.nn.functional.pad(
                input_ids_to_cache, (ctx_len - length, 0), value=self.eos_token_id)
        past_key_values.update_conv_state(input_ids_to_cache, self.layer_idx, state_idx=2, conv_kernel_size=ctx_len)

    ngram_ids = row_ids.view(batch, length, -1)
    if not torch.compiler.is_compiling():
        _STATS["ple_ngram"] += 1
    execution_device = (
        self.ngram_embedding.weight.device if self.ngram_embedding.weight.device.type != "meta" else None
    )
    return self.ngram_embedding(ngram_ids.to(execution_device)).to(ngram_ids.device).flatten(-2)


def _plain_depthwise(conv: torch.nn.Conv1d) -> bool:
    """What hebrus::ple_conv computes: depthwise, no bias, no padding, stride 1 (checked at each call:
    a bias may be added after apply)."""
    return (conv.bias is None and conv.groups == conv.in_channels == conv.out_channels
            and conv.padding in ((0,), 0) and conv.stride == (1,) and conv.padding_mode == "zeros")


def _short_conv(self, hidden_states: torch.Tensor, past_key_values) -> torch.Tensor:
    """Qwen4ExpTextPLELayer._short_conv as one hebrus::ple_conv call; the cache updates itself as before.

    hebrus::ple_conv has no backward and takes fp32/fp16/bf16: where a gradient is wanted, or for
    another dtype, transformers' own conv runs."""
    original = self.__dict__[_PATCH]["original__short_conv"]
    if torch.is_grad_enabled() and (hidden_states.requires_grad or self.conv1d.weight.requires_grad):
        _STATS["ple_fallback:autograd"] += 1
        return original(hidden_states, past_key_values)
    if hidden_states.dtype not in FLOAT_DTYPES or self.conv1d.weight.dtype != hidden_states.dtype:
        _STATS["ple_fallback:dtype"] += 1
        return original(hidden_states, past_key_values)
    if not _plain_depthwise(self.conv1d):
        _STATS["ple_fallback:conv_not_plain"] += 1
        return original(hidden_states, past_key_values)
    batch, length, channels = hidden_states.shape
    state_len = self.short_conv_state_len
    state = None
    if past_key_values is not None:
        previous = past_key_values.get_conv_state(self.layer_idx, state_idx=1)
        if previous is not None:
            # [B, C, L'] -> the last L inputs as [B, L, C]; a copy, since the cache overwrites in place.
            # (record_past keeps L' > L columns, or fewer after a short prefill: zeros, as F.pad does.)
            previous = previous[..., -state_len:]
            if previous.shape[-1] < state_len:
                previous = torch.nn.functional.pad(previous, (state_len - previous.shape[-1], 0))
            state = previous.transpose(1, 2).contiguous().clone()
        past_key_values.update_conv_state(hidden_states.transpose(1, 2), self.layer_idx, state_idx=1,
                                          conv_kernel_size=state_len)
    if state is None:
        state = hidden_states.new_zeros((batch, state_len, channels))
    weight = self.conv1d.weight[:, 0, :].contiguous()
    cu_seqlens = torch.arange(batch + 1, device=hidden_states.device, dtype=torch.int32) * length
    y, _ = hebrus_torch.ple_conv(hidden_states.reshape(batch * length, channels), weight, cu_seqlens, state,
                                 int(self.conv1d.dilation[0]), "silu")
    if not torch.compiler.is_compiling():
        _STATS["ple_conv"] += 1
    return y.view(batch, length, channels)


# ------------------------------------------------------------------------------------------------
# QSA indexer


class _Context:
    """What the indexers of one text model share during a forward: positions, rope, the mask plan."""

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.handles: list = []
        self.clear()

    def clear(self) -> None:
        self.cos = None
        self.position_ids = None
        self.positions = None            # [B, K] int64 text positions, once verified
        self.positions_reason = ""       # why not, once found
        self.plan_key = None
        self.plan = None

    def capture_rope(self, module, args, kwargs, output) -> None:
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        self.clear()
        self.position_ids = position_ids
        self.cos = output[0] if isinstance(output, (tuple, list)) else None

    def end_of_forward(self, module, args, output) -> None:
        # Only the mask plan goes (it may be large). The captured rotary output and positions stay: gradient
        # checkpointing recomputes the decoder layers in backward with the same position embeddings (the
        # rotary module does not run again), and must take the same path to save the same tensors. They are
        # matched by identity, so a later forward (a new rotary call) never reads stale ones.
        self.plan_key = None
        self.plan = None

    def text_positions(self, full_cos: torch.Tensor) -> tuple[torch.Tensor | None, str]:
        """[B, K] positions behind ``full_cos``, or (None, reason) where the hebrus path does not apply."""
        if self.cos is None or not _same_tensor(full_cos, self.cos):
            return None, "positions_unknown"
        if float(getattr(self.rotary, "attention_scaling", 1.0)) != 1.0:
            return None, "attention_scaling"
        if self.positions is None and not self.positions_reason:
            pos = self.position_ids
            if pos is None or pos.dim() != 3 or pos.shape[0] != 3 or pos.shape[1:] != full_cos.shape[:2]:
                self.positions_reason = "position_shape"
            elif not bool((pos == pos[:1]).all()):                               # one host sync per forward
                self.positions_reason = "multimodal_positions"
            else:
                self.positions = pos[0].to(torch.int64)
        return self.positions, self.positions_reason


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``, or a view of the same memory with the same layout (reentrant checkpointing hands the
    recomputation detached copies of its inputs: other objects, the same data)."""
    if a is b:
        return True
    return (isinstance(a, torch.Tensor) and a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device.type != "meta" and a.data_ptr() == b.data_ptr())


class _KeysReplay:
    """Stands in for the cache when the original forward runs after our update_indexer already did."""

    def __init__(self, keys: torch.Tensor):
        self.keys = keys

    def update_indexer(self, indexer_key_states, layer_idx):
        return self.keys


class _Plan:
    """Per-mask analysis shared by every indexed layer of one forward (the mask object is shared)."""

    __slots__ = ("visible", "first", "n", "any_empty", "gaps", "trivial", "sel_idx", "f_q", "n_q", "ng_q",
                 "q_anchor", "anchors")


def _mask_plan(attention_mask: torch.Tensor, ratio: int, top_k: int, on_hole: str) -> _Plan | None:
    """Visible runs per query: contiguity check, and which queries need a selection (None: fall back)."""
    visible = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
    batch, length, kv = visible.shape
    vis8 = visible.to(torch.uint8)
    n = vis8.sum(-1, dtype=torch.int64)                                         # [B, T]
    first = vis8.argmax(-1)                                                     # first visible (0 if none)
    last = (kv - 1) - vis8.flip(-1).argmax(-1)
    ng = torch.div(n, ratio, rounding_mode="floor")
    need = ng > top_k
    gap = (n > 0) & (last - first + 1 != n)             # a masked position inside the visible run
    hole = gap & need           # where it matters: a query that sees every visible token cannot fail
    flags = torch.stack([hole.any(), need.any(), (n == 0).any(), gap.any()]).tolist()      # one host sync
    if flags[0]:
        if on_hole == "fallback":
            return None
        b, q = (int(v) for v in torch.nonzero(hole)[0])
        row = visible[b, q]
        f, l_ = int(first[b, q]), int(last[b, q])
        missing = torch.nonzero(~row[f:l_ + 1]).flatten()[:8] + f
        raise HoleError(
            f"hebrus_torch.integrations.transformers: batch row {b}, query {q}: visible key positions run from "
            f"{f} to {l_} but {missing.tolist()} inside that run are masked (a hole inside the visible run is not "
            f"padding; QSA groups need one contiguous run). Pass apply(model, on_hole='fallback') (the default) "
            f"to run transformers' own indexer for such masks.")
    plan = _Plan()
    plan.visible = visible
    plan.first, plan.n, plan.any_empty = first, n, bool(flags[2])
    plan.gaps = bool(flags[3])           # queries that select everything they see, through a gap
    plan.trivial = not flags[1]
    if plan.trivial:
        return plan
    sel_idx = torch.nonzero(need.reshape(-1)).flatten()                         # queries that must choose
    f_q = first.reshape(-1)[sel_idx]
    b_q = torch.div(sel_idx, length, rounding_mode="floor")
    key = b_q * kv + f_q
    uniq, inverse = torch.unique(key, return_inverse=True)
    need_groups = torch.zeros(uniq.shape[0], dtype=torch.int64, device=key.device)
    ng_q = ng.reshape(-1)[sel_idx]
    need_groups = need_groups.scatter_reduce(0, inverse, ng_q, reduce="amax", include_self=True)
    table = torch.stack([torch.div(uniq, kv, rounding_mode="floor"), uniq % kv, need_groups], 1).tolist()
    plan.sel_idx = sel_idx
    plan.f_q = f_q
    plan.n_q = n.reshape(-1)[sel_idx]
    plan.ng_q = ng_q
    plan.q_anchor = inverse
    plan.anchors = [tuple(row) for row in table]                                # (b, f, groups needed)
    return plan


class _Groups:
    """Pooled groups of one indexed cache layer, kept between calls (stored on the cache layer)."""

    __slots__ = ("epoch", "batch", "kv", "dtype", "device", "dim", "ratio", "rope", "slots", "have", "table",
                 "pooled", "used")


def _rope_key(inv_freq: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Which inverse frequencies groups were roped with: the tensor and its version. transformers'
    dynamic RoPE variants replace or rewrite ``inv_freq`` as the context grows, and groups pooled
    before must then be pooled again (no host sync: identity and the version counter)."""
    return inv_freq, inv_freq._version


def _fresh_groups(batch, kv, keys: torch.Tensor, ratio: int, rope: tuple[torch.Tensor, int]) -> _Groups:
    g = _Groups()
    g.epoch, g.batch, g.kv, g.ratio, g.rope = _epoch, batch, kv, ratio, rope
    g.dtype, g.device, g.dim = keys.dtype, keys.device, keys.shape[-1]
    g.slots = {}                     # (b, f) -> slot
    g.have = []                      # per slot: groups pooled
    g.table = torch.full((0, 0), -1, dtype=torch.int32, device=keys.device)   # [slots, capG] pooled row per group
    g.pooled = keys.new_empty((0, keys.shape[-1]))                               # [cap, D]
    g.used = 0
    return g


def _grow_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with room for ``rows`` rows (capacity doubles; contents kept)."""
    if rows <= t.shape[0]:
        return t
    out = t.new_empty((max(rows, 2 * t.shape[0]), *t.shape[1:]))
    out[:t.shape[0]] = t
    return out


def _grow_table(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The slot table with at least ``rows`` slots and ``cols`` groups per slot, new entries -1."""
    if rows <= t.shape[0] and cols <= t.shape[1]:
        return t
    new_cols = t.shape[1] if cols <= t.shape[1] else max(cols, 2 * t.shape[1])
    out = t.new_full((max(rows, t.shape[0]), new_cols), -1)
    out[:t.shape[0], :t.shape[1]] = t
    return out


def _reusable(state: _Groups | None, batch: int, kv: int, keys: torch.Tensor, ratio: int,
              rope: tuple[torch.Tensor, int]) -> bool:
    return (state is not None and state.epoch == _epoch and state.batch == batch and state.kv <= kv
            and state.dtype == keys.dtype and state.device == keys.device and state.dim == keys.shape[-1]
            and state.ratio == ratio and state.rope[0] is rope[0] and state.rope[1] == rope[1])


def _indexer_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                     past_key_values) -> torch.Tensor:
    """Qwen4ExpTextQSAIndexer.forward with one qsa_pool (new groups only) and one qsa_select per call."""
    record = self.__dict__[_PATCH]
    if torch.compiler.is_compiling():
        return _indexer_traceable(self, record, hidden_states, position_embeddings, attention_mask, past_key_values)
    return _indexer_impl(self, record, record["original_forward"], hidden_states, position_embeddings,
                         attention_mask, past_key_values)


def _queries_and_keys(self, hidden_states, position_embeddings, past_key_values):
    """q [B, T, Hq, D] (normed, roped) and the full raw keys [B, K, D]: the same calls as transformers."""
    full_cos, full_sin = position_embeddings
    batch_size, seq_length, _ = hidden_states.shape
    hidden_shape = (batch_size, seq_length, -1, self.index_head_dim)
    current_cos, current_sin = full_cos[:, -seq_length:, :], full_sin[:, -seq_length:, :]
    qk = self.index_qk_proj(hidden_states)
    q, token_k = torch.split(
        qk, [self.index_n_heads * self.index_head_dim, self.index_kv_heads * self.index_head_dim], dim=-1)
    q, raw_keys = q.reshape(*hidden_shape), token_k.reshape(*hidden_shape).squeeze(2)
    q = self.q_layernorm(q)
    q = self.__dict__[_PATCH]["rope"](q, cos=current_cos, sin=current_sin, unsqueeze_dim=2)
    if past_key_values is not None:
        raw_keys = past_key_values.update_indexer(raw_keys, self.layer_idx)
    return q, raw_keys


def _indexer_traceable(self, record, hidden_states, position_embeddings, attention_mask, past_key_values):
    """The same selection with static shapes, for torch.compile (fullgraph): no host syncs, no kept groups.

    Every row is anchored at the first visible position of its widest query and all ``K // r`` candidate
    groups of a row are pooled (those past the run point at r zero cells); the checks that eager mode
    raises as errors (holes, several anchors in one row, multimodal positions) are device-side asserts.
    """
    ctx: _Context | None = record.get("ctx")
    full_cos = position_embeddings[0]
    pos3 = ctx.position_ids if ctx is not None else None
    if (pos3 is None or attention_mask is None or attention_mask.dim() != 4 or pos3.dim() != 3
            or pos3.shape[0] != 3 or pos3.shape[1:] != full_cos.shape[:2]
            or float(getattr(ctx.rotary, "attention_scaling", 1.0)) != 1.0):
        return record["original_forward"](hidden_states, position_embeddings, attention_mask, past_key_values)
    torch._assert_async((pos3 == pos3[:1]).all(), "hebrus qsa: the 3 rows of the text position ids differ "
                        "(multimodal positions): run this call without torch.compile")
    positions = pos3[0].to(torch.int64)
    ratio, top_k = self.compress_ratio, self.block_topk
    q, raw_keys = _queries_and_keys(self, hidden_states, position_embeddings, past_key_values)
    batch, kv, dim = raw_keys.shape
    length = q.shape[1]
    device = raw_keys.device
    visible = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
    vis8 = visible.to(torch.uint8)
    n = vis8.sum(-1, dtype=torch.int64)                                          # [B, T]
    first = vis8.argmax(-1)
    last = (kv - 1) - vis8.flip(-1).argmax(-1)
    ng = torch.div(n, ratio, rounding_mode="floor")
    need = ng > top_k                    # queries that see at most budget + r - 1 tokens keep them all
    torch._assert_async(((n == 0) | (last - first + 1 == n) | ~need).all(),
                        "hebrus qsa: a masked position inside a query's visible run (a hole is not padding)")
    widest = n.argmax(-1, keepdim=True)
    f_row = first.gather(1, widest)                                              # [B, 1]
    n_row = n.gather(1, widest)
    torch._assert_async(((n == 0) | (first == f_row) | ~need).all(),
                        "hebrus qsa: queries of one batch row start their visible runs at different positions; "
                        "run this call without torch.compile")
    groups = kv // ratio
    members = torch.arange(ratio, device=device)
    g_idx = torch.arange(groups, device=device)
    starts = f_row + ratio * g_idx                                               # [B, G] kv index
    valid = starts + ratio <= f_row + n_row
    rows = torch.arange(batch, device=device)[:, None]
    start_cell = torch.where(valid, rows * kv + starts, batch * kv)              # invalid -> the zero cells
    # A static cache has kv = max_cache_len columns but positions only for the tokens seen so far; the
    # starts of valid groups lie among those.
    group_pos = torch.where(valid, positions.gather(1, starts.clamp(max=positions.shape[1] - 1)), 0)
    cells = start_cell[:, :, None] + members                                     # [B, G, r]
    cell_pos = torch.zeros(batch * kv + ratio, dtype=torch.int64, device=device)
    # RoPE at the group start, as transformers does: cells carry their group's start position + offset.
    cell_pos = cell_pos.scatter(0, cells.reshape(-1), (group_pos[:, :, None] + members).reshape(-1))
    keys = torch.cat([raw_keys.reshape(batch * kv, dim), raw_keys.new_zeros((ratio, dim))])
    pooled = hebrus_torch.qsa_pool(keys, cell_pos, cells.reshape(-1, ratio).to(torch.int32), group_pos.reshape(-1),
                                   self.k_layernorm.weight, float(self.k_layernorm.eps),
                                   ctx.rotary.inv_freq.to(torch.float32))
    seq_groups = torch.arange(batch * groups, device=device, dtype=torch.int32).view(batch, groups)
    q_row = torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(length)
    ng = ng.reshape(-1)
    selected = hebrus_torch.qsa_select(q.reshape(batch * length, q.shape[-2], q.shape[-1]), pooled, seq_groups,
                                       q_row, ng.to(torch.int32), top_k)
    f_q = f_row.expand(batch, length).reshape(-1)
    rows = _expand_rows(selected, f_q, n.reshape(-1), ng, ratio, kv).view(batch, length, kv)
    return torch.where(need[..., None], rows, visible).unsqueeze(1)


def _indexer_impl(self, record, original, hidden_states, position_embeddings, attention_mask, past_key_values):
    ctx: _Context | None = record.get("ctx")
    full_cos, full_sin = position_embeddings
    if ctx is None:
        return _fallback(original, "no_text_model", hidden_states, position_embeddings, attention_mask,
                         past_key_values)
    if attention_mask is None or attention_mask.dim() != 4:
        return _fallback(original, "mask_shape", hidden_states, position_embeddings, attention_mask, past_key_values)
    positions, reason = ctx.text_positions(full_cos)
    if positions is None:
        return _fallback(original, reason, hidden_states, position_embeddings, attention_mask, past_key_values)
    if _indexer_beyond_kernel_limits(self, hidden_states.device):
        return _fallback(original, "kernel_limits", hidden_states, position_embeddings, attention_mask,
                         past_key_values)

    ratio, top_k = self.compress_ratio, self.block_topk
    plan_key = (ratio, top_k, record["on_hole"])
    if ctx.plan_key is not None and ctx.plan_key[0] is attention_mask and ctx.plan_key[1:] == plan_key:
        plan = ctx.plan
    else:
        plan = _mask_plan(attention_mask, ratio, top_k, record["on_hole"])
        ctx.plan_key, ctx.plan = (attention_mask, *plan_key), plan
    if plan is None:
        return _fallback(original, "hole", hidden_states, position_embeddings, attention_mask, past_key_values)

    q, raw_keys = _queries_and_keys(self, hidden_states, position_embeddings, past_key_values)
    layer = None
    if past_key_values is not None:
        layers = getattr(past_key_values, "layers", None)
        layer = layers[self.layer_idx] if layers is not None and self.layer_idx < len(layers) else None

    # The index form lists [first, first + n) for queries that keep their whole run: with a gap there,
    # hand the attention the mask instead (it attends over it densely, as transformers does).
    as_indices = bool(record.get("as_indices")) and not plan.gaps
    if plan.trivial:                     # every query sees at most budget + r - 1 tokens: all are selected
        _STATS["qsa_hebrus"] += 1
        return _Selection(self, plan, None) if as_indices else plan.visible.unsqueeze(1)
    try:
        selected = _select(self, plan, q, raw_keys, positions, layer)
    except HoleError:
        # RoPE positions not consecutive inside a group (qsa_pool checks): transformers ropes at the group
        # start regardless, so run its forward on the keys already in the cache.
        return _fallback(original, "positions_not_consecutive", hidden_states, position_embeddings,
                         attention_mask, _KeysReplay(raw_keys))
    _STATS["qsa_hebrus"] += 1
    return _Selection(self, plan, selected) if as_indices else _expand(plan, selected, ratio)


# Sizes past which a device's native kernels refuse (csrc/cpu/qsa_kernels.cpp, mps_kernels/hebrus_launch.h)
# although transformers runs them: the drop-in falls back there instead of raising. The reference
# (devices with no native kernel) has no such limits.
_INDEXER_LIMITS = {"cpu": {"dim": 256, "heads": 64, "top_k": 4096}, "mps": {"top_k": 2048}}
_ATTENTION_HEAD_DIM_LIMITS = {"mps": 256}


def _indexer_beyond_kernel_limits(indexer, device: torch.device) -> bool:
    limits = _INDEXER_LIMITS.get(device.type)
    if limits is None or not has_native_kernel("qsa_select", device.type):
        return False
    sizes = {"dim": indexer.index_head_dim, "heads": indexer.index_n_heads, "top_k": indexer.block_topk}
    return any(sizes[name] > limit for name, limit in limits.items())


def _attention_beyond_kernel_limits(attention, device: torch.device) -> bool:
    limit = _ATTENTION_HEAD_DIM_LIMITS.get(device.type)
    return (limit is not None and attention.head_dim > limit
            and has_native_kernel("qsa_attention", device.type))


def _fallback(original, reason, *args):
    _STATS[f"qsa_fallback:{reason}"] += 1
    _warn_once(f"qsa_fallback:{reason}")
    return original(*args)


def _select(self, plan: _Plan, q: torch.Tensor, raw_keys: torch.Tensor, positions: torch.Tensor, layer):
    ratio, top_k = self.compress_ratio, self.block_topk
    batch, kv, dim = raw_keys.shape
    device = raw_keys.device
    if layer is not None and not _cache_class_patches:
        _install_cache_wrappers()        # e.g. a deep copy of a patched model outlived revert() of the original
    state = layer.__dict__.get(_GROUPS) if layer is not None else None
    rope = _rope_key(self.__dict__[_PATCH]["ctx"].rotary.inv_freq)
    if not _reusable(state, batch, kv, raw_keys, ratio, rope):
        state = _fresh_groups(batch, kv, raw_keys, ratio, rope)

    # Anchors of this call; slots of anchors no query uses any more are dropped (compaction).
    current = {(b, f): need for b, f, need in plan.anchors}
    if any(key not in current for key in state.slots):
        keep = [key for key in state.slots if key in current]
        old = state
        state = _fresh_groups(batch, kv, raw_keys, ratio, rope)
        if keep:
            old_slots = torch.tensor([old.slots[k] for k in keep], device=device)
            have = [old.have[old.slots[k]] for k in keep]
            width = max(have)
            rows = old.table[old_slots, :width]                                  # [K, width] old pooled rows
            valid = rows >= 0
            flat = rows[valid].long()
            state.pooled = old.pooled[flat]
            state.used = flat.numel()
            renum = torch.full_like(rows, -1)
            renum[valid] = torch.arange(state.used, device=device, dtype=torch.int32)
            state.table = renum
            state.slots = {k: i for i, k in enumerate(keep)}
            state.have = have
    for key in plan.anchors:
        if (key[0], key[1]) not in state.slots:
            state.slots[(key[0], key[1])] = len(state.have)
            state.have.append(0)

    # New groups: for every anchor, [have, need).
    slot_list, b_list, f_list, have_list, count_list = [], [], [], [], []
    for (b, f), need in current.items():
        slot = state.slots[(b, f)]
        slot_list.append(slot)
        b_list.append(b)
        f_list.append(f)
        have_list.append(state.have[slot])
        count_list.append(max(need - state.have[slot], 0))
    new_total = sum(count_list)
    max_need = max(max(current.values()), max(state.have) if state.have else 0)
    state.table = _grow_table(state.table, len(state.have), max_need)
    if new_total:
        small = torch.tensor([slot_list, b_list, f_list, have_list, count_list], dtype=torch.int64).to(device)
        slot_t, b_t, f_t, have_t, count_t = small
        a_of = torch.repeat_interleave(torch.arange(len(slot_list), device=device), count_t, output_size=new_total)
        first = torch.cumsum(count_t, 0) - count_t
        g = have_t[a_of] + torch.arange(new_total, device=device) - first[a_of]
        start = b_t[a_of] * kv + f_t[a_of] + ratio * g                          # flat cell of each group's start
        group_cells = (start[:, None] + torch.arange(ratio, device=device)).to(torch.int32)
        if positions.shape[1] == kv:
            cell_pos = positions.reshape(-1)
        else:                            # static caches: cells past the positions are never visible
            cell_pos = torch.full((batch, kv), -1, dtype=torch.int64, device=device)
            cell_pos[:, :positions.shape[1]] = positions
            cell_pos = cell_pos.reshape(-1)
        group_pos = cell_pos[start]
        inv_freq = _inv_freq(self)
        pooled = hebrus_torch.qsa_pool(raw_keys.reshape(batch * kv, dim), cell_pos, group_cells, group_pos,
                                       self.k_layernorm.weight, float(self.k_layernorm.eps), inv_freq)
        state.pooled = _grow_rows(state.pooled, state.used + new_total)
        state.pooled[state.used:state.used + new_total] = pooled
        rows = torch.arange(state.used, state.used + new_total, device=device, dtype=torch.int32)
        state.table[slot_t[a_of], g] = rows
        state.used += new_total
        for slot, count in zip(slot_list, count_list):
            state.have[slot] += count
        _STATS["qsa_groups_pooled"] += new_total
    state.kv = kv
    if layer is not None:
        layer.__dict__[_GROUPS] = state

    slot_of_anchor = torch.tensor(slot_list, dtype=torch.int64).to(device)
    q_row = slot_of_anchor[plan.q_anchor].to(torch.int32)
    q_sel = q.reshape(-1, q.shape[-2], q.shape[-1])[plan.sel_idx]
    seq_groups = state.table[:, :max_need]
    _STATS["qsa_queries_selected"] += int(plan.sel_idx.shape[0])
    return hebrus_torch.qsa_select(q_sel, state.pooled[:state.used], seq_groups, q_row,
                                   plan.ng_q.to(torch.int32), top_k)


def _inv_freq(indexer) -> torch.Tensor:
    ctx: _Context = indexer.__dict__[_PATCH]["ctx"]
    return ctx.rotary.inv_freq.to(torch.float32)


def _expand_rows(selected, f_q, n_q, ng_q, ratio: int, kv: int) -> torch.Tensor:
    """[Tq, K] bool: tokens of the selected groups plus the raw tail, per query."""
    device = selected.device
    groups = selected.long()                                                     # [Tq, k]
    members = torch.arange(ratio, device=device)
    tokens = f_q[:, None, None] + ratio * groups[:, :, None] + members           # [Tq, k, r]
    tokens = torch.where(groups[:, :, None] >= 0, tokens, kv).flatten(1)
    tail_len = n_q - ratio * ng_q
    tail_idx = torch.arange(ratio - 1, device=device)
    tail = f_q[:, None] + ratio * ng_q[:, None] + tail_idx
    tail = torch.where(tail_idx < tail_len[:, None], tail, kv)
    index = torch.cat([tokens, tail], dim=1)
    rows = torch.zeros((index.shape[0], kv + 1), dtype=torch.bool, device=device)
    return rows.scatter(1, index, True)[:, :kv]


def _expand(plan: _Plan, selected: torch.Tensor, ratio: int) -> torch.Tensor:
    """Choosing queries get their selected groups + raw tail; every other query keeps its whole visible run."""
    visible = plan.visible
    batch, length, kv = visible.shape
    out = torch.empty((batch, length, kv), dtype=torch.bool, device=visible.device)
    out.copy_(visible)
    out.view(batch * length, kv)[plan.sel_idx] = _expand_rows(selected, plan.f_q, plan.n_q, plan.ng_q, ratio, kv)
    return out.unsqueeze(1)


class _Selection:
    """What a patched indexer returns to the patched attention instead of the dense mask.

    ``token_idx`` [B, T, W] int32: the selected kv indices of every query (``W = budget + r - 1``, -1 padded):
    the selected groups plus the raw tail for queries that choose, the whole visible run for the others.
    ``empty`` [B, T] bool: queries that see no position at all (``any_empty``: whether there is one).
    ``mask()`` builds the boolean selection mask transformers' indexer returns, only when asked for
    (forward hooks on the indexer receive this object: :func:`selection_mask` turns it into that mask).
    """

    __slots__ = ("token_idx", "kv", "empty", "any_empty")

    def __init__(self, indexer, plan: _Plan, selected: torch.Tensor | None):
        ratio = indexer.compress_ratio
        width = indexer.token_budget + ratio - 1
        first, n = plan.first, plan.n                                            # [B, T]
        batch, length, kv = plan.visible.shape
        device = first.device
        offs = torch.arange(width, device=device)
        # Queries that do not choose see at most top_k * r + r - 1 <= W positions: their whole run.
        idx = torch.where(offs < n[..., None], first[..., None] + offs, -1)
        if selected is not None:
            groups = selected.long()                                             # [Q, k]
            members = torch.arange(ratio, device=device)
            f_q, ng_q = plan.f_q, plan.ng_q
            tokens = torch.where(groups[:, :, None] >= 0, f_q[:, None, None] + ratio * groups[:, :, None] + members,
                                 -1).flatten(1)
            tail_idx = torch.arange(ratio - 1, device=device)
            tail = torch.where(tail_idx < (plan.n_q - ratio * ng_q)[:, None],
                               f_q[:, None] + ratio * ng_q[:, None] + tail_idx, -1)
            rows = torch.cat([tokens, tail], dim=1)
            if rows.shape[1] < width:
                rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=-1)
            idx.view(batch * length, width)[plan.sel_idx] = rows
        self.token_idx = idx.to(torch.int32)
        self.kv = kv
        self.empty = n == 0
        self.any_empty = plan.any_empty

    def mask(self) -> torch.Tensor:
        """[B, 1, T, K] bool: the selection mask, as transformers' indexer builds it."""
        idx = self.token_idx.long()
        rows = torch.zeros((*idx.shape[:-1], self.kv + 1), dtype=torch.bool, device=idx.device)
        return rows.scatter(-1, torch.where(idx >= 0, idx, self.kv), True)[..., :self.kv].unsqueeze(1)


def selection_mask(indexer_output) -> torch.Tensor:
    """The boolean selection mask behind an indexer output (a mask already, or what the sparse path passes)."""
    return indexer_output.mask() if isinstance(indexer_output, _Selection) else indexer_output


# ------------------------------------------------------------------------------------------------
# Attention over the selection: hebrus::qsa_attention


def _attentions_requested(kwargs) -> bool:
    """Whether this forward must return attention weights (transformers records them from our output)."""
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
        collected = _active_collector.get()
    except (ImportError, LookupError):
        return False
    except Exception:                    # unknown transformers internals: be safe, take the original path
        return True
    return bool(collected) and "attentions" in collected


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                       past_key_values=None, **kwargs):
    """Qwen4ExpTextAttention.forward with one hebrus::qsa_attention call where the selection is sparser than
    the cache; everything else (projections, norms, rope, cache update, output gate) as transformers does it."""
    record = self.__dict__[_PATCH]
    original = record["original_forward"]
    indexer = self.indexer
    reason = None
    if torch.compiler.is_compiling():
        return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    if not record.get("sparse", True):
        reason = "off"
    elif _PATCH not in indexer.__dict__:
        reason = "indexer_not_patched"
    elif attention_mask is None or attention_mask.dim() != 4:
        reason = "mask_shape"
    elif attention_mask.shape[-1] <= indexer.token_budget + indexer.compress_ratio - 1:
        reason = "not_sparser"           # every query may select the whole cache: plain attention
    elif self.training and self.attention_dropout > 0:
        reason = "dropout"
    elif torch.is_grad_enabled() and (hidden_states.requires_grad or self.q_proj.weight.requires_grad):
        reason = "autograd"              # hebrus::qsa_attention has no backward
    elif _attentions_requested(kwargs):
        reason = "output_attentions"
    elif _attention_beyond_kernel_limits(self, hidden_states.device):
        reason = "kernel_limits"
    if reason is not None:
        _STATS[f"sparse_attention_skipped:{reason}"] += 1
        return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)

    ind_record = indexer.__dict__[_PATCH]
    ind_record["as_indices"] = True
    try:                                 # through the module call, so indexer hooks still see its output
        selection = indexer(hidden_states, position_embeddings, attention_mask, past_key_values)
    finally:
        ind_record["as_indices"] = False

    # From here on transformers' Qwen4ExpTextAttention.forward (5.23.0), line for line.
    position_embeddings = tuple(x[:, -hidden_states.shape[1]:, :] for x in position_embeddings)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = record["rope"](query_states, key_states, cos, sin)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    interface = record["interfaces"].get_interface(self.config._attn_implementation, record["eager"])

    batch = query_states.shape[0]
    kv = key_states.shape[-2]
    if not isinstance(selection, _Selection) or selection.kv != kv:
        # The indexer fell back to transformers' own (a dense mask), or a cache whose key count differs
        # from the mask's: masked dense attention, as the original.
        _STATS["sparse_attention_skipped:dense_mask"] += 1
        selected = selection_mask(selection)
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & selected
        else:
            attention_mask = attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)
        attn_output, attn_weights = interface(self, query_states, key_states, value_states, attention_mask,
                                              dropout=0.0 if not self.training else self.attention_dropout,
                                              scaling=self.scaling, **kwargs)
    else:
        # One call per batch row: the op reads cells-major K/V ([cells, Hkv, D]) through strides, and a
        # row of the cache ([Hkv, K, D]) transposed is such a view, so no K/V is copied (merging the
        # batch into the cells would copy the whole cache on every call once B > 1 and Hkv > 1).
        q = query_states.transpose(1, 2)                                         # [B, T, H, D]
        cells = selection.token_idx                                              # [B, T, W]
        if selection.any_empty:
            # Queries that see nothing (left-padding positions): give them one cell for the op, then take
            # transformers' own result for them below (a fully masked row: eager averages, sdpa as torch does).
            cells = cells.clone()
            cells[..., 0] = torch.where(selection.empty, 0, cells[..., 0])
        attn_output = torch.stack([
            hebrus_torch.qsa_attention(q[b], key_states[b].transpose(0, 1), value_states[b].transpose(0, 1),
                                       cells[b], self.scaling)
            for b in range(batch)])                                              # [B, T, H, Dv]
        if selection.any_empty:
            rows = torch.nonzero(selection.empty.any(0)).flatten()              # query positions with an empty row
            if attention_mask.dtype == torch.bool:
                masked = attention_mask.new_zeros((batch, 1, rows.numel(), kv))
            else:
                masked = attention_mask.new_full((batch, 1, rows.numel(), kv), torch.finfo(attention_mask.dtype).min)
            dense, _ = interface(self, query_states[:, :, rows], key_states, value_states, masked, dropout=0.0,
                                 scaling=self.scaling, **kwargs)                 # [B, n, H, Dv]
            keep = selection.empty[:, rows][..., None, None]
            attn_output[:, rows] = torch.where(keep, dense.to(attn_output.dtype), attn_output[:, rows])
        attn_weights = None
        _STATS["sparse_attention_calls"] += 1

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = attn_output * torch.sigmoid(gate)
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


# ------------------------------------------------------------------------------------------------
# A random-weight model for tests, benchmarks and the demo


def random_model(seed: int = 0, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attn_implementation: str = "eager", positive_index_scores: bool = True, conv_std: float = 0.3,
                 embed_shift: float = 8.0, index_shift: float = 3.0, **overrides):
    """A small random-weight ``Qwen4ExpForCausalLM`` (transformers 5.23.0) in eval mode.

    Defaults: 4 layers (linear, indexed, linear, indexed), PLE on decoder layers 0 and 2 (the config's
    1-based ``ple_layer_ids`` [1, 3]), indexer budget 8 with compress ratio 4 (top 2 groups), so
    prompts of a few dozen tokens already select sparsely. The PLE
    conv weights, zero-initialised by transformers, are randomised.

    ``positive_index_scores``: with random weights many indexer scores ``sum_h relu(q_h . k)`` are
    exactly 0, and transformers' ``torch.topk`` breaks such ties in an unspecified order while hebrus
    picks the lower group index (SPEC §3). A shared direction added to every token embedding
    (``embed_shift`` x the mean row norm) and read by the indexer's un-roped dims (``index_shift`` x the
    mean row norm of ``index_qk_proj``) keeps scores positive and distinct, so both pick the same groups.
    ``conv_std``: standard deviation of the randomised PLE conv weights. ``overrides``: config fields.
    """
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    m = _modeling()
    kwargs = dict(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention"] * 2, ple_layer_ids=[1, 3],
        ple_embed_dim=32, eos_token_id=3, pad_token_id=0, bos_token_id=1, hc_count=2, hc_lowrank=8,
        ngram_vocab_size_base=1000, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32,
        indexer_budget=8, indexer_compress_ratio=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, max_position_embeddings=65536,
    )
    kwargs.update(overrides)
    config = Qwen4ExpTextConfig(**kwargs)
    config._attn_implementation = attn_implementation
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = m.Qwen4ExpForCausalLM(config)
    model.eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, m.Qwen4ExpTextPLELayer):
                mod.conv1d.weight.copy_(torch.randn(mod.conv1d.weight.shape, generator=gen) * conv_std)
        if positive_index_scores:
            embed = model.model.embed_tokens.weight
            direction = torch.randn(config.hidden_size, generator=gen)
            direction /= direction.norm()
            embed.add_(direction * embed_shift * embed.norm(dim=1).mean())
            rotary = 2 * model.model.rotary_emb.inv_freq.shape[0]
            for mod in model.modules():
                if isinstance(mod, m.Qwen4ExpTextQSAIndexer):
                    dim, weight = mod.index_head_dim, mod.index_qk_proj.weight
                    scale = index_shift * weight.norm(dim=1).mean()
                    for head in range(mod.index_n_heads + mod.index_kv_heads):
                        weight[head * dim + rotary:(head + 1) * dim] += scale * direction
    return model.to(device=device, dtype=dtype)

"""Qwen4ExpTextQSAIndexer.forward on hebrus ops: eager (kept groups, one pool + one select per call) and a
static-shape path for torch.compile; every call the ops cannot reproduce runs transformers' own forward."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

import hebrus_torch
from hebrus_torch import _limits, reference
from hebrus_torch._extension import has_native_kernel
from hebrus_torch.errors import HoleError
from hebrus_torch.models.qwen4_exp.attention import index_queries_and_keys
from hebrus_torch.qsa import runs

from . import cuda_graphs
from .common import _PATCH
from .context import _Context
from .groups import _select
from .plan import _mask_plan
from .selection import _expand, _expand_rows, _Selection
from .stats import _STATS, _warn_once

class _KeysReplay:
    """Stands in for the cache when the original forward runs after our update_indexer already did."""

    def __init__(self, keys: torch.Tensor):
        self.keys = keys

    def update_indexer(self, indexer_key_states, layer_idx):
        return self.keys


def _indexer_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                     past_key_values) -> torch.Tensor:
    """Qwen4ExpTextQSAIndexer.forward with one qsa_pool (new groups only) and one qsa_select per call."""
    record = self.__dict__[_PATCH]
    if torch.compiler.is_compiling():
        return _indexer_traceable(self, record, hidden_states, position_embeddings, attention_mask, past_key_values)
    return _indexer_impl(self, record, record["original_forward"], hidden_states, position_embeddings,
                         attention_mask, past_key_values)


def _queries_and_keys(self, hidden_states, position_embeddings, past_key_values):
    """q [B, T, Hq, D] (normed, roped) and the full raw keys [B, K, D]: the same calls as transformers
    (:func:`hebrus_torch.models.qwen4_exp.attention.index_queries_and_keys`, then the cache's update)."""
    full_cos, full_sin = position_embeddings
    seq_length = hidden_states.shape[1]
    q, raw_keys = index_queries_and_keys(self, hidden_states, full_cos[:, -seq_length:, :],
                                         full_sin[:, -seq_length:, :], self.__dict__[_PATCH]["rope"])
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
    if _sync_free(hidden_states.device, attention_mask.shape[0], hidden_states.shape[1], attention_mask.shape[-1],
                  self.index_head_dim) and not _indexer_beyond_kernel_limits(self, hidden_states.device):
        return _indexer_sync_free(self, record, hidden_states, position_embeddings, attention_mask, past_key_values)
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


# Decode on devices whose ops check values on the device (CUDA, SPEC §4 "Errors on GPUs"): the selection
# of a call with few queries runs with static shapes and never reads the device on the host (SPEC §6: no
# host synchronization inside a decode step; issue 19). Bounds: queries per call, and B*T*K*D (the keys
# gathered for every candidate group of every query).
SYNC_FREE_MAX_QUERIES = 16
SYNC_FREE_MAX_ELEMENTS = 1 << 27


def _sync_free(device: torch.device, batch: int, length: int, kv: int, dim: int) -> bool:
    """Whether a call takes :func:`_indexer_sync_free` (host-known sizes only)."""
    return (reference.checks_async(device) and 0 < length <= SYNC_FREE_MAX_QUERIES and kv > 0
            and batch * length * kv * dim <= SYNC_FREE_MAX_ELEMENTS)


def _indexer_sync_free(self, record, hidden_states, position_embeddings, attention_mask, past_key_values):
    """transformers' selection for every query of a short call, on the device, with no host read.

    The projections as transformers runs them, then :func:`_sync_free_selection`; on CUDA, when the
    selection becomes the mask, that runs as a captured CUDA graph (:mod:`.cuda_graphs`: one replay
    instead of some 150 launches, the same bits). With on_hole="raise" a hole inside a choosing
    query's visible run is a device-side assert (SPEC §4). The pooled groups kept on the cache layer
    are not used.
    """
    ratio, top_k = self.compress_ratio, self.block_topk
    q, raw_keys = _queries_and_keys(self, hidden_states, position_embeddings, past_key_values)
    batch, kv, dim = raw_keys.shape
    length = q.shape[1]
    device = raw_keys.device
    mask = attention_mask[:, 0]
    if mask.shape != (batch, length, kv):        # a mask over other keys than the cache's: the general path
        return _fallback(record["original_forward"], "mask_shape", hidden_states, position_embeddings,
                         attention_mask, _KeysReplay(raw_keys))
    spec = SyncFreeSpec(ratio, top_k, self.token_budget + ratio - 1, float(self.k_layernorm.eps),
                        record["on_hole"] == "raise", record["rope"])
    full_cos, full_sin = position_embeddings
    args = (q, raw_keys, mask, full_cos, full_sin, self.k_layernorm.weight)
    _STATS["qsa_hebrus"] += 1
    _STATS["qsa_sync_free"] += 1
    if kv // ratio > top_k:              # some query may choose (which of them do: on the device)
        _STATS["qsa_queries_selected"] += batch * length
    # Where qsa_attention has no native kernel (its reference: some twenty kernels, and transformers' own
    # attention again for the queries that may see nothing), a few queries attend faster densely over the
    # selection mask, as transformers does: the mask then goes to the patched attention.
    if record.get("as_indices") and has_native_kernel("qsa_attention", device.type):
        token_idx, empty = _sync_free_selection(spec, *args)
        return _Selection.from_indices(token_idx, kv, empty)
    if (cuda_graphs.usable(*args) and (mask.dtype == torch.bool or mask.dtype.is_floating_point)
            and full_cos.shape[:2] == raw_keys.shape[:2] and full_sin.shape == full_cos.shape):
        return cuda_graphs.replay(sync_free_mask, spec, args, _key_padding(kv, mask.dtype),
                                  view=lambda out: out[..., :kv], counter="qsa_cuda_graph")
    return sync_free_mask(spec, *args)


def _key_padding(kv: int, mask_dtype: torch.dtype) -> tuple:
    """How :func:`sync_free_mask`'s inputs are padded for a CUDA graph: the key dimension of raw_keys, mask,
    full_cos and full_sin to a bucket, the padded mask columns masked out."""
    size = cuda_graphs.padded_keys(kv)
    keys = cuda_graphs.Pad(1, size)
    return None, keys, cuda_graphs.Pad(2, size, cuda_graphs.mask_fill(mask_dtype)), keys, keys, None


class SyncFreeSpec(NamedTuple):
    """The host-known parameters of :func:`_sync_free_selection` (what a captured graph is keyed by)."""
    ratio: int
    top_k: int
    width: int                           # budget + r - 1: the most kv indices a query attends
    eps: float                           # k_layernorm's
    raise_on_hole: bool
    rope: Callable                       # transformers' apply_rotary_pos_emb


def _sync_free_selection(spec: SyncFreeSpec, q, raw_keys, mask, full_cos, full_sin, norm_weight):
    """The selection of every query, a function of tensors only (no host read, no host-side state).

    Args:
        q: [B, T, Hq, D] normed, roped queries; raw_keys: [B, K, D]; mask: [B, T, K] bool (True: visible)
        or float (0: visible); full_cos, full_sin: [B, >=1, R] at every key position; norm_weight: [D].

    Returns:
        token_idx [B, T, W] int32 (kv indices each query attends, -1 padded) and empty [B, T] bool.

    Each query's visible kv indices are compacted in order (a scatter by their rank), and its groups are
    r consecutive entries of that list, roped at the cos/sin of their first entry: transformers' own
    rule, whatever the mask (padding, holes, several runs) and the positions (multimodal, scaled rope),
    so no call needs its fallback. Every candidate group of every query is pooled (hebrus::qsa_pool,
    unroped; the rope as transformers applies it) and scored (hebrus::qsa_select); a query that sees at
    most budget + r - 1 tokens keeps them all.
    """
    ratio, top_k, width = spec.ratio, spec.top_k, spec.width
    batch, kv, dim = raw_keys.shape
    length = q.shape[1]
    device = raw_keys.device
    visible = mask if mask.dtype == torch.bool else mask == 0
    bt = batch * length
    vis = visible.reshape(bt, kv)
    rank = torch.cumsum(vis, dim=1)                                          # [BT, K], 1-based
    n = rank[:, -1]
    ng = torch.div(n, ratio, rounding_mode="floor")
    need = ng > top_k
    if spec.raise_on_hole:
        vis8 = vis.to(torch.uint8)
        first = vis8.argmax(-1)
        last = (kv - 1) - vis8.flip(-1).argmax(-1)
        torch._assert_async(((last - first + 1 == n) | (n == 0) | ~need).all(),
                            "hebrus_torch.integrations.transformers: a masked key position inside a choosing "
                            "query's visible run (a hole is not padding; on_hole='raise')")
    # lst[q, j]: kv index of the j-th visible key of query q, -1 past its n.
    lst = torch.full((bt, kv + 1), -1, dtype=torch.int64, device=device)
    lst.scatter_(1, torch.where(vis, rank - 1, kv), torch.arange(kv, device=device).expand(bt, kv))
    lst = lst[:, :kv]
    whole = lst[:, :width] if kv >= width else torch.nn.functional.pad(lst, (0, width - kv), value=-1)
    groups = kv // ratio
    if groups > top_k:                   # some query may choose (host-known sizes only)
        cells = lst[:, :groups * ratio].view(bt, groups, ratio)
        q_b = torch.arange(bt, device=device) // length                      # batch row of each query
        flat = (q_b[:, None, None] * kv + cells.clamp(min=0)).reshape(-1)
        keys = raw_keys.reshape(batch * kv, dim).index_select(0, flat)       # [BT*G*r, D], group-major
        count = bt * groups
        group_cells = torch.arange(count * ratio, device=device, dtype=torch.int32).view(count, ratio)
        cell_pos = torch.arange(ratio, device=device).repeat(count)          # each group a run from 0
        group_pos = torch.zeros(count, dtype=torch.int64, device=device)
        pooled = hebrus_torch.qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, spec.eps,
                                       _no_rope(device))
        starts = cells[:, :, 0].clamp(0, full_cos.shape[1] - 1)              # [BT, G] kv index of each start
        rows = q_b[:, None].expand(bt, groups)
        cos, sin = full_cos[rows, starts].flatten(0, 1), full_sin[rows, starts].flatten(0, 1)
        pooled = spec.rope(pooled.unsqueeze(1), cos=cos, sin=sin).squeeze(1)
        seq_groups = torch.arange(count, device=device, dtype=torch.int32).view(bt, groups)
        q_row = torch.arange(bt, device=device, dtype=torch.int32)
        selected = hebrus_torch.qsa_select(q.reshape(bt, q.shape[-2], q.shape[-1]), pooled, seq_groups, q_row,
                                           ng.to(torch.int32), top_k).long()  # [BT, top_k] ascending, -1 padded
        # Offsets into each query's list of visible keys: its groups' entries, then its raw tail (SPEC §3).
        offs = runs.group_and_tail_offsets(selected, ng, n, ratio)
        chosen = torch.where(offs >= 0, lst.gather(1, offs.clamp(0, kv - 1)), -1)
        whole = torch.where(need[:, None], chosen, whole)
    return whole.to(torch.int32).view(batch, length, width), (n == 0).view(batch, length)


def sync_free_mask(spec: SyncFreeSpec, q, raw_keys, mask, full_cos, full_sin, norm_weight) -> torch.Tensor:
    """[B, 1, T, K] bool: the selection mask of :func:`_sync_free_selection` (what transformers' indexer
    returns)."""
    token_idx, empty = _sync_free_selection(spec, q, raw_keys, mask, full_cos, full_sin, norm_weight)
    return _Selection.from_indices(token_idx, raw_keys.shape[1], empty).mask()


_NO_ROPE: dict = {}


def _no_rope(device: torch.device) -> torch.Tensor:
    """The empty inv_freq (qsa_pool without rotary dims), one per device."""
    t = _NO_ROPE.get(device)
    if t is None:
        t = _NO_ROPE[device] = torch.empty(0, dtype=torch.float32, device=device)
    return t


def _indexer_beyond_kernel_limits(indexer, device: torch.device) -> bool:
    """Sizes past which the device's native qsa_select refuses although transformers runs them
    (hebrus_torch._limits): the drop-in falls back there instead of raising. The reference has no limits."""
    limits = _limits.INDEXER_LIMITS.get(device.type)
    if limits is None or not has_native_kernel("qsa_select", device.type):
        return False
    sizes = {"dim": indexer.index_head_dim, "heads": indexer.index_n_heads, "top_k": indexer.block_topk}
    return any(sizes[name] > limit for name, limit in limits.items())


def _fallback(original, reason, *args):
    _STATS[f"qsa_fallback:{reason}"] += 1
    _warn_once(f"qsa_fallback:{reason}")
    return original(*args)

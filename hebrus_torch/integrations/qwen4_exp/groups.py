"""Pooled groups kept on the indexed cache layer between calls, pooled once (hebrus::qsa_pool) and scored
for every selecting query of a call at once (hebrus::qsa_select)."""

from __future__ import annotations

import torch

import hebrus_torch
from hebrus_torch.errors import HoleError

from . import cache_layers
from .common import _PATCH
from .context import _Context
from .plan import _Plan
from .stats import _STATS

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
    g.epoch, g.batch, g.kv, g.ratio, g.rope = cache_layers._epoch, batch, kv, ratio, rope
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
    return (state is not None and state.epoch == cache_layers._epoch and state.batch == batch and state.kv <= kv
            and state.dtype == keys.dtype and state.device == keys.device and state.dim == keys.shape[-1]
            and state.ratio == ratio and state.rope[0] is rope[0] and state.rope[1] == rope[1])


def _select(self, plan: _Plan, q: torch.Tensor, raw_keys: torch.Tensor, positions: torch.Tensor, layer):
    ratio, top_k = self.compress_ratio, self.block_topk
    batch, kv, dim = raw_keys.shape
    device = raw_keys.device
    if layer is not None and not cache_layers._cache_class_patches:
        # e.g. a deep copy of a patched model outlived revert() of the original
        cache_layers._install_cache_wrappers()
    state = layer.__dict__.get(cache_layers._GROUPS) if layer is not None else None
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
        if device.type != "cpu":
            _check_consecutive(cell_pos, group_cells, group_pos)
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
        layer.__dict__[cache_layers._GROUPS] = state

    slot_of_anchor = torch.tensor(slot_list, dtype=torch.int64).to(device)
    q_row = slot_of_anchor[plan.q_anchor].to(torch.int32)
    q_sel = q.reshape(-1, q.shape[-2], q.shape[-1])[plan.sel_idx]
    seq_groups = state.table[:, :max_need]
    _STATS["qsa_queries_selected"] += int(plan.sel_idx.shape[0])
    return hebrus_torch.qsa_select(q_sel, state.pooled[:state.used], seq_groups, q_row,
                                   plan.ng_q.to(torch.int32), top_k)


def _check_consecutive(cell_pos: torch.Tensor, group_cells: torch.Tensor, group_pos: torch.Tensor) -> None:
    """qsa_pool's value check, on the host, where the device reports it asynchronously (SPEC §4): a device-side
    assert on CUDA would leave the device unusable for the rest of the process, and an MPS error would surface
    at a later synchronization, where the caller can no longer fall back. (This path reads the mask on the
    host already; on CPU the kernel itself raises before the call returns.)"""
    offsets = cell_pos[group_cells.long()] - group_pos[:, None]
    steps = torch.arange(group_cells.shape[1], device=offsets.device)
    if not bool((offsets == steps).all()):
        raise HoleError("qsa_pool: the cells of a group do not hold consecutive positions from the group's "
                        "first position (a hole in the RoPE positions)")


def _inv_freq(indexer) -> torch.Tensor:
    ctx: _Context = indexer.__dict__[_PATCH]["ctx"]
    return ctx.rotary.inv_freq.to(torch.float32)

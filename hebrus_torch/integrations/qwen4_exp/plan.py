"""The mask plan: each query's visible run from the 4-D mask, holes, and which queries must select."""

from __future__ import annotations

import torch

from hebrus_torch.errors import HoleError

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

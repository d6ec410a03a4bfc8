"""What a selection becomes: the boolean mask transformers' indexer returns, or the per-query kv indices
the patched attention reads (:class:`_Selection`)."""

from __future__ import annotations

import torch

from .plan import _Plan

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

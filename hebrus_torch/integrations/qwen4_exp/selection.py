"""What a selection becomes: the boolean mask transformers' indexer returns, or the per-query kv indices
the patched attention reads (:class:`_Selection`)."""

from __future__ import annotations

import torch

from hebrus_torch.qsa import runs

from .plan import _Plan


def _selected_tokens(selected, f_q, n_q, ng_q, ratio: int) -> torch.Tensor:
    """[Tq, top_k * r + r - 1] int64: the kv indices each choosing query attends (its selected groups' tokens in
    ascending order, then its raw tail; -1 padded), its run starting at kv index ``f_q`` (SPEC §3's "groups +
    raw tail", written once in :func:`hebrus_torch.qsa.runs.group_and_tail_offsets`)."""
    offsets = runs.group_and_tail_offsets(selected.long(), ng_q, n_q, ratio)
    return torch.where(offsets >= 0, f_q[:, None] + offsets, -1)


def _expand_rows(selected, f_q, n_q, ng_q, ratio: int, kv: int) -> torch.Tensor:
    """[Tq, K] bool: tokens of the selected groups plus the raw tail, per query."""
    tokens = _selected_tokens(selected, f_q, n_q, ng_q, ratio)
    rows = torch.zeros((tokens.shape[0], kv + 1), dtype=torch.bool, device=tokens.device)
    return rows.scatter(1, torch.where(tokens >= 0, tokens, kv), True)[:, :kv]


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
    ``empty`` [B, T] bool: queries that see no position at all (``any_empty``: whether there is one; None
    where only the device knows, :meth:`from_indices`).
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
            rows = _selected_tokens(selected, plan.f_q, plan.n_q, plan.ng_q, ratio)
            if rows.shape[1] < width:
                rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=-1)
            idx.view(batch * length, width)[plan.sel_idx] = rows
        self.token_idx = idx.to(torch.int32)
        self.kv = kv
        self.empty = n == 0
        self.any_empty = plan.any_empty

    @classmethod
    def from_indices(cls, token_idx: torch.Tensor, kv: int, empty: torch.Tensor) -> "_Selection":
        """A selection computed on the device with no host read (issue 19): ``any_empty`` is None, which
        queries see nothing is known only to the device (the attention handles every query as maybe empty)."""
        self = cls.__new__(cls)
        self.token_idx, self.kv, self.empty, self.any_empty = token_idx, kv, empty, None
        return self

    def mask(self) -> torch.Tensor:
        """[B, 1, T, K] bool: the selection mask, as transformers' indexer builds it."""
        idx = self.token_idx.long()
        rows = torch.zeros((*idx.shape[:-1], self.kv + 1), dtype=torch.bool, device=idx.device)
        return rows.scatter(-1, torch.where(idx >= 0, idx, self.kv), True)[..., :self.kv].unsqueeze(1)


def selection_mask(indexer_output) -> torch.Tensor:
    """The boolean selection mask behind an indexer output (a mask already, or what the sparse path passes)."""
    return indexer_output.mask() if isinstance(indexer_output, _Selection) else indexer_output

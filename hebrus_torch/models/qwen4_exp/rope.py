"""The rotary cos/sin of packed rows, from the model's own rotary embedding, independent of the batch."""

from __future__ import annotations

import torch


class RopeRows:
    """cos/sin Tensor[T, R] of a text model's ``rotary_emb`` at any positions.

    They are read from tables that the rotary module fills ``BLOCK`` positions per call, always the same
    block per call, so a position's cos/sin never depend on which other positions share the step (CPU
    transcendental kernels give an element other bits by where it sits in a vector). Tables grow by whole
    blocks and are rebuilt when the activations' dtype changes.
    """

    BLOCK = 4096

    def __init__(self, rotary_emb: torch.nn.Module):
        self.rotary_emb = rotary_emb
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor, last: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin Tensor[T, R] at ``positions`` (Tensor[T] int64 on like's device, none above ``last``), in
        the dtype the rotary module gives activations like ``like`` (Tensor[T, hidden])."""
        tables = self._tables
        if tables is not None and tables[0].dtype != like.dtype:
            tables = None
        have = 0 if tables is None else tables[0].shape[0]
        need = (last // self.BLOCK + 1) * self.BLOCK
        if need > have:
            done = [] if tables is None else [tables]
            for b0 in range(have, need, self.BLOCK):
                pos = torch.arange(b0, b0 + self.BLOCK, dtype=torch.int64, device=like.device)
                cos, sin = self.rotary_emb(like[None, :1], pos.view(1, 1, -1).expand(3, 1, -1))
                done.append((cos[0], sin[0]))
            tables = self._tables = (torch.cat([c for c, _ in done]), torch.cat([s for _, s in done]))
        return tables[0].index_select(0, positions), tables[1].index_select(0, positions)

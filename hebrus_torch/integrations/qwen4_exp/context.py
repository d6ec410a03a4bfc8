"""The per-text-model call context: the rotary positions a forward hook captures for the indexers."""

from __future__ import annotations

import torch

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

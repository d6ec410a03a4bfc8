"""The loader's refusal: a checkpoint that cannot be loaded as it is."""

from __future__ import annotations

from hebrus_torch.errors import HebrusError

__all__ = ["CheckpointError"]


class CheckpointError(HebrusError):
    """A checkpoint is incomplete or disagrees with its config: a missing or truncated file, a tensor of
    another shape or dtype, a missing expert or n-gram shard, an index naming a file that is not there. The
    message names the file and the key. Raised before anything is returned (nothing is half-loaded)."""

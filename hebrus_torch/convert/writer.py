"""Sharded safetensors written tensor by tensor: every output's dtype and shape is known before any data is
computed, so each file's header is written first and each tensor's bytes go straight to their place (at most
one source tensor's outputs in memory at a time)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from hebrus_torch.loading.files import SAFETENSORS_DTYPES

__all__ = ["OutputTensor", "ShardLayout", "plan_shards", "write_index"]

_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass
class OutputTensor:
    """One tensor of the written checkpoint: its key, dtype and shape (its bytes come later)."""
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class ShardLayout:
    """One safetensors file: its name, header bytes (length prefix included) and every tensor's absolute byte
    offset in the file. Tensors are laid out by decreasing item size (so each starts aligned to its own)."""
    name: str
    tensors: list[OutputTensor]
    header: bytes
    offsets: dict[str, int]

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)

    def write(self, f: BinaryIO, key: str, data: torch.Tensor, row_offset_bytes: int = 0) -> None:
        """``data``'s bytes at ``key``'s place plus ``row_offset_bytes`` (a slice of rows written alone)."""
        f.seek(self.offsets[key] + row_offset_bytes)
        f.write(data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _layout(name: str, tensors: list[OutputTensor]) -> ShardLayout:
    ordered = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.key))
    entries, start = {}, 0
    for t in ordered:
        entries[t.key] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [start, start + t.nbytes]}
        start += t.nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 8)
    base = 8 + len(header)
    offsets = {key: base + e["data_offsets"][0] for key, e in entries.items()}
    return ShardLayout(name, ordered, len(header).to_bytes(8, "little") + header, offsets)


def plan_shards(groups: list[list[OutputTensor]], max_shard_bytes: int) -> list[ShardLayout]:
    """Consecutive groups (the outputs of one source tensor stay together) packed into files of at most
    ``max_shard_bytes`` of data (a group larger than that has a file of its own), named as transformers
    names them (``model-00001-of-00003.safetensors``)."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for group in groups:
        group_bytes = sum(t.nbytes for t in group)
        if shards[-1] and size + group_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += group_bytes
    count = len(shards)
    return [_layout(f"model-{i + 1:05d}-of-{count:05d}.safetensors", tensors) for i, tensors in enumerate(shards)]


def write_index(directory: Path, shards: list[ShardLayout]) -> None:
    weight_map = {t.key: shard.name for shard in shards for t in shard.tensors}
    total = sum(t.nbytes for shard in shards for t in shard.tensors)
    with open(directory / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)

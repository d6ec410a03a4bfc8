"""A sharded safetensors checkpoint on disk: its index, each file's header, every tensor's byte range.

Nothing here reads tensor data except :meth:`CheckpointFiles.tensor`, which returns a zero-copy view of the
file's pages (a private memory map): copying it into a model's tensor is what loads a weight, one at a time.
:meth:`CheckpointFiles.open` checks the whole checkpoint first (files named by the index exist, headers parse,
every tensor's bytes lie inside its file and match its shape and dtype), so a bad checkpoint is refused before
anything is loaded.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError

__all__ = ["TensorInfo", "CheckpointFiles", "read_header", "SAFETENSORS_DTYPES", "INDEX_NAME", "SINGLE_NAME"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors' dtype names; the float8 ones are listed so that an fp8 table is named in the refusal.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lies: ``file`` (absolute path), ``offset`` (absolute byte offset of its first
    byte in the file), ``nbytes``, ``dtype`` and ``shape`` as the header states them."""
    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, checked against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER or 8 + length > size:
            raise CheckpointError(f"{file}: truncated or not a safetensors file (header of {length} bytes, "
                                  f"file of {size})")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointError(f"{file}: the safetensors header is not JSON ({exc})") from None
    base = 8 + length
    out: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {key!r} has a malformed header entry {entry!r}") from None
        info = TensorInfo(key, str(file), dtype, shape, base + begin, end - begin)
        if info.nbytes != info.numel * dtype.itemsize or begin < 0:
            raise CheckpointError(f"{file}: tensor {key!r} of shape {list(shape)} {entry['dtype']} spans "
                                  f"{end - begin} bytes, not {info.numel * dtype.itemsize}")
        if base + end > size:
            raise CheckpointError(f"{file}: truncated: tensor {key!r} ends at byte {base + end}, the file has "
                                  f"{size}")
        out[key] = info
    return out


class CheckpointFiles:
    """The tensors of a checkpoint directory (``model.safetensors.index.json`` and its shards, or one
    ``model.safetensors``), by key."""

    def __init__(self, directory: Path, tensors: dict[str, TensorInfo]):
        self.directory = directory
        self.tensors = tensors
        self._maps: dict[str, mmap.mmap] = {}

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "CheckpointFiles":
        """Read and check the index and every file's header (no tensor data is read)."""
        directory = Path(directory)
        index = directory / INDEX_NAME
        if index.exists():
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
        elif (directory / SINGLE_NAME).exists():
            weight_map = None
        else:
            raise CheckpointError(f"{directory}: neither {INDEX_NAME} nor {SINGLE_NAME} is there")
        if weight_map is None:
            return cls(directory, read_header(directory / SINGLE_NAME))
        by_file: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, []).append(key)
        tensors: dict[str, TensorInfo] = {}
        for name, keys in sorted(by_file.items()):
            file = directory / name
            if not file.is_file():
                raise CheckpointError(f"{index} names {name} (for {keys[0]!r} and {len(keys) - 1} more), "
                                      f"which is not there")
            header = read_header(file)
            for key in keys:
                if key not in header:
                    raise CheckpointError(f"{file}: the index puts {key!r} in this file, its header has no such "
                                          f"tensor")
                tensors[key] = header[key]
        return cls(directory, tensors)

    def _map(self, file: str) -> mmap.mmap:
        """The whole file, memory-mapped privately (copy on write: never written, never copied)."""
        mapped = self._maps.get(file)
        if mapped is None:
            with open(file, "rb") as f:
                mapped = self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return mapped

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """The stored tensor as a CPU view of the mapped file (valid while this object lives)."""
        raw = torch.from_numpy(np.frombuffer(self._map(info.file), dtype=np.uint8, count=info.nbytes,
                                             offset=info.offset))
        if info.dtype.itemsize > 1 and info.offset % info.dtype.itemsize:
            raw = raw.clone()    # an unaligned tensor (safetensors aligns them; a hand-made file may not)
        return raw.view(info.dtype).view(info.shape)

    def release(self, info: TensorInfo) -> None:
        """Drop this process's pages of ``info``'s bytes (after they were copied), so that loading holds at most
        about one tensor's pages mapped beside the model (the pages stay in the OS page cache)."""
        mapped = self._maps.get(info.file)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        stop = min(len(mapped), -(-(info.offset + info.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if stop > start:
            mapped.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def close(self) -> None:
        """Drop the maps (views handed out keep them alive until they go)."""
        self._maps.clear()


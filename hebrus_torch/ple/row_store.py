"""The PLE n-gram table read from the checkpoint's own files: a row store and the module that stands in for
``ngram_embedding`` (docs/ple.md).

The released table is 95.4 GiB in bf16, 128 safetensors shards; a token reads 16 of its 160-value rows.
:class:`PLERowStore` memory-maps each shard's byte range read-only and gathers rows with numpy (ids
de-duplicated per call); :class:`DiskNgramEmbedding` has ``nn.Embedding``'s call (``ids [...] int64 -> rows
[..., dim]``) and returns, bitwise, the rows of the concatenated table, so the engine's packed forward and the
transformers drop-in call it unchanged.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from hebrus_torch.errors import HebrusError

__all__ = ["TableShard", "PLERowStore", "DiskNgramEmbedding"]


@dataclass(frozen=True)
class TableShard:
    """``rows`` consecutive rows of ``row_bytes`` bytes each, starting at byte ``offset`` of ``file``."""
    file: str
    offset: int
    rows: int


class PLERowStore:
    """The rows of a table stored as consecutive shards (shard i holding the rows after shard i-1's), read
    through read-only memory maps of the files: the pages stay in the OS page cache, file-backed.

    ``dtype``: the stored dtype (bf16, fp16, fp32); ``dim``: values per row. ``cache_bytes``: after about this
    many bytes of pages touched, the process's mappings are released with ``madvise(MADV_DONTNEED)`` (the pages
    stay in the page cache for the next reads; the process stops holding them); None: never.
    """

    # A call gathering at least this many distinct rows (a prefill chunk) first asks the kernel to read all their
    # pages (MADV_WILLNEED), so that cold rows are read with the disk's queue depth instead of one fault at a time.
    WILLNEED_MIN_ROWS = 256

    def __init__(self, shards: list[TableShard], dtype: torch.dtype, dim: int, *, cache_bytes: int | None = None):
        if not shards:
            raise HebrusError("PLERowStore: no shards")
        self.dtype = dtype
        self.dim = dim
        self.row_bytes = dim * dtype.itemsize
        self.cache_bytes = cache_bytes
        self._maps: list[mmap.mmap] = []
        self._views: list[np.ndarray] = []
        self._shard_maps: list[tuple[mmap.mmap, int]] = []      # per shard: its file's map, its data offset
        self._shard_fds: list[int | None] = []     # per shard: a descriptor of its file (posix_fadvise), if any
        fds: list[int] = []
        starts = [0]
        by_file: dict[str, tuple[mmap.mmap, int | None]] = {}
        for shard in shards:
            mapped, fd = by_file.get(shard.file, (None, None))
            if mapped is None:
                with open(shard.file, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if hasattr(mmap, "MADV_RANDOM"):
                    mapped.madvise(mmap.MADV_RANDOM)   # rows are scattered: no readahead of their neighbours
                if hasattr(os, "posix_fadvise"):
                    fd = os.open(shard.file, os.O_RDONLY)
                    fds.append(fd)
                by_file[shard.file] = (mapped, fd)
                self._maps.append(mapped)
            self._shard_maps.append((mapped, shard.offset))
            self._shard_fds.append(fd)
            self._views.append(np.frombuffer(mapped, dtype=np.uint8, count=shard.rows * self.row_bytes,
                                             offset=shard.offset).reshape(shard.rows, self.row_bytes))
            starts.append(starts[-1] + shard.rows)
        self._starts = np.asarray(starts, dtype=np.int64)
        self.num_rows = int(self._starts[-1])
        self._touched = 0
        self._lock = threading.RLock()          # (release() from the budget check runs under it)
        weakref.finalize(self, _close_all, fds)
        self.stats = {"calls": 0, "rows": 0, "unique_rows": 0, "releases": 0}

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[*ids.shape, dim]`` in the stored dtype, on the CPU, for int64 ``ids`` (any device/shape)."""
        flat = ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
        if flat.size == 0:
            return torch.empty((*ids.shape, self.dim), dtype=self.dtype)
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = self.read_unique(unique, will_need=unique.size >= self.WILLNEED_MIN_ROWS, asked=flat.size)
        out = torch.from_numpy(rows[inverse.reshape(-1)])
        return out.view(self.dtype).view(*ids.shape, self.dim)

    def read_unique(self, unique: np.ndarray, *, will_need: bool = False, asked: int | None = None) -> np.ndarray:
        """The rows of sorted distinct int64 ids ``unique`` [U] as bytes: ndarray[U, row_bytes] uint8 (view them
        as ``dtype``). ``will_need``: first advise the kernel of every page they touch (MADV_WILLNEED).
        ``asked``: how many ids the caller's call had before de-duplication (``stats["rows"]``; default U).
        Thread-safe (the prefetch worker and the engine thread may both read)."""
        if unique.size and (unique[0] < 0 or unique[-1] >= self.num_rows):
            bad = unique[0] if unique[0] < 0 else unique[-1]
            raise HebrusError(f"PLERowStore: row id {int(bad)} outside [0, {self.num_rows})")
        rows = np.empty((unique.size, self.row_bytes), dtype=np.uint8)
        with self._lock:
            shard_of = np.searchsorted(self._starts, unique, side="right") - 1
            if will_need and unique.size:
                self._will_need(unique, shard_of)
            for s in np.unique(shard_of):
                picked = shard_of == s
                rows[picked] = self._views[s][unique[picked] - self._starts[s]]
            self._account(unique.size)
            self.stats["calls"] += 1
            self.stats["rows"] += int(unique.size if asked is None else asked)
            self.stats["unique_rows"] += int(unique.size)
        return rows

    def _will_need(self, unique: np.ndarray, shard_of: np.ndarray) -> None:
        """Ask the kernel to read the pages of these rows (runs of adjacent pages merged): a hint, never an error.
        ``posix_fadvise(POSIX_FADV_WILLNEED)`` on the file where there is one (Linux: what ``MADV_WILLNEED`` on a
        file mapping does, through a call that releases the GIL, so the engine thread runs on while a cold hint
        waits for the filesystem), else ``madvise(MADV_WILLNEED)`` on the map (macOS)."""
        if not hasattr(mmap, "MADV_WILLNEED") and not hasattr(os, "posix_fadvise"):
            return
        page = mmap.PAGESIZE
        for s in np.unique(shard_of):
            mapped, offset = self._shard_maps[s]
            fd = self._shard_fds[s]
            begin = offset + (unique[shard_of == s] - self._starts[s]) * self.row_bytes
            first = begin // page                                   # rows sorted: so are their pages
            last = (begin + self.row_bytes - 1) // page
            starts = np.flatnonzero(np.concatenate([[True], first[1:] > last[:-1] + 1]))
            ends = np.concatenate([starts[1:] - 1, [first.size - 1]])
            lo = first[starts] * page
            length = np.minimum(len(mapped), (last[ends] + 1) * page) - lo
            if fd is not None:
                for start, n in zip(lo.tolist(), length.tolist()):
                    os.posix_fadvise(fd, start, n, os.POSIX_FADV_WILLNEED)
            elif hasattr(mmap, "MADV_WILLNEED"):
                for start, n in zip(lo.tolist(), length.tolist()):
                    mapped.madvise(mmap.MADV_WILLNEED, start, n)

    def _account(self, unique_rows: int) -> None:
        if self.cache_bytes is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        self._touched += unique_rows * max(self.row_bytes, mmap.PAGESIZE)
        if self._touched > self.cache_bytes:
            self.release()

    def release(self) -> None:
        """Drop the process's resident pages of the table (they stay in the OS page cache)."""
        with self._lock:
            if hasattr(mmap, "MADV_DONTNEED"):
                for mapped in self._maps:
                    mapped.madvise(mmap.MADV_DONTNEED)
            self._touched = 0
            self.stats["releases"] += 1


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class DiskNgramEmbedding(torch.nn.Module):
    """Stands in for ``Qwen4ExpTextNGramEmbedding.ngram_embedding`` (an ``nn.Embedding``) with the table on disk.

    ``forward(ids)``: int64 ids ``[...]`` -> rows ``[..., embedding_dim]`` in ``dtype`` on ``ids.device``, bitwise
    the rows of the concatenated table (cast to ``dtype`` as ``from_pretrained(dtype=)`` casts the table).
    ``weight`` is a meta tensor of the table's shape and dtype (no storage): code that reads the table's shape,
    dtype or device works; code that needs its values must call the module. It has no parameters or buffers,
    so ``model.to()`` and ``state_dict()`` leave the table where it is.
    """

    def __init__(self, store: PLERowStore, dtype: torch.dtype | None = None):
        super().__init__()
        self.store = store
        self.num_embeddings = store.num_rows
        self.embedding_dim = store.dim
        self.out_dtype = dtype or store.dtype

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty((self.num_embeddings, self.embedding_dim), dtype=self.out_dtype, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.store.gather(ids)
        if ids.device.type != "cpu":
            rows = rows.pin_memory() if ids.device.type == "cuda" else rows
            return rows.to(ids.device, self.out_dtype, non_blocking=ids.device.type == "cuda")
        return rows.to(self.out_dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.out_dtype}, on disk "
                f"({self.store.nbytes / 2**30:.2f} GiB, {len(self.store._maps)} files)")

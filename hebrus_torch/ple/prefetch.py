"""A step's PLE rows gathered off the engine thread (docs/ple.md, "Prefetch").

The n-gram ids of every PLE layer of a step depend only on the step's tokens and the n-gram history the PLE
holder keeps, so the packed forward computes them as soon as the step starts and hands them to
:class:`PLEPrefetcher`: one worker thread de-duplicates the ids of every layer that reads the same
:class:`~hebrus_torch.ple.row_store.PLERowStore`, advises the kernel of their pages (``MADV_WILLNEED``),
reads the rows and lays every layer's rows out in one host buffer, while the engine thread runs the layers
before the first PLE layer. The PLE layer then takes them from :class:`PrefetchedRows`: the engine thread
waits only if they are not ready yet, uploads the buffer to the model's device once for the whole step and
views each layer's rows in it: bitwise the rows :class:`~hebrus_torch.ple.row_store.DiskNgramEmbedding`
gives for the same ids.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import HebrusError
from .row_store import PLERowStore

__all__ = ["PLEPrefetchError", "PrefetchLayer", "PLEPrefetcher", "PrefetchedRows", "WORKER_NAME", "AUTO_DEVICES",
           "prefetch_enabled"]

WORKER_NAME = "hebrus-ple-prefetch"
"""The prefix of the worker thread's name."""

AUTO_DEVICES = ("cuda", "mps")
"""Where ``ple_prefetch="auto"`` turns the prefetch on: the model's device types whose work runs beside the host's.
On the CPU the worker's reads would compete with torch's own threads for the cores (docs/ple.md, "Prefetch")."""

_ALIGN = 16     # each layer's rows start at a multiple of this many bytes of the buffer (any dtype can view them)


class PLEPrefetchError(HebrusError):
    """The worker could not gather a step's PLE rows (a read error, an id outside the table): raised on the engine
    thread by the PLE layer of that step; the step publishes nothing and the next one starts afresh."""


def prefetch_enabled(setting: bool | str, device: torch.device) -> bool:
    """Whether a model on ``device`` prefetches: ``setting`` True / False as given, ``"auto"``: on a device of
    :data:`AUTO_DEVICES` (CUDA, MPS), off on the CPU."""
    if setting == "auto" and not isinstance(setting, bool):
        return device.type in AUTO_DEVICES
    if not isinstance(setting, bool):
        raise HebrusError(f"ple_prefetch must be a bool or 'auto', got {setting!r}")
    return setting


@dataclass(frozen=True)
class PrefetchLayer:
    """One PLE layer's part of a step: its decoder-layer index, its n-gram ids ``[T, K]`` int64 (on any
    device) and the store its rows come from."""
    layer_idx: int
    ids: torch.Tensor
    store: PLERowStore


@dataclass(frozen=True)
class _Place:
    offset: int                 # bytes into the buffer
    shape: tuple[int, ...]      # the ids' shape
    store: PLERowStore
    nbytes: int                 # ids x the store's row bytes


class PrefetchedRows:
    """What the engine thread holds of one step's prefetch: :meth:`rows` per PLE layer; :meth:`discard` when the
    step ends without taking them (an exception before the PLE layer)."""

    def __init__(self, prefetcher: "PLEPrefetcher", future: Future, places: dict[int, _Place],
                 device: torch.device):
        self._prefetcher = prefetcher
        self._future = future
        self._places = places
        self._device = device
        self._buffer: torch.Tensor | None = None

    def __contains__(self, layer_idx: int) -> bool:
        return layer_idx in self._places

    def rows(self, layer_idx: int, dtype: torch.dtype) -> torch.Tensor:
        """Layer ``layer_idx``'s rows ``[*ids.shape, dim]`` in ``dtype`` on the model's device. The first call of
        the step waits for the worker (if it is not done) and uploads the whole step's rows at once.

        Raises:
            PLEPrefetchError: the worker failed (its error chained).
        """
        if self._buffer is None:
            self._buffer = self._upload(self._prefetcher._wait(self._future, sorted(self._places)))
        place = self._places[layer_idx]
        store = place.store
        rows = self._buffer[place.offset: place.offset + place.nbytes]
        return rows.view(store.dtype).view(*place.shape, store.dim).to(dtype)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cpu":
            return host
        # One copy of the step's rows, queued without waiting (CUDA: from pinned memory; MPS: a blit). The
        # prefetcher keeps the host buffer until the next step's upload: the step's own sync (its logits read)
        # comes first, so the copy has read it by then.
        self._prefetcher._uploaded = host
        return host.to(self._device, non_blocking=self._device.type in ("cuda", "mps"))

    def discard(self) -> None:
        """The step ended: drop its rows (a job not yet started is cancelled)."""
        self._future.cancel()
        self._buffer = None


def _to_host_async(ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(engine thread) int64 ids [T, K] -> (a host tensor they are being copied into, an event that completes
    when they are there, or None where they are there already). CUDA: into pinned memory, then a CUDA event;
    MPS: a blit, then an MPS event (recording it commits the queued work); CPU: the ids themselves; any other
    device (and the MPS emulated on CPU, ``hebrus_torch._emulate``): a blocking copy."""
    ids = ids.detach()
    if ids.device.type == "cpu":
        return ids.to(torch.int64), None
    kind = ids.device.type
    if kind == "cuda" or (kind == "mps" and torch.backends.mps.is_available()):     # (not hebrus' MPS emulation)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=kind == "cuda")
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event() if kind == "cuda" else torch.mps.event.Event()
        event.record()
        return host, event
    return ids.to("cpu"), None


class PLEPrefetcher:
    """Gathers steps' PLE rows on one worker thread (started on first use, stopped by :meth:`close`).

    ``stats``: ``steps`` (steps whose rows were prefetched), ``layers``, ``rows`` (ids asked) and ``unique_rows``
    (rows read after de-duplication), ``ready`` (steps whose rows were ready when their PLE layer asked),
    ``waits`` and ``wait_seconds`` (the engine thread waited for the worker), ``errors`` (steps whose gather
    failed).
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._uploaded: torch.Tensor | None = None     # the last step's host rows (an upload may still read them)
        self.stats = {"steps": 0, "layers": 0, "rows": 0, "unique_rows": 0, "ready": 0, "waits": 0,
                      "wait_seconds": 0.0, "errors": 0}

    def submit(self, layers: list[PrefetchLayer], device: torch.device) -> PrefetchedRows:
        """Start gathering ``layers``' rows for a step whose model runs on ``device``. Runs on the engine thread:
        ids on a device start their copy to the host here, without waiting (the worker waits for it)."""
        host_ids = [_to_host_async(layer.ids) for layer in layers]
        places: dict[int, _Place] = {}
        offset = 0
        for layer in layers:
            shape = tuple(layer.ids.shape)
            place = _Place(offset, shape, layer.store, math.prod(shape) * layer.store.row_bytes)
            places[layer.layer_idx] = place
            offset += -(-place.nbytes // _ALIGN) * _ALIGN
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WORKER_NAME)
            future = self._executor.submit(self._gather, layers, host_ids, places, offset, device.type == "cuda")
        self.stats["steps"] += 1
        self.stats["layers"] += len(layers)
        return PrefetchedRows(self, future, places, device)

    def _gather(self, layers: list[PrefetchLayer], host_ids: list[tuple[torch.Tensor, Any]], places: dict[int, _Place],
                nbytes: int, pin: bool) -> torch.Tensor:
        """(worker) Every layer's rows, layer after layer, in one uint8 buffer [nbytes] (pinned for CUDA)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        out = buffer.numpy()
        by_store: dict[int, list[tuple[PrefetchLayer, np.ndarray]]] = {}
        for layer, (ids, copied) in zip(layers, host_ids):
            if copied is not None:
                copied.synchronize()        # the ids' copy from the device (and only what came before it)
            flat = ids.reshape(-1).numpy()
            by_store.setdefault(id(layer.store), []).append((layer, flat))
        for members in by_store.values():
            store = members[0][0].store
            flats = [flat for _, flat in members]
            everything = np.concatenate(flats) if len(flats) > 1 else flats[0]
            if everything.size == 0:
                continue
            unique, inverse = np.unique(everything, return_inverse=True)
            rows = store.read_unique(unique, will_need=True, asked=everything.size)
            self.stats["rows"] += int(everything.size)
            self.stats["unique_rows"] += int(unique.size)
            start = 0
            for layer, flat in members:
                place = places[layer.layer_idx]
                target = out[place.offset: place.offset + place.nbytes].reshape(flat.size, store.row_bytes)
                np.take(rows, inverse.reshape(-1)[start: start + flat.size], axis=0, out=target)
                start += flat.size
        return buffer

    def _wait(self, future: Future, layer_ids: list[int]) -> torch.Tensor:
        if future.done():
            self.stats["ready"] += 1
        else:
            self.stats["waits"] += 1
            t0 = time.perf_counter()
            try:
                future.exception()
            finally:
                self.stats["wait_seconds"] += time.perf_counter() - t0
        try:
            return future.result()
        except Exception as err:  # noqa: BLE001 - whatever the worker hit is this step's error
            self.stats["errors"] += 1
            raise PLEPrefetchError(f"PLE prefetch: gathering the rows of PLE layer(s) {layer_ids} for this step "
                                   f"failed: {type(err).__name__}: {err}") from err

    @property
    def running(self) -> bool:
        """Whether the worker thread exists (started and not closed)."""
        return self._executor is not None

    def close(self) -> None:
        """Stop the worker (jobs not started are cancelled; one in progress is waited for). Idempotent; a later
        :meth:`submit` starts a new worker."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

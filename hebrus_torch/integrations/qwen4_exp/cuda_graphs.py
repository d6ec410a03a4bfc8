"""The drop-in's decode work on CUDA as captured CUDA graphs (issue 19).

CUDA runs the ops' pure-PyTorch reference, and a decode step there is bound by the host's kernel
launches (~25-30 us each on the project's GPU host), not by the GPU: the sync-free selection of one
indexer call is some 150 small kernels where transformers' own indexer launches about 35, the PLE
rows forms some 20. These functions have no host read and no host-side state, so each can be
captured once per shape and replayed: the call's inputs are copied into static buffers, the graph
replays every kernel with one launch, and the output is copied out. A call then costs a few
launches whatever the function does.

The indexer's key dimension grows by one every decode step: its buffers are padded up to a multiple
of :data:`BUCKET` columns, the columns past the real keys masked out, so a new bucket (every
``BUCKET`` decode steps of a sequence) costs one capture. Padding changes no result: groups, ranks
and selections are computed from the visible columns only, and every candidate group's pooled key
and score are functions of that group alone (the reference's fixed-order scores); the extra
candidate groups past a query's complete groups are never selectable. ``tests/test_sync_free.py``
checks the padded computation against the unpadded one on CPU, ``tests/test_cuda_sync.py`` the
replays against the eager path on CUDA.

Not used while the current stream is being captured (the caller's own graph records the eager path),
under ``torch.compile``, off CUDA, or with ``HEBRUS_CUDA_GRAPHS=0``. A capture that fails turns graphs
off for the process, with one warning; the call then runs eagerly.
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
from typing import Callable, NamedTuple, Sequence

import torch

from .stats import _STATS

BUCKET = 256          # key columns per padding step of the indexer: a capture every BUCKET decode steps
MAX_GRAPHS = 16       # captured graphs kept (least recently used dropped); a decode step uses three
MAX_TOKENS = 16       # calls of at most this many tokens per row replay graphs (decode, short steps); longer
                      # ones (prefill) run eagerly: a shape seen once would cost a capture

_graphs: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()
_failed = False


class CaptureError(RuntimeError):
    """Capturing a function that ran eagerly failed (graphs are then turned off for the process)."""


class Pad(NamedTuple):
    """An input held padded along ``dim`` to ``size`` entries; ``fill`` (if not None) for the entries past
    the call's own, rewritten at every call (None: what lies there is never read)."""
    dim: int
    size: int
    fill: bool | float | None = None


def enabled() -> bool:
    """Whether CUDA graphs may be used (``HEBRUS_CUDA_GRAPHS=0`` turns them off)."""
    return not _failed and os.environ.get("HEBRUS_CUDA_GRAPHS", "1") != "0"


def usable(*tensors: torch.Tensor) -> bool:
    """Whether :func:`replay` may serve a call on these tensors (host-known facts only)."""
    device = tensors[0].device
    return (device.type == "cuda" and enabled() and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing() and all(t.device == device for t in tensors))


def padded_keys(kv: int) -> int:
    """The number of key columns an indexer call with ``kv`` keys is padded to."""
    return -(-kv // BUCKET) * BUCKET


def mask_fill(dtype: torch.dtype) -> bool | float:
    """A masked-out entry of a mask of ``dtype`` (bool: False; float: not 0)."""
    return False if dtype == torch.bool else torch.finfo(dtype).min


class StaticCall:
    """Static copies of ``fn(spec, *args)``'s tensor inputs and (on CUDA) the graph that maps them to its output.

    Works on any device without a graph (:meth:`compute`), which is how CPU tests check the padding.
    """

    def __init__(self, fn: Callable, spec, args: Sequence[torch.Tensor], pads: Sequence[Pad | None]):
        self.fn, self.spec, self.pads = fn, spec, tuple(pads)
        self.buffers = []
        for t, pad in zip(args, self.pads):
            shape = list(t.shape)
            if pad is not None:
                shape[pad.dim] = pad.size
            buf = t.new_empty(shape)
            if pad is not None and pad.fill is None:
                buf.zero_()                       # never read, but defined
            self.buffers.append(buf)
        self.graph = None
        self.out = None

    def fill(self, args: Sequence[torch.Tensor]) -> None:
        """Copy a call's inputs in (padded entries past them rewritten where they are read)."""
        for buf, t, pad in zip(self.buffers, args, self.pads):
            if pad is None:
                buf.copy_(t)
                continue
            n = t.shape[pad.dim]
            buf.narrow(pad.dim, 0, n).copy_(t)
            if pad.fill is not None and n < pad.size:
                buf.narrow(pad.dim, n, pad.size - n).fill_(pad.fill)

    def compute(self):
        """``fn`` on the static buffers, eagerly."""
        return self.fn(self.spec, *self.buffers)

    def capture(self) -> None:
        """Warm up on a side stream (lazy initialisation stays out of the graph), then capture ``compute``.

        capture_begin/capture_end rather than ``torch.cuda.graph``, whose entry synchronizes the device
        and empties the allocator's cache: a capture here happens in the middle of a decode loop.
        """
        device = self.buffers[0].device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.compute()                        # an error of fn itself (bad input) propagates from here
            graph = torch.cuda.CUDAGraph()
            try:
                # A private memory pool per graph: graphs sharing one pool handle trip an allocator assert
                # (torch 2.11) once one of them is dropped and another is captured into it.
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = self.compute()
                finally:
                    graph.capture_end()
            except Exception as err:              # noqa: BLE001 - any capture failure: run eagerly from now on
                raise CaptureError(f"{type(err).__name__}: {err}") from err
        current.wait_stream(side)
        self.graph, self.out = graph, out


def replay(fn: Callable, spec, args: Sequence[torch.Tensor], pads: Sequence[Pad | None] | None = None,
           view: Callable = lambda out: out, counter: str | None = None):
    """``view(fn(spec, *args))`` through the captured graph of these shapes (captured on first use), as fresh
    tensors (a tensor or a tuple of them). ``pads``: per input, how its buffer is padded (None: as is);
    ``view`` selects the call's part of an output computed on padded inputs; ``counter``: the ``stats()``
    entry counted when the call is replayed (not when its capture failed and it ran eagerly)."""
    global _failed
    pads = tuple(pads) if pads is not None else (None,) * len(args)
    device = args[0].device
    key = (fn, spec, device, torch.cuda.current_stream(device).cuda_stream, pads,
           tuple((t.shape if p is None else t.shape[:p.dim] + t.shape[p.dim + 1:], t.dtype)
                 for t, p in zip(args, pads)))
    with _lock:
        call = _graphs.get(key)
        if call is None:
            call = StaticCall(fn, spec, args, pads)
            call.fill(args)
            try:
                call.capture()
            except CaptureError as err:
                _failed = True
                warnings.warn(f"hebrus_torch.integrations.transformers: CUDA graph capture of {fn.__name__} failed "
                              f"({err}); decode runs its kernels eagerly from now on", RuntimeWarning, stacklevel=3)
                return view(fn(spec, *args))
            _graphs[key] = call
            while len(_graphs) > MAX_GRAPHS:
                _graphs.popitem(last=False)
        else:
            _graphs.move_to_end(key)
            call.fill(args)
        call.graph.replay()
        if counter is not None:
            _STATS[counter] += 1
        out = view(call.out)
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def clear() -> None:
    """Drop every captured graph and its buffers."""
    with _lock:
        _graphs.clear()

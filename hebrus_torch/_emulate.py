"""Running on CPU as if on another device: ``with emulate("mps"):`` (or ``HEBRUS_EMULATE_DEVICE=mps``).

Inside the block, a tensor created for the emulated device (``torch.zeros(..., device="mps")``,
``t.to("mps")``, ``model.to("mps")``) is an :class:`EmulatedTensor`: a CPU tensor underneath that
reports ``device.type == "mps"``. So every ``device.type`` check in hebrus_torch, transformers and
PyTorch takes the emulated device's branch without any of them knowing, and host tensors (plain CPU
ones) stay distinguishable from device data, which is what makes a host read of device data (a
sync) visible. Where a hebrus op is native on the emulated device (:data:`NATIVE_OPS`, the op
registry's list of the ops with Metal kernels: ``hebrus_torch._op_registry``) it runs as one dispatch
of its CPU kernel; where it is not, its composite (the reference) runs op by op on the emulated
tensors, as the ``CompositeExplicitAutograd`` fallback does on the real device. ``has_native_kernel``
answers from the same list while emulating.

Every ATen or hebrus op that reaches the emulated device is reported to the observers
(:func:`observe`) as one of:

- ``"dispatch"``: work launched on the device (views and allocations excluded);
- ``"sync"``: the host waits for the device: ``.item()``, ``int/float/bool(t)``, ``.tolist()``,
  ``.cpu()`` / ``.to("cpu")`` / ``.numpy()``, and the ops whose output shape depends on device data
  (:data:`SYNC_OPS`, boolean-mask indexing, ``repeat_interleave`` with tensor repeats);
- ``"upload"``: a host-to-device copy (also a dispatch, but the host does not wait).

An ATen op counts as torch 2.13's MPS backend runs it, by its entries in the installed torch's
``native_functions.yaml`` (:mod:`hebrus_torch._mps_ops`): one dispatch where MPS has a kernel; where
it has only a composite, the composite itself runs on the emulated tensors and its ops and host reads
are reported one by one (``_grouped_mm``: a read of the offsets, a sync, then one ``mm`` per group),
after a ``"composite"`` report and with a ``"composite_sync"`` for each read; an op MPS has no kernel
for is reported as ``"no_kernel"`` (and still runs, as one dispatch).

What the emulation does not reproduce: the device's own numerics (the CPU kernels run), timing, and
``torch.Generator(device="mps")`` (sampling with ``do_sample=True`` needs a host generator here).
An op that mixes device data with a host tensor of more than one element raises, as it would on the
device.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map

from . import _mps_ops, _op_registry
from ._op_registry import NATIVE_OPS, emulated_device_type
from .errors import HebrusError

__all__ = ["EMULATED_DEVICE_TYPES", "NATIVE_OPS", "EmulatedTensor", "EmulationError", "emulate",
           "emulated_device_type", "from_env", "observe", "SYNC_OPS", "VIEW_OPS"]

ENV = "HEBRUS_EMULATE_DEVICE"

# The device types that can be emulated; NATIVE_OPS[device] (the registry's) lists the hebrus ops native
# there. (Only MPS: CUDA's runtime queries, torch.cuda.get_device_capability in transformers' MoE and the CUDA
# graphs, rule out tensors that merely claim the device; benchmarks/profile_decode.py --emulate-cuda
# patches CUDA's branches instead.)
EMULATED_DEVICE_TYPES: tuple[str, ...] = ("mps",)

# Ops that only change metadata or allocate: no work is launched on the device.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "squeeze", "unsqueeze", "transpose", "permute", "t", "slice",
    "select", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "flatten",
    "unflatten", "_reshape_alias", "lift_fresh", "chunk", "movedim", "view_as", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "_to_copy_noop", "unfold", "diagonal", "real", "imag",
    "view_as_real", "view_as_complex", "_nested_view_from_buffer", "set_", "resize_", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "dim", "size",
    "stride", "numel", "is_contiguous", "storage_offset",
})

# Ops whose result the host needs before it can go on (a scalar it reads, or an output whose size
# depends on device data).
SYNC_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
    "masked_select", "equal", "is_nonzero", "allclose", "bincount", "_assert_async", "argwhere",
    "_assert_scalar",
})


class EmulationError(HebrusError):
    """The code did something under emulation that the emulated device would refuse."""


_state = threading.local()   # the thread's _Dispatch mode (the emulated device type is the registry's)


def from_env() -> str | None:
    """``HEBRUS_EMULATE_DEVICE`` (``"mps"``) or None: what scripts pass to :func:`emulate`."""
    value = os.environ.get(ENV, "").strip().lower()
    return value or None


Observer = Callable[[str, str], None]


def _observers() -> list[Observer]:
    obs = getattr(_state, "observers", None)
    if obs is None:
        obs = _state.observers = []
    return obs


@contextlib.contextmanager
def observe(callback: Observer) -> Iterator[None]:
    """Call ``callback(kind, op_name)`` for every op on emulated tensors while the block runs (kinds:
    "dispatch", "sync", "upload", "fallback" for a hebrus op that ran as its reference, "composite" for
    an ATen op that MPS runs as a composite (its ops and reads follow, each reported, and a
    "composite_sync" naming the composite after each read), "no_kernel" for an ATen op that MPS has no
    kernel for (then reported as one dispatch too: what the CPU fallback would run); see
    ``hebrus_torch._mps_ops``)."""
    obs = _observers()
    obs.append(callback)
    try:
        yield
    finally:
        obs.remove(callback)


def _report(kind: str, name: str) -> None:
    buffers = getattr(_state, "buffers", None)
    if buffers:                                  # inside a composite being decomposed: kept until it finishes
        buffers[-1].append((kind, name))
        return
    for cb in list(_observers()):
        cb(kind, name)


# The keys that reach an op's MPS kernel slot: on a CPU wheel that slot holds the op's
# CompositeExplicitAutograd kernel wherever native_functions.yaml gives MPS no kernel of its own.
_MPS_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.MPS)


def _decompose(func, kind: str, args, kwargs, name: str, enter: Callable[[], Any]) -> Any:
    """Run ``func``'s composite on the tensors under the emulation so that the ops and host reads it makes
    are reported one by one (a "composite" report first; for the outermost composite, a "composite_sync"
    after each read). Returns NotImplemented, having reported nothing, where the composite is itself a
    device kernel: it calls a DispatchStub (PyTorch's "unexpected device type") or it ran no op at all
    (``copy_``'s composite compares storages, which wrapper tensors do not have, and on MPS is
    ``mps_copy_``: one kernel)."""
    if name in _DEVICE_KERNEL_COMPOSITES:
        return NotImplemented
    buffers = _state.__dict__.setdefault("buffers", [])
    buffers.append([])
    try:
        with enter():
            if kind == _mps_ops.COMPOSITE:
                out = func.redispatch(_MPS_KEYS, *args, **kwargs)
            else:                  # (the torch-function mode would send the kernel call back to the op)
                with torch._C.DisableTorchFunction():
                    out = func.decompose(*args, **kwargs)
    except RuntimeError as err:
        if "unexpected device type" in str(err):
            return NotImplemented
        raise
    finally:
        inner = buffers.pop()      # (whatever happened: later reports go to the observers again)
    if out is NotImplemented or not inner:
        return NotImplemented
    outermost = not buffers
    _report("composite", name)
    for k, n in inner:
        _report(k, n)
        if k == "sync" and outermost:
            _report("composite_sync", name)
    return out


# Composites in native_functions.yaml that are one kernel on MPS all the same: ``copy_`` (Copy.cpp sends
# MPS tensors to ``mps::mps_copy_`` before its DispatchStub).
_DEVICE_KERNEL_COMPOSITES = frozenset({"copy"})


class EmulatedTensor(torch.Tensor):
    """A CPU tensor (``.inner``) that reports the emulated device."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device):
        r = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=device, requires_grad=inner.requires_grad)
        r.inner = inner
        return r

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"EmulatedTensor({self.inner!r}, device='{self.device}')"

    def __tensor_flatten__(self):
        return ["inner"], self.device

    @staticmethod
    def __tensor_unflatten__(inner_tensors, device, outer_size, outer_stride):
        return EmulatedTensor(inner_tensors["inner"], device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mode = getattr(_state, "mode", None)
        if mode is None:
            raise EmulationError(f"emulate: {func} on an emulated tensor outside `with emulate(...)`")
        return mode._run(func, args, kwargs or {})


def _is_dev(x: Any) -> bool:
    return isinstance(x, EmulatedTensor)


def _as_device(dev: Any) -> torch.device | None:
    if dev is None:
        return None
    if isinstance(dev, int):
        return torch.device("cuda", dev)
    try:
        return torch.device(dev)
    except (RuntimeError, TypeError):
        return None


class _Dispatch(TorchDispatchMode):
    """Factory ops for the emulated device, every op on emulated tensors, the hebrus ops' native/fallback choice."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device = torch.device(device_type)
        self.native = NATIVE_OPS.get(device_type, frozenset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._run(func, args, kwargs or {})

    def _wrap(self, out):
        return tree_map(lambda x: EmulatedTensor(x, self.device)
                        if isinstance(x, torch.Tensor) and not _is_dev(x) and x.device.type == "cpu" else x, out)

    def _run(self, func, args, kwargs):
        name = func.overloadpacket.__name__
        base = name.rstrip("_")
        target = _as_device(kwargs.get("device"))
        flat, _ = tree_flatten((args, kwargs))
        on_dev = any(_is_dev(x) for x in flat)
        if func.namespace == "hebrus" and on_dev:
            if base not in self.native:
                _report("fallback", base)
                with _reenter(self):
                    return _op_registry.OPS[name].composite(*args, **kwargs)
        elif not on_dev and (target is None or target.type != self.device.type):
            return func(*args, **kwargs)                      # host work: not the device's
        for x in flat:
            if isinstance(x, torch.Tensor) and not _is_dev(x) and x.dim() > 0 and x.numel() > 1 and on_dev:
                raise EmulationError(f"emulate: {func} mixes {self.device.type} tensors with a host tensor of "
                                     f"shape {tuple(x.shape)} (the device refuses it)")
        if base == "_to_copy" and on_dev and target is not None and target.type == "cpu":
            _report("sync", "to_cpu")
            return func(*tree_map(lambda x: x.inner if _is_dev(x) else x, args), **kwargs)
        given_kwargs = kwargs                                # a composite makes its tensors on the device
        if target is not None and target.type == self.device.type:
            kwargs = dict(kwargs, device=torch.device("cpu"))
        if not on_dev and base in ("_to_copy", "lift_fresh_copy"):
            _report("upload", base)
        elif self._is_sync(func, base, args, kwargs):
            _report("sync", base)
        elif base not in VIEW_OPS:
            if func.namespace == "aten" and self._mps_counts(func, base):
                out = _decompose(func, _mps_ops.mps_kind(func), args, given_kwargs, base, lambda: _reenter(self))
                if out is not NotImplemented:
                    return out
            _report("dispatch", f"hebrus.{base}" if func.namespace == "hebrus" else base)
        inner_args = tree_map(lambda x: x.inner if _is_dev(x) else x, args)
        inner_kwargs = tree_map(lambda x: x.inner if _is_dev(x) else x, kwargs)
        if base == "histc" and not inner_args[0].is_floating_point():
            # CUDA's histc takes integers, the CPU kernel only floats: count in fp32 (exact below 2**24)
            dtype = inner_args[0].dtype
            out = func(inner_args[0].float(), *inner_args[1:], **inner_kwargs).to(dtype)
        else:
            out = func(*inner_args, **inner_kwargs)
        if base == "_local_scalar_dense" or not isinstance(out, (torch.Tensor, tuple, list)):
            return out
        out = self._wrap(out)
        return return_and_correct_aliasing(func, args, kwargs, out) if on_dev else out

    def _mps_counts(self, func, base: str) -> bool:
        """True when ``func`` is a composite on MPS (to be decomposed); reports "no_kernel" ops."""
        if self.device.type != "mps":
            return False
        kind = _mps_ops.mps_kind(func)
        if kind == _mps_ops.NO_KERNEL:
            _report("no_kernel", base)
        return kind in (_mps_ops.COMPOSITE, _mps_ops.IMPLICIT)

    @staticmethod
    def _is_sync(func, base: str, args, kwargs) -> bool:
        if base in SYNC_OPS:
            return True
        if base in ("index", "index_put") and len(args) > 1:
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        if base == "repeat_interleave":            # tensor repeats without output_size: the host sums them
            return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
        return False


@contextlib.contextmanager
def _reenter(mode: _Dispatch) -> Iterator[None]:
    """Both modes again, for a reference that runs op by op from inside a handler (where PyTorch has
    taken them off their stacks)."""
    with mode, _Entry(mode):
        yield


# What PyTorch says where a binding or a device-type switch needs the real device before dispatching.
_UNREACHABLE = ("not linked with support", "unexpected device type", "not compiled with CUDA")

_SCALAR_READS = (torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__bool__,
                 torch.Tensor.__index__, torch.Tensor.__complex__)


class _Entry(TorchFunctionMode):
    """The Python entry points that check the device before dispatching (``Tensor.to("mps")``), and the
    host reads that do not reach the dispatcher as one op (``.tolist()``, ``.numpy()``)."""

    def __init__(self, mode: _Dispatch):
        super().__init__()
        self.mode = mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev_type = self.mode.device.type
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and args and _is_dev(args[0]):
            _report("sync", func.__name__)
            inner = args[0].inner
            return inner.tolist() if func is torch.Tensor.tolist else inner.numpy(*args[1:], **kwargs)
        if func in _SCALAR_READS and args and _is_dev(args[0]):
            _report("sync", func.__name__.strip("_"))
            return func(args[0].inner, *args[1:], **kwargs)
        if func is torch.Tensor.to and args:
            copy = bool(kwargs.get("copy", False))
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                      if k != "copy"})
            x = args[0]
            if device is not None and device.type == dev_type:
                if dtype is not None and dtype != x.dtype:
                    x = func(x, dtype=dtype)
                if _is_dev(x):
                    return x.clone() if copy else x
                _report("upload", "to")
                return EmulatedTensor(x.clone(), self.mode.device)
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and _as_device(kwargs.get("device")) is not None \
                and _as_device(kwargs["device"]).type == dev_type:
            host = func(*args, **dict(kwargs, device="cpu"))
            if _is_dev(host):
                return host
            _report("upload", func.__name__)
            return EmulatedTensor(host.clone() if func is not torch.tensor else host, self.mode.device)
        target = _as_device(kwargs.get("device"))
        if target is not None and target.type == dev_type and not any(_is_dev(x) for x in tree_flatten(args)[0]):
            # A factory for the device: bindings such as torch.arange initialise the device's runtime
            # before dispatching (CUDA), so make it on CPU and wrap it.
            out = func(*args, **dict(kwargs, device="cpu"))
            name = getattr(func, "__name__", str(func))
            if name not in VIEW_OPS:
                _report("dispatch", name)
            return self.mode._wrap(out)
        try:
            return func(*args, **kwargs)
        except (RuntimeError, AssertionError) as err:
            if not any(m in str(err) for m in _UNREACHABLE):
                raise
        # A binding that takes a device guard before dispatching (indexing, copy_): run it on the CPU
        # tensors underneath, every op it dispatches counted as the device's, the results re-wrapped.
        unwrap = lambda x: x.inner if _is_dev(x) else x  # noqa: E731
        with _Inner(self.mode):
            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if args and _is_dev(args[0]) and out is args[0].inner:       # an in-place method returns self
            return args[0]
        return self.mode._wrap(out)


class _Inner(TorchDispatchMode):
    """Counts the ops that a guarded binding dispatches on the CPU tensors under emulated ones."""

    def __init__(self, mode: _Dispatch):
        super().__init__()
        self.mode = mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        base = func.overloadpacket.__name__.rstrip("_")
        kwargs = kwargs or {}
        if _Dispatch._is_sync(func, base, args, kwargs):
            _report("sync", base)
        elif base not in VIEW_OPS:
            if func.namespace == "aten" and self.mode._mps_counts(func, base):
                out = _decompose(func, _mps_ops.mps_kind(func), args, kwargs, base, lambda: self)
                if out is not NotImplemented:
                    return out
            _report("dispatch", base)
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulate(device_type: str = "mps") -> Iterator[torch.device]:
    """Emulate ``device_type`` on CPU inside the block; yields the device to put models and tensors on."""
    if device_type not in EMULATED_DEVICE_TYPES:
        raise HebrusError(f"emulate: can emulate {sorted(EMULATED_DEVICE_TYPES)}, not {device_type!r}")
    if emulated_device_type() is not None:
        raise HebrusError("emulate: already emulating on this thread")
    mode = _Dispatch(device_type)
    _state.mode = mode
    try:
        with _op_registry.emulating(device_type), mode, _Entry(mode):
            yield mode.device
    finally:
        _state.mode = None

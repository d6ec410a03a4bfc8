"""Loads the compiled kernels and registers the reference kernel wherever no native one exists."""

from __future__ import annotations

import json
import os
import warnings

import torch

from . import reference
from ._schemas import SCHEMAS

_fallback_library: torch.library.Library | None = None  # the schemas, where no compiled extension defined them


BUILD_INFO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_info.json")


def build_mismatch(path: str = BUILD_INFO, running: str = torch.__version__) -> str | None:
    """Why the compiled extension must not be loaded: it was built against another torch (setup.py records
    the version in _build_info.json) and its registrars would run torch C++ code of another ABI. None: load
    (also when nothing was recorded)."""
    try:
        with open(path) as f:
            built = json.load(f).get("torch")
    except (OSError, ValueError, AttributeError):
        return None

    def minor(version: str) -> str:
        return ".".join(str(version).split("+")[0].split(".")[:2])

    if built is not None and minor(built) != minor(running):
        return (f"hebrus_torch's extension was built against torch {built}, this is torch {running}: "
                f"it is not loaded and every op runs its PyTorch reference; rebuild it (pip install "
                f"--no-build-isolation -e .) against the torch its setup.py accepts")
    return None


EXTENSION_ERROR: str | None = build_mismatch()
try:
    if EXTENSION_ERROR is not None:
        warnings.warn(EXTENSION_ERROR, RuntimeWarning, stacklevel=2)
        raise ImportError(EXTENSION_ERROR)
    from . import _C  # noqa: F401  (empty module: importing it runs the C++ registrars)
except ImportError as exc:  # no build, or a build for another torch
    _C = None
    EXTENSION_ERROR = str(exc)
    if not hasattr(torch.ops.hebrus, "ple_conv"):  # the C++ registrars did not run
        _fallback_library = torch.library.Library("hebrus", "DEF")
        for _schema in SCHEMAS.values():
            _fallback_library.define(_schema)

OP_NAMES = tuple(SCHEMAS)


def _ple_conv_into_composite(x, weight, cu_seqlens, state, dilation, activation, y, new_state) -> None:
    """ple_conv_into where the device has no kernel of it: the device's ple_conv (its native kernel
    where one is built, as on MPS; else the reference), then a copy into the buffers."""
    reference.ple_conv_into_via(torch.ops.hebrus.ple_conv.default, x, weight, cu_seqlens, state, dilation,
                                activation, y, new_state)


# CompositeExplicitAutograd covers every backend that has no kernel of its own, so a native CPU or
# MPS kernel wins where it is registered and the reference runs everywhere else (CUDA, XPU, ...).
_COMPOSITE = {name: getattr(reference, name) for name in OP_NAMES}
_COMPOSITE["ple_conv_into"] = _ple_conv_into_composite
for _name in OP_NAMES:
    torch.library.impl(f"hebrus::{_name}", "CompositeExplicitAutograd")(_COMPOSITE[_name])


def _raise_no_backward(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"derivative for hebrus::{name} is not implemented")
    return backward


if _fallback_library is not None:
    # What csrc/library.cpp registers for the compiled ops: backward through an op raises instead of
    # giving no gradient. (ple_conv_into's composite writes with copy_, which autograd tracks itself.)
    # (The slot ops mutate their pool and gdn_delta_rule its state: register_autograd does not take
    # mutable ops; the composites' in-place writes are tracked by autograd itself.)
    for _name in OP_NAMES:
        if _name not in ("ple_conv_into", "ple_ngram_ids_slots", "ple_conv_slots", "gdn_delta_rule",
                         "gdn_delta_rule_slots", "gdn_chunk_delta_rule_slots"):
            torch.library.register_autograd(f"hebrus::{_name}", _raise_no_backward(_name), lib=_fallback_library)


def has_native_kernel(op: str, device_type: str) -> bool:
    """True when ``hebrus::<op>`` has a compiled kernel for ``device_type`` ("cpu", "mps", ...).

    While the device type is emulated on CPU (``hebrus_torch._emulate``), the answer is the emulated
    device's list (``_emulate.NATIVE_OPS``), what a build for that device has."""
    from . import _emulate

    if device_type == _emulate.emulated_device_type():
        return op in _emulate.NATIVE_OPS[device_type]
    key = {"cpu": "CPU", "mps": "MPS", "cuda": "CUDA"}.get(device_type, device_type.upper())
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"hebrus::{op}", key))

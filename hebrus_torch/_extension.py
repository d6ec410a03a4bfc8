"""Loads the compiled kernels and registers each op's composite wherever no native kernel exists.

Which ops exist, their schemas and composites are :mod:`hebrus_torch._op_registry`'s; ``has_native_kernel``
and ``OP_NAMES`` are re-exported from there (callers import them from here)."""

from __future__ import annotations

import json
import os
import warnings

import torch

from ._op_registry import OP_NAMES, OPS, has_native_kernel
from ._torch_support import minor, supported_range_text, unsupported_torch

__all__ = ["BUILD_INFO", "EXTENSION_ERROR", "OP_NAMES", "build_info", "build_mismatch", "has_native_kernel"]

_fallback_library: torch.library.Library | None = None  # the schemas, where no compiled extension defined them


BUILD_INFO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_info.json")


def build_info(path: str = BUILD_INFO) -> dict[str, str] | None:
    """What setup.py recorded of the build: ``{"torch": version built against, "cxx": C++ standard}``
    (older builds record only the torch), or None where nothing readable was recorded."""
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def build_mismatch(path: str = BUILD_INFO, running: str = torch.__version__) -> str | None:
    """Why the compiled extension must not be loaded: it was built against another torch minor series
    (setup.py records the version in _build_info.json) and its registrars would run torch C++ code of
    another ABI. None: load (also when nothing was recorded). The message says to rebuild."""
    built = (build_info(path) or {}).get("torch")

    def series(version: str) -> str:
        try:
            return minor(version)
        except ValueError:
            return str(version)

    if built is None or series(built) == series(running):
        return None
    if unsupported_torch(running) is None:
        rebuild = ("rebuild it against this torch: pip install --no-build-isolation -e . (or without -e), "
                   "see docs/install.md")
    else:
        rebuild = (f"torch {running} is outside the supported range ({supported_range_text()}): install one of "
                   f"those and rebuild it (pip install --no-build-isolation -e .)")
    return (f"hebrus_torch's extension was built against torch {built}, this is torch {running}: "
            f"it is not loaded and every op runs its PyTorch reference; {rebuild}")


EXTENSION_ERROR: str | None = build_mismatch()
try:
    if EXTENSION_ERROR is not None:
        warnings.warn(EXTENSION_ERROR, RuntimeWarning, stacklevel=2)
        raise ImportError(EXTENSION_ERROR)
    from . import _C  # noqa: F401  (empty module: importing it runs the C++ registrars)
except ImportError as exc:  # no build, or a build for another torch
    _C = None
    EXTENSION_ERROR = EXTENSION_ERROR or (
        f"the compiled extension could not be imported ({exc}): every op runs its PyTorch reference; build it "
        f"against this torch: pip install --no-build-isolation -e . (or without -e), see docs/install.md")
    if not hasattr(torch.ops.hebrus, "ple_conv"):  # the C++ registrars did not run
        _fallback_library = torch.library.Library("hebrus", "DEF")
        for _spec in OPS.values():
            _fallback_library.define(_spec.schema)

# CompositeExplicitAutograd covers every backend that has no kernel of its own, so a native CPU or
# MPS kernel wins where it is registered and the composite runs everywhere else (CUDA, XPU, ...).
for _spec in OPS.values():
    torch.library.impl(f"hebrus::{_spec.name}", "CompositeExplicitAutograd")(_spec.composite)


def _raise_no_backward(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"derivative for hebrus::{name} is not implemented")
    return backward


if _fallback_library is not None:
    # What csrc/library.cpp registers for the compiled ops: backward through an op raises instead of
    # giving no gradient. (register_autograd does not take mutable ops: ple_conv_into and the slot ops
    # write their buffers or pool, gdn_delta_rule its state; autograd tracks their composites' in-place
    # writes itself.)
    for _spec in OPS.values():
        if not _spec.mutates:
            torch.library.register_autograd(f"hebrus::{_spec.name}", _raise_no_backward(_spec.name),
                                            lib=_fallback_library)


"""Loads the compiled kernels and registers the reference kernel wherever no native one exists."""

from __future__ import annotations

import torch

from . import reference
from ._schemas import SCHEMAS

try:
    from . import _C  # noqa: F401  (empty module: importing it runs the C++ registrars)

    EXTENSION_ERROR: str | None = None
except ImportError as exc:  # no build, or a build for another torch
    _C = None
    EXTENSION_ERROR = str(exc)
    if not hasattr(torch.ops.hebrus, "ple_conv"):  # the C++ registrars did not run
        _fallback_library = torch.library.Library("hebrus", "DEF")
        for _schema in SCHEMAS.values():
            _fallback_library.define(_schema)

OP_NAMES = tuple(SCHEMAS)

# CompositeExplicitAutograd covers every backend that has no kernel of its own, so a native CPU or
# MPS kernel wins where it is registered and the reference runs everywhere else (CUDA, XPU, ...).
for _name in OP_NAMES:
    torch.library.impl(f"hebrus::{_name}", "CompositeExplicitAutograd")(getattr(reference, _name))


def has_native_kernel(op: str, device_type: str) -> bool:
    """True when ``hebrus::<op>`` has a compiled kernel for ``device_type`` ("cpu", "mps", ...)."""
    key = {"cpu": "CPU", "mps": "MPS", "cuda": "CUDA"}.get(device_type, device_type.upper())
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"hebrus::{op}", key))

"""What torch's MPS backend does with each ATen op, read from the installed torch's ``native_functions.yaml``.

The emulator (``hebrus_torch._emulate``) runs a CPU wheel, whose dispatch tables say nothing about what
a Mac's torch registers for MPS. The list of ATen ops and their backends ships with every wheel, under
``torchgen/packaged/ATen/native/native_functions.yaml``; this module reads it (once per process, about
0.2 s with PyYAML's C loader) and answers, for an op overload, one of:

- :data:`KERNEL`: the op (or, for a structured op, its ``out=`` delegate) has an ``MPS:`` dispatch
  entry: one dispatch on the device;
- :data:`COMPOSITE`: ``CompositeExplicitAutograd`` / ``CompositeExplicitAutogradNonFunctional``
  (or an ``autogen`` variant) and no MPS entry: on MPS it runs that composite, which dispatches other
  ops and may read the device (``_grouped_mm`` copies its offsets to the host and runs one ``mm`` per
  group). The emulator runs the composite itself on the emulated tensors, so its ops and reads are
  counted one by one;
- :data:`IMPLICIT`: ``CompositeImplicitAutograd`` (or no dispatch entry at all): decomposed above the
  backend; when one reaches the emulator anyway, its decomposition runs;
- :data:`NO_KERNEL`: backends listed but neither MPS nor a composite: on a Mac the op fails (or, with
  ``PYTORCH_ENABLE_MPS_FALLBACK=1``, copies its inputs to the CPU, runs there and copies back);
- :data:`UNLISTED`: not in the file (an op registered outside it); the emulator counts it as one
  dispatch and reports it.

The file is parsed at run time rather than turned into a data file in the repository so that the
answer always belongs to the torch that is installed (a torch upgrade changes the MPS coverage; a
copied list would silently go stale). What the file does not say: the handful of ops
``aten/src/ATen/mps/MPSFallback.mm`` sends to the CPU by hand (e.g. ``linalg_svd``), and the MPS
kernels that refuse some dtypes or shapes at run time.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .errors import HebrusError

__all__ = ["COMPOSITE", "IMPLICIT", "KERNEL", "NO_KERNEL", "UNLISTED", "mps_kind", "native_functions_path",
           "op_kinds"]

KERNEL = "kernel"
COMPOSITE = "composite"
IMPLICIT = "implicit"
NO_KERNEL = "no_kernel"
UNLISTED = "unlisted"

_EXPLICIT_KEYS = frozenset({"CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional"})


def native_functions_path() -> Path:
    """The installed torch's ``native_functions.yaml`` (shipped under ``torchgen/packaged``)."""
    import torchgen

    path = Path(torchgen.__file__).resolve().parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    if not path.is_file():
        raise HebrusError(f"_mps_ops: {path} is missing from the installed torch {torch.__version__}")
    return path


def _load(path: Path) -> list[dict]:
    try:
        import yaml
    except ImportError as err:                  # transformers (the `hf` extra) depends on it
        raise HebrusError("_mps_ops: reading native_functions.yaml needs PyYAML (pip install pyyaml)") from err

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=loader)


def _own_kind(entry: dict) -> str | None:
    """The kind an entry's own ``dispatch:`` gives (None: it has none)."""
    dispatch = entry.get("dispatch")
    if not dispatch:
        return None
    keys = {k.strip() for spec in dispatch for k in str(spec).split(",")}
    if "MPS" in keys:
        return KERNEL
    if keys & _EXPLICIT_KEYS:
        return COMPOSITE
    if "CompositeImplicitAutograd" in keys:
        return IMPLICIT
    return NO_KERNEL


@functools.lru_cache(maxsize=None)
def op_kinds(path: str | None = None) -> dict[str, str]:
    """``"name.overload"`` (``"name"`` for the default overload) -> its kind on MPS, for every op of the file."""
    entries = _load(Path(path) if path else native_functions_path())
    own: dict[str, str | None] = {}
    delegate: dict[str, str] = {}
    autogen: list[str] = []
    for entry in entries:
        name = str(entry["func"]).split("(", 1)[0].strip()
        own[name] = _own_kind(entry)
        if entry.get("structured_delegate"):
            delegate[name] = str(entry["structured_delegate"]).strip()
        autogen += [a.strip() for a in str(entry.get("autogen", "")).split(",") if a.strip()]
    kinds: dict[str, str] = {}
    for name, kind in own.items():
        if kind is None or kind == IMPLICIT:
            # A structured op's functional / in-place forms run their out= delegate's backend kernels.
            kind = own.get(delegate[name]) or NO_KERNEL if name in delegate else IMPLICIT
        elif kind != KERNEL and name in delegate and own.get(delegate[name]) == KERNEL:
            kind = KERNEL
        kinds[name] = kind
    for name in autogen:                    # generated as CompositeExplicitAutograd(NonFunctional) kernels
        kinds.setdefault(name, COMPOSITE)
    return kinds


def _key(op: torch._ops.OpOverload) -> str:
    base = op._schema.name.split("::", 1)[-1]
    return f"{base}.{op._overloadname}" if op._overloadname not in ("", "default") else base


def mps_kind(op: torch._ops.OpOverload) -> str:
    """What MPS does with the ATen overload ``op`` (see the module docstring); other namespaces: UNLISTED."""
    if op.namespace != "aten":
        return UNLISTED
    return op_kinds().get(_key(op), UNLISTED)

"""What one engine step launches and waits for on an emulated device, per part of the model.

``count_step(engine)`` runs one ``engine.step()`` of an engine built inside ``hebrus_torch._emulate.emulate``
(its model on the emulated device) and counts, per part of the step (:data:`PARTS`):

- dispatches: ATen ops that launch work on the device (views and allocations excluded), plus one per
  hebrus op that is native there; a hebrus op without a native kernel counts the ops of its reference;
- syncs: host reads of device data (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask
  indexing, ...: ``_emulate``'s "sync" kind), each with the source line that asked for it;
- uploads: host-to-device copies (the host does not wait for them);
- what torch's MPS backend does with each ATen op, from its ``native_functions.yaml``
  (``hebrus_torch._mps_ops``): a composite is counted by the ops it runs and the host reads it makes
  (``composites``, ``composite_reads``), an op with no MPS kernel is listed (``no_kernel``).

The part is the innermost one the runner names (``ModelRunner.parts``); work outside the runner's
model forward (scheduling, opening and committing the transaction, sampling) is "engine".

    with emulate("mps") as dev:
        engine = Engine(model.to(dev), config)
        engine.add_request(prompt, max_new_tokens=8)
        counts = count_step(engine)          # the prefill chunk
        counts = count_step(engine)          # a decode step
"""

from __future__ import annotations

import collections
import traceback
from dataclasses import dataclass, field

from .. import _emulate

__all__ = ["PARTS", "StepCounts", "count_step"]

# The runner's part names -> the rows of the report.
PARTS: dict[str, str] = {
    "gdn": "linear_attention (GDN)",
    "attention": "indexed attention (QSA)",
    "ple": "PLE",
    "moe": "MoE / dense MLP",
    "hyper-connections": "hyper-connections",
    "native layer": "native decoder-layer calls (CPU; models/qwen4_exp/native.py)",
    "mtp": "the MTP block's K/V writes",
    "transaction": "cache transaction (reserve, commit)",
    "other": "other (embedding, rope, lm_head)",
    "engine": "engine (schedule, sample)",
}


@dataclass
class StepCounts:
    """Counts of one step, keyed by the :data:`PARTS` labels."""

    dispatches: collections.Counter = field(default_factory=collections.Counter)
    syncs: collections.Counter = field(default_factory=collections.Counter)
    uploads: collections.Counter = field(default_factory=collections.Counter)
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    """(part, hebrus op) -> times it ran as its reference (no native kernel on the device)."""
    ops: dict[str, collections.Counter] = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    """part -> ATen/hebrus op name -> dispatches."""
    sync_sites: collections.Counter = field(default_factory=collections.Counter)
    """(part, what, "file:line" in hebrus_torch or the caller) -> syncs there."""
    composites: collections.Counter = field(default_factory=collections.Counter)
    """(part, ATen op) -> times MPS ran it as a composite (its ops are in the dispatches, one by one)."""
    composite_reads: collections.Counter = field(default_factory=collections.Counter)
    """(part, ATen op) -> host reads of the device inside that composite (``_grouped_mm``'s offsets)."""
    entries: collections.Counter = field(default_factory=collections.Counter)
    """part -> times the step entered it (a decoder layer enters "gdn" or "attention" once, "moe" once,
    "hyper-connections" three times; divide by the layers to get a part's count per layer)."""
    no_kernel: collections.Counter = field(default_factory=collections.Counter)
    """(part, ATen op) -> times the step used an op MPS has no kernel for (it would fail on a Mac, or
    run on the CPU with ``PYTORCH_ENABLE_MPS_FALLBACK=1``)."""

    @property
    def total_dispatches(self) -> int:
        return sum(self.dispatches.values())

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    def table(self) -> list[tuple[str, int, int, int]]:
        """(part, dispatches, syncs, uploads) rows in :data:`PARTS` order, then a total row."""
        rows = [(label, self.dispatches[label], self.syncs[label], self.uploads[label])
                for label in PARTS.values()
                if self.dispatches[label] or self.syncs[label] or self.uploads[label]]
        rows.append(("total", self.total_dispatches, self.total_syncs, sum(self.uploads.values())))
        return rows


_SKIP = frozenset({__file__, _emulate.__file__})


def _site() -> str:
    """The innermost frame outside the emulator and this module: where the sync was asked for."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")
        if frame.filename in _SKIP or "/torch/" in name or name.endswith("/contextlib.py"):
            continue
        short = name.split("hebrus_torch/", 1)[-1] if "hebrus_torch/" in name else name.rsplit("/", 2)[-1]
        return f"{short}:{frame.lineno}"
    return "?"


class _CountingList(list):
    """The runner's part stack, counting each part entered (under its :data:`PARTS` label)."""

    def __init__(self, entries: collections.Counter) -> None:
        super().__init__()
        self._entries = entries

    def append(self, part: str) -> None:
        self._entries[PARTS[part]] += 1
        super().append(part)


def count_step(engine) -> StepCounts:
    """Run ``engine.step()`` once and count what it dispatched and where the host waited.

    The engine's model must be on the device being emulated (``hebrus_torch._emulate.emulate``).
    Returns the counts; the step's outputs are in ``counts.outputs``. Raises ``EmulationError`` when the
    step failed (the engine retries and fails requests rather than raising; such counts mean nothing).
    """
    if _emulate.emulated_device_type() is None:
        raise _emulate.EmulationError("count_step: run it inside `with hebrus_torch._emulate.emulate(...)`")
    counts = StepCounts()
    runner = engine.runner
    parts = _CountingList(counts.entries)
    saved, runner.parts = runner.parts, parts

    def observe(kind: str, name: str) -> None:
        label = PARTS[parts[-1]] if parts else PARTS["engine"]
        if kind == "dispatch":
            counts.dispatches[label] += 1
            counts.ops[label][name] += 1
        elif kind == "sync":
            counts.syncs[label] += 1
            counts.sync_sites[(label, name, _site())] += 1
        elif kind == "upload":
            counts.uploads[label] += 1
            counts.dispatches[label] += 1
            counts.ops[label]["upload"] += 1
        elif kind == "fallback":
            counts.fallbacks[(label, name)] += 1
        elif kind == "composite":
            counts.composites[(label, name)] += 1
        elif kind == "composite_sync":
            counts.composite_reads[(label, name)] += 1
        elif kind == "no_kernel":
            counts.no_kernel[(label, name)] += 1

    failed = engine.counters.failed_steps
    try:
        with _emulate.observe(observe):
            counts.outputs = engine.step()
    finally:
        runner.parts = saved
    if engine.counters.failed_steps != failed:      # the engine caught it: the counts are of a broken step
        errors = sorted({o.request.error for o in counts.outputs if o.request.error})
        raise _emulate.EmulationError(f"count_step: the step failed under emulation: {errors}")
    return counts

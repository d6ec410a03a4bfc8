"""Timing helpers shared by the benchmarks: median wall time, copy bandwidth, results file."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import time
from typing import Callable

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def timeit(fn: Callable[[], object], device: str = "cpu", repeat: int = 5, warmup: int = 1,
           min_time: float = 0.0, cold: bool = False) -> float:
    """Median seconds per call over ``repeat`` timed calls (after ``warmup`` untimed ones); with ``cold``
    (CPU), each timed call follows flush_caches()."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    while len(times) < repeat or sum(times) < min_time:
        if cold and device == "cpu":
            flush_caches()
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


BANDWIDTH_NOTE = "best over 8 fresh pairs of 512 MiB buffers of 3 copies each, read + write counted"


def bandwidth_note() -> str:
    """BANDWIDTH_NOTE, plus the development VM's drift where the run is on that VM (2 cores)."""
    if os.cpu_count() == 2:
        return (BANDWIDTH_NOTE + "; the shared 2-core development VM's bandwidth switches between two levels, "
                "about 40 and 75 GB/s, each lasting seconds to minutes")
    return BANDWIDTH_NOTE


_FLUSH: torch.Tensor | None = None


def flush_caches(megabytes: int = 1024) -> None:
    """Reads and writes a buffer far larger than any last-level cache (the 16-core host's is 300 MiB),
    so that the next timed call finds its data in DRAM, as a decode step does after the other layers."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.zeros(megabytes * (1 << 20) // 4)
    _FLUSH.add_(1.0)


_PROBE: tuple[torch.Tensor, torch.Tensor] | None = None


def copy_sample() -> float:
    """The copy bandwidth at this moment, in bytes/s: one timed copy of 256 MiB into a buffer allocated once
    (read + write counted). The shared 2-core development VM's bandwidth switches between two levels (about
    40 and 75 GB/s) that each last seconds to minutes, so a limit measured once may belong to another level
    than the call it divides; a sample taken next to each call does not."""
    global _PROBE
    if _PROBE is None:
        src = torch.ones(64 << 20)
        _PROBE = (src, src.clone())
    src, dst = _PROBE
    t0 = time.perf_counter()
    dst.copy_(src)
    return 2 * src.numel() * 4 / (time.perf_counter() - t0)


def timeit_cold_paired(fn: Callable[[], object], repeat: int = 24) -> tuple[float, list[tuple[float, float]]]:
    """Times ``repeat`` single CPU calls, each after flush_caches() and followed by a copy_sample() (one
    untimed call first): (median seconds, [(seconds, bytes/s)] of every timed call and the copy bandwidth
    measured right after it)."""
    fn()
    pairs = []
    for _ in range(repeat):
        flush_caches()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        pairs.append((seconds, copy_sample()))
    return statistics.median(t for t, _ in pairs), pairs


def copy_bandwidth(device: str = "cpu", megabytes: int = 512, buffers: int = 8, repeat: int = 3) -> float:
    """Measured device copy bandwidth in bytes/s: read + write of a large buffer into a preallocated
    one, the best copy over ``buffers`` freshly allocated pairs (memory placement changes the figure
    on a shared VM; the best is the limit the machine reaches, so fractions of it are never
    flattered by an unlucky buffer)."""
    n = megabytes * (1 << 20) // 4
    best = float("inf")
    for _ in range(buffers):
        src = torch.ones(n, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync(device)
        for _ in range(repeat):
            t0 = time.perf_counter()
            dst.copy_(src)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        del src, dst
    return 2 * n * 4 / best


def machine(device: str = "cpu") -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def write_section(title: str, body: str) -> None:
    """Replace the ``## title`` section of benchmarks/RESULTS.md where it stands, or append it."""
    text = open(RESULTS).read() if os.path.exists(RESULTS) else "# Benchmark results\n"
    head = f"## {title}\n"
    section = head + body.rstrip("\n") + "\n"
    start = text.find(head)
    if start >= 0:
        end = text.find("\n## ", start + len(head))
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(RESULTS, "w") as f:
        f.write(text)


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def command_line(script: str, parser: argparse.ArgumentParser, args: argparse.Namespace, given: dict | None = None,
                 skip: tuple[str, ...] = ("no_write", "write")) -> str:
    """``python benchmarks/<script>`` with the options whose values differ from ``parser``'s defaults: what
    reproduces the run, without the defaults. ``given``: options always shown, with these values (e.g. one read
    from a checkpoint rather than given); ``skip``: options never shown (they do not change what is measured)."""
    given = given or {}
    parts = [f"python benchmarks/{script}"]
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or isinstance(action, argparse._HelpAction):
            continue
        value = given.get(action.dest, getattr(args, action.dest))
        if action.dest not in given and value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                parts.append(flag)
            continue
        parts += [flag, shlex.quote(f"{value:g}" if isinstance(value, float) else str(value))]
    return " ".join(parts)

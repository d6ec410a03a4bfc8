"""Where a decode step of the drop-in goes: kernels launched per module, patched vs transformers.

One decode step after a prompt of ``--tokens`` on ``bench_model``'s random Qwen4Exp, both paths on the
same weights and cache. Every ATen op that runs on the device (views excluded) is counted under the
innermost module class of the decoder layer that is running (``Qwen4ExpTextQSAIndexer``,
``Qwen4ExpTextPLELayer``, the attention, the MoE block...), which is what a launch-bound device pays for.
Then ``--steps`` decode steps are timed without hooks, each path on a copy of the prefill's cache, the
paths interleaved ``--repeat`` times (min and median per path). On CUDA the patched path also runs with
``HEBRUS_CUDA_GRAPHS=0``.

``--emulate mps`` (or ``HEBRUS_EMULATE_DEVICE=mps``) runs on CPU inside ``hebrus_torch._emulate.emulate``:
the tensors report device "mps", so every branch MPS takes is taken (the Metal-kernel ops native, the
others as their reference) and the launches counted are the emulator's dispatches. ``--emulate-cuda``
on CPU takes the path CUDA takes (device-side checks, no native kernels) by patching those choices:
CUDA's runtime queries (transformers' MoE asks ``torch.cuda.get_device_capability``, CUDA graphs) rule
out tensors that claim the device. Either way the timings are CPU timings of that path. Prints only;
nothing is written to RESULTS.md.

    python benchmarks/profile_decode.py --device cuda --tokens 2048 --steps 64
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench_model import build
from common import sync

from hebrus_torch import _emulate
from hebrus_torch.integrations import transformers as htx

_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "squeeze", "unsqueeze", "transpose", "permute", "t",
          "slice", "select", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow",
          "flatten", "unflatten", "_reshape_alias", "lift_fresh", "chunk", "movedim", "view_as"}


class LaunchCount(TorchDispatchMode):
    """ATen ops on tensors (views excluded) under the module stack's innermost named module."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = ["(model)"]
        self.counts: collections.Counter = collections.Counter()
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in _VIEWS:
            self.record(name)
        return func(*args, **(kwargs or {}))

    def record(self, name: str) -> None:
        self.counts[self.stack[-1]] += 1
        self.ops[self.stack[-1]][name] += 1

    @contextlib.contextmanager
    def counting(self, emulated: bool):
        """Count the ops of the block: as this dispatch mode, or (emulating) from the emulator's dispatches,
        which count a hebrus op without a native kernel as the ops of its reference."""
        if not emulated:
            with self:
                yield
            return
        with _emulate.observe(lambda kind, name: self.record(name) if kind in ("dispatch", "upload") else None):
            yield


def hook_modules(model, counter: LaunchCount):
    handles = []
    for mod in model.modules():
        cls = type(mod).__name__
        if not cls.startswith("Qwen4Exp") or cls.endswith(("ForCausalLM", "Model", "DecoderLayer")):
            continue
        handles.append(mod.register_forward_pre_hook(lambda m, a, c=cls: counter.stack.append(c) and None))
        handles.append(mod.register_forward_hook(lambda m, a, o: counter.stack.pop() and None))
    return handles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--emulate", choices=sorted(_emulate.EMULATED_DEVICE_TYPES), default=_emulate.from_env(),
                        help="emulate this device type on CPU (default: $HEBRUS_EMULATE_DEVICE)")
    parser.add_argument("--emulate-cuda", action="store_true")
    parser.add_argument("--ops", action="store_true", help="list the ops of every module")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.emulate_cuda:
        from hebrus_torch import _extension, reference
        from hebrus_torch.integrations.qwen4_exp import indexer, ple
        from hebrus_torch.reference import attention, checks, qsa
        from hebrus_torch.reference import ple as ple_reference
        for module in (reference, checks, ple_reference, qsa, attention):   # each family reads its own name
            module.checks_async = lambda device: True
        ple_reference._silu = torch.nn.functional.silu    # CUDA's SiLU (the CPU kernel's bits are CPU-only)
        import hebrus_torch
        for op in ("qsa_pool", "qsa_select", "qsa_attention", "ple_conv", "ple_ngram_ids"):
            setattr(hebrus_torch, op, getattr(reference, op))  # what CUDA runs instead of the C++ kernels
        _extension.has_native_kernel = indexer.has_native_kernel = ple.has_native_kernel = lambda *a, **k: False
    model = build("cpu" if args.emulate else args.device, args.layers)
    with (_emulate.emulate(args.emulate) if args.emulate else contextlib.nullcontext(None)) as emulated:
        run(args, model if emulated is None else model.to(emulated), emulated)


def run(args, model, emulated: torch.device | None) -> None:
    dev = emulated if emulated is not None else args.device
    host = "cpu" if emulated is not None else args.device            # what common.sync waits on
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 32000, (1, args.tokens), generator=gen).to(dev)
    steps = torch.randint(4, 32000, (1, args.steps + 1), generator=gen).to(dev)
    paths = {"transformers": (False, "1"), "patched": (True, "1")}
    if dev == "cuda":
        paths = {"transformers": (False, "1"), "patched, no CUDA graphs": (True, "0"), "patched": (True, "1")}
    elif emulated is not None:
        paths = {"transformers": (False, "0"), "patched": (True, "0")}       # no CUDA graphs on CPU
    counters, times = {}, {name: [] for name in paths}
    with torch.no_grad():
        htx.apply(model)
        cache = model(ids, use_cache=True).past_key_values       # the patched prefill's cache serves both
        for name, (patched, graphs) in paths.items():
            (htx.apply if patched else htx.revert)(model)
            os.environ["HEBRUS_CUDA_GRAPHS"] = graphs
            counter = counters[name] = LaunchCount()
            handles = hook_modules(model, counter)
            c = copy.deepcopy(cache)
            model(steps[:, :1], past_key_values=c, use_cache=True)          # warm (and capture)
            with counter.counting(emulated is not None):
                model(steps[:, 1:2], past_key_values=c, use_cache=True)
            for h in handles:
                h.remove()
        for _ in range(args.repeat):                 # the paths interleaved: drift hits all of them alike
            for name, (patched, graphs) in paths.items():
                (htx.apply if patched else htx.revert)(model)
                os.environ["HEBRUS_CUDA_GRAPHS"] = graphs
                c = copy.deepcopy(cache)
                sync(host)
                t0 = time.perf_counter()
                for i in range(args.steps):
                    model(steps[:, i:i + 1], past_key_values=c, use_cache=True)
                sync(host)
                times[name].append((time.perf_counter() - t0) / args.steps)
    htx.revert(model)
    os.environ.pop("HEBRUS_CUDA_GRAPHS", None)
    names = sorted(set().union(*(c.counts for c in counters.values())))
    print(f"{'module':40s}" + "".join(f" {p:>24s}" for p in paths))
    for n in names:
        print(f"{n:40s}" + "".join(f" {counters[p].counts[n]:24d}" for p in paths))
    print(f"{'total':40s}" + "".join(f" {sum(counters[p].counts.values()):24d}" for p in paths))
    base = times["transformers"]
    for name, ts in times.items():
        print(f"{name}: ms/step min {min(ts) * 1e3:.2f}, median {statistics.median(ts) * 1e3:.2f} over {len(ts)} runs "
              f"of {args.steps} steps; transformers / this: {min(base) / min(ts):.2f}x (min), "
              f"{statistics.median(base) / statistics.median(ts):.2f}x (median)")
    if args.ops:
        for name, counter in counters.items():
            print(name)
            for n, ops in sorted(counter.ops.items()):
                print(f"  {n}: {dict(ops.most_common())}")


if __name__ == "__main__":
    main()

"""Where a 1-request decode step of the engine goes on CPU (issue 37's one-person case).

One request of ``--prompt`` tokens on the small random Qwen4Exp that llama.cpp can convert
(:func:`llamacpp_variant`: bench_engine's model with one PLE layer, ``ple_embed_dim`` = hidden and a sigmoid
output gate; ``--model engine`` takes bench_engine's own), one thread. After the prefill, ``--steps``
decode steps are timed per phase (CPU time of the process, one thread: on a shared machine wall time also
counts the other jobs' turns; the phases are wrapped here, the engine is not changed):

- schedule: ``Engine.step`` before the plan runs (cancellations, drafts, the scheduler and cache manager),
- pack: the runner's tensors of the step (``Batch.from_rows``, the logits' row indices),
- transaction open / commit: ``ModelCache.transaction``'s entry (reservations, savepoints, staging) and exit,
- the forward's parts (``ModelRunner.timings``: ple, hyper-connections, gdn, attention, moe) and the rest of
  the forward (embedding, rope rows, the final mixer), ``lm_head``,
- sampling (the consume callback: the step's one read of the logits), update (``apply_step``).

The state holders' calls inside those phases (:data:`HOLDER_CALLS`: the QSA cache's reserve, write, plan and commit,
the GDN and PLE holders' conv, delta rule and n-gram ids) are timed too, inclusively, in a table of their own.

Then the ATen ops of one step are recorded (a ``TorchDispatchMode``; views included, as the dispatcher
runs them) and replayed on their recorded arguments in a tight loop, without the Python that issued them:
the replay's time is what the dispatcher and the kernels cost; the step's time less the replay's is the
Python around them. The replay of the matrix products alone (``mm``, ``addmm``, ``hebrus::moe_experts``,
``hebrus::moe_shared_expert``) is the floor the weights' reads set. A last table says what the step reads and
calls: the weights its matrix products read (and their replay's rate), the ATen calls it makes counting those its
ops make inside (``torch.profiler``), and one ``hebrus::hc_premix`` from C++: the ATen calls its CPU kernel makes
and its time (before issue 37's own CPU arithmetic it ran the module's 88-call ATen sequence). Prints the tables;
``--write`` puts them in RESULTS.md under ``--section``.

    python benchmarks/profile_engine_decode.py [--steps 64] [--prompt 64] [--write --section TITLE]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, table, write_section  # noqa: E402

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402
from hebrus_torch.engine import engine as engine_module  # noqa: E402
from hebrus_torch import model_cache  # noqa: E402
from hebrus_torch.engine import runner as runner_module  # noqa: E402

GEMMS = {"mm", "addmm", "bmm", "moe_experts", "moe_shared_expert", "linear"}
CLOCK = time.process_time
"""The process's CPU time (one thread): a shared machine's other jobs stretch wall time, far less this."""


LLAMACPP_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
"""The variant's rotary settings. The partial rotary factor must be in the config: llama.cpp's converter
(``conversion/qwen.py``, ``Qwen3NextModel.set_gguf_parameters``) writes ``rope.dimension_count`` as head_dim
times ``rope_parameters.get("partial_rotary_factor", 0.25)``, transformers' Qwen4Exp rotary defaults to 1.0: a
config without it rotates all 64 dimensions in transformers and 16 in llama.cpp. 0.25 is the released model's."""


def llamacpp_variant(seed: int = 0) -> torch.nn.Module:
    """bench_engine's small random Qwen4Exp changed to what llama.cpp's converter takes: PLE on one layer
    (decoder layer 0), ``ple_embed_dim`` = hidden (256), the linear attention's output gate a sigmoid, and
    the rotary factor written out (:data:`LLAMACPP_ROPE`), so that llama.cpp computes the same function."""
    from bench_engine import small_model

    return small_model(seed, ple_layer_ids=[1], ple_embed_dim=256, output_gate_type="sigmoid",
                       rope_parameters=dict(LLAMACPP_ROPE))


class _CpuClock:
    perf_counter = staticmethod(CLOCK)


class Phases:
    """Seconds per phase of the timed steps, by wrapping the engine's callables on one engine instance."""

    def __init__(self, engine: Engine) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.on = False
        runner, cache = engine.runner, engine.cache
        engine.runner.timings = collections.Counter()
        runner_module.time = _CpuClock            # the runner's own part timings on the same clock
        self._wrap(model_cache.Batch, "from_rows", "pack", static=True)
        self._wrap(runner, "lm_head", "lm_head")
        self._wrap(engine_module, "apply_step", "update")
        self._wrap(engine, "_read_tokens", "sampling")
        original = cache.transaction
        phases = self

        @contextlib.contextmanager
        def transaction(batch):
            t0 = CLOCK()
            cm = original(batch)
            step = cm.__enter__()
            phases.add("transaction open", t0)
            try:
                yield step
            except BaseException as err:
                if not cm.__exit__(type(err), err, err.__traceback__):
                    raise
            else:
                t1 = CLOCK()
                cm.__exit__(None, None, None)
                phases.add("transaction commit", t1)

        cache.transaction = transaction

    def add(self, name: str, t0: float) -> None:
        if self.on:
            self.seconds[name] += CLOCK() - t0

    def _wrap(self, owner, attr: str, name: str, static: bool = False) -> None:
        wrapped = timing(getattr(owner, attr), self.add, name)
        setattr(owner, attr, staticmethod(wrapped) if static else wrapped)


def timing(fn, add, name: str):
    """``fn`` wrapped so that each call ends with ``add(name, t0)``, t0 its start on :data:`CLOCK` (``add`` decides
    whether the seconds count)."""

    def wrapped(*args, **kwargs):
        t0 = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            add(name, t0)

    return wrapped


HOLDER_CALLS = (("QSACache", ("reserve", "write", "plan", "_plan_rows", "_txn_prepare", "_txn_commit")),
                ("GDNState", ("conv", "delta_rule")), ("PLEState", ("ngram_ids", "conv")))
"""The state holders' methods a decode step calls, timed by :class:`HolderTimers` (inclusive: ``plan`` holds
``_plan_rows``)."""


class HolderTimers:
    """CPU seconds per step in the holders' methods (:data:`HOLDER_CALLS`), wrapped on their classes while
    ``on``; restored by :meth:`close`."""

    def __init__(self) -> None:
        from hebrus_torch.gdn.state import GDNState
        from hebrus_torch.ple.state import PLEState
        from hebrus_torch.qsa.cache import QSACache

        self.seconds: collections.Counter = collections.Counter()
        self.on = False
        self._saved = []
        classes = {"QSACache": QSACache, "GDNState": GDNState, "PLEState": PLEState}
        for cls_name, names in HOLDER_CALLS:
            cls = classes[cls_name]
            for name in names:
                self._wrap(cls, name, f"{cls_name}.{name}")

    def add(self, label: str, t0: float) -> None:
        if self.on:
            self.seconds[label] += CLOCK() - t0

    def _wrap(self, cls, name: str, label: str) -> None:
        fn = getattr(cls, name)
        self._saved.append((cls, name, fn))
        setattr(cls, name, timing(fn, self.add, label))

    def close(self) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)


class Recorder(TorchDispatchMode):
    """Every ATen / hebrus op a block dispatches, with its arguments (for the replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def replay_seconds(calls: list[tuple], repeat: int = 20) -> float:
    """Median seconds of running ``calls`` back to back (the dispatcher and the kernels, no Python around)."""
    times = []
    for _ in range(repeat):
        t0 = CLOCK()
        for func, args, kwargs in calls:
            func(*args, **kwargs)
        times.append(CLOCK() - t0)
    return statistics.median(times)


def weight_bytes(calls: list[tuple]) -> int:
    """Bytes of weights the recorded matrix products read: each ``mm`` / ``addmm`` / ``linear``'s weight operand,
    ``hebrus::moe_shared_expert``'s three projections and, for ``hebrus::moe_experts``, the gate_up and down rows of
    the experts its ids hit."""
    total = 0
    for func, args, _ in calls:
        name = func.overloadpacket.__name__
        if name in ("mm", "linear"):
            w = args[1]
        elif name == "addmm":
            w = args[2]
        elif name == "moe_shared_expert":              # (x, routed, gate_proj, up_proj, down_proj, gate)
            total += sum(w.numel() * w.element_size() for w in args[2:5])
            continue
        elif name == "moe_experts":
            hit = torch.unique(args[1]).numel()
            total += hit * (args[3][0].numel() * args[3].element_size() + args[4][0].numel() * args[4].element_size())
            continue
        else:
            continue
        total += w.numel() * w.element_size()
    return total


def nested_aten_calls(engine: Engine, steps: int = 4) -> float:
    """ATen / hebrus calls per decode step counting those ops make inside (a ``linear`` is ``t``, ``matmul``, ``mm``,
    ...; a CPU fused op runs its ATen sequence): the events ``torch.profiler`` records, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    return sum(e.count for e in prof.key_averages() if "::" in e.key) / steps


def native_call_cost(model, calls: int = 2000) -> tuple[int, float]:
    """(ATen calls nested in one ``hebrus::hc_premix``, microseconds per call of it), at a decode step's shapes (one
    row), warm: its CPU kernel's three small ``mm`` and allocations, its row arithmetic in between (before, when it
    ran the module's ATen sequence, time / calls was what an ATen call costs from C++)."""
    from torch.profiler import ProfilerActivity, profile

    from hebrus_torch.hc.premix import hyper_premix

    hc = model.model.layers[0].attn_hyper_connection
    h = torch.randn(1, hc.hc_count * hc.hidden_size)
    for _ in range(100):
        hyper_premix(hc, h)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        hyper_premix(hc, h)
    nested = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    t0 = CLOCK()
    for _ in range(calls):
        torch.ops.hebrus.hc_premix.default(h, hc.hc_norm.weight, hc.input_mix_weight_down.weight,
                                           hc.input_mix_weight_up.weight, hc.block_inject_weight.weight,
                                           hc.hc_count, float(hc.hc_norm.eps))
    return nested, (CLOCK() - t0) / calls * 1e6


def build_engine(model, prompt: list[int], new: int) -> Engine:
    engine = Engine(model, EngineConfig(capacity_tokens=len(prompt) + new + 64, max_sequences=1,
                                        max_batch_tokens=512, block_size=256))
    engine.add_request(prompt, request_id="r", max_new_tokens=new, eos_token_id=-1)
    return engine


def measure(model, prompt: list[int], steps: int) -> tuple[dict, int, dict]:
    """Per-phase ms of a decode step (median step; phases averaged), ops per step and the replay split."""
    engine = build_engine(model, prompt, steps + 8)
    phases = Phases(engine)
    holders = HolderTimers()
    with torch.inference_mode():
        engine.step()                                            # the prefill
        engine.step()
        per_step = []
        engine.runner.timings = collections.Counter()            # the timed steps' parts only (not the prefill's)
        phases.on = holders.on = True
        for _ in range(steps):
            t0 = CLOCK()
            engine.step()
            per_step.append(CLOCK() - t0)
        phases.on = holders.on = False
        holders.close()
        forward_seconds = dict(engine.runner.timings)
        recorder = Recorder()
        with recorder:
            engine.step()
        t_step = statistics.median(per_step)
        parts = {k: v / steps for k, v in phases.seconds.items()}
        parts.update({f"forward: {k}": v / steps for k, v in forward_seconds.items()})
        forward_parts = sum(v for k, v in parts.items() if k.startswith("forward: "))
        named = sum(parts.values())
        parts["other (forward's embedding / rope / mixer, runner, engine glue)"] = statistics.mean(per_step) - named
        calls = recorder.calls
        replay_all = replay_seconds(calls)
        replay_gemm = replay_seconds([c for c in calls if c[0].overloadpacket.__name__ in GEMMS])
        nested = nested_aten_calls(engine)
        premix_calls, premix_us = native_call_cost(model)
    ops = collections.Counter(c[0].overloadpacket.__name__ for c in calls)
    split = {"step (median)": t_step, "ATen ops replayed (dispatch + kernels)": replay_all,
             "of which matrix products (mm, moe_experts)": replay_gemm,
             "Python around the ops (step - replay)": t_step - replay_all, "forward parts": forward_parts}
    read = weight_bytes(calls)
    floor = {"weights the matrix products read per step (MB)": f"{read / 1e6:.1f}",
             "their replay's rate (GB/s)": f"{read / replay_gemm / 1e9:.1f}",
             "ATen / hebrus calls per step, nested ones counted (torch.profiler)": f"{nested:.0f}",
             "one hc_premix from C++ (the ATen calls its CPU kernel makes, us per call)":
                 f"{premix_calls}, {premix_us:.1f}"}
    held = {k: v / steps for k, v in holders.seconds.items()}
    return parts, len(calls), {"split": split, "ops": ops, "mean": statistics.mean(per_step), "floor": floor,
                               "holders": held}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--model", choices=("llamacpp", "engine"), default="llamacpp")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--section", default="One-request decode: host time (issue 37)")
    ap.add_argument("--label", default="", help="what tree this is (a line above the tables)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from bench_engine import small_model

    model = llamacpp_variant() if args.model == "llamacpp" else small_model()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, model.config.vocab_size, (args.prompt,), generator=g).tolist()
    measure(model, prompt, 4)                                       # warm up
    parts, n_ops, info = measure(model, prompt, args.steps)
    mean = info["mean"]
    rows = [[k, f"{v * 1e3:.3f}", f"{100 * v / mean:.0f}%"] for k, v in sorted(parts.items(), key=lambda kv: -kv[1])]
    split = [[k, f"{v * 1e3:.3f}"] for k, v in info["split"].items()]
    top = ", ".join(f"{k} {v}" for k, v in info["ops"].most_common(12))
    load = os.getloadavg()
    text = "\n".join([
        f"{args.label}Machine: {machine()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. Model: "
        f"{'llamacpp_variant' if args.model == 'llamacpp' else 'bench_engine.small_model'}; one request, prompt "
        f"{args.prompt} tokens, {args.steps} decode steps timed (mean {mean * 1e3:.2f} ms of CPU, "
        f"{1 / mean:.0f} tok/s).",
        "",
        table(["phase of a decode step", "ms", "share"], rows),
        "",
        table(["split of one decode step", "ms"], split),
        "",
        table(["what the step reads and calls", ""], [[k, v] for k, v in info["floor"].items()]),
        "",
        table(["the holders' calls in a step (inclusive)", "ms"],
              [[k, f"{v * 1e3:.3f}"] for k, v in sorted(info["holders"].items(), key=lambda kv: -kv[1])]),
        "",
        f"ATen/hebrus ops dispatched per decode step (views included): {n_ops}; most frequent: {top}.",
    ])
    print(text)
    if args.write:
        write_section(args.section, text)


if __name__ == "__main__":
    main()

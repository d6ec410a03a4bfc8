"""Where a 1-request decode step's wall time sits between its native calls (issue 37).

The model is ``profile_engine_decode.llamacpp_variant`` (fp32, one thread), one request of a 64-token random prompt
decoding greedily. The engine's native layer calls (``decode_gdn_layer``, ``decode_attention_layer``,
``decode_ple_gate``, or a layer's call bound ahead, ``BoundLayer``) and its ``lm_head`` projection
(``NativeLayers.project``) are wrapped with
``time.perf_counter`` marks at entry and exit;
each step is then cut into segments (before the first call, each call, each gap between two calls, after the last)
and the median of each segment over ``--steps`` steps is printed, with the median step. The marks cost a few
microseconds each, so the step is a little longer than unmarked. The ``hebrus_torch`` timed is whichever
``PYTHONPATH`` names first (two trees: run it alternately with each).

``--tiny``: the same layer types with weights of 0.6 MB instead of 47 MB (all of them stay in L2), which separates
what the host work and the native calls cost with warm caches from what the weights' streaming adds.

``--replay``: after the timed steps, one more step's ``hebrus`` op calls from Python are recorded (each op and its
arguments) and replayed back to back, alone, ``--replay-rounds`` times: what the step's native calls cost without
the Python around them (the weights streamed as in a step), and so, by difference, what the host work costs.
``qsa_claim_cells`` is left out of the replay (the cells it claims are taken by then); the other ops write the
state they were given again (the engine is not stepped after).

    python benchmarks/profile_step_gaps.py [--steps 1200] [--tiny] [--replay]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TINY = dict(hidden_size=32, ple_embed_dim=32, head_dim=16, indexer_head_dim=16, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, vocab_size=512, ngram_vocab_size_base=512, hc_lowrank=8,
            linear_key_head_dim=8, linear_value_head_dim=8)
"""``--tiny``'s config changes to ``llamacpp_variant``'s (same layer types, PLE layer, experts and rotary)."""


def model_for(tiny: bool) -> torch.nn.Module:
    from bench_engine import small_model
    from profile_engine_decode import LLAMACPP_ROPE, llamacpp_variant

    if not tiny:
        return llamacpp_variant()
    return small_model(0, ple_layer_ids=[1], output_gate_type="sigmoid", rope_parameters=dict(LLAMACPP_ROPE), **TINY)


def mark_calls(marks: list[tuple[str, float]]) -> None:
    """Wrap the native calls and the ``lm_head`` projection (``NativeLayers.project``) with entry / exit marks into
    ``marks``."""
    import hebrus_torch.models.qwen4_exp.native as native

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def marked(*args, **kwargs):
            marks.append((label + ">", time.perf_counter()))
            try:
                return original(*args, **kwargs)
            finally:
                marks.append(("<" + label, time.perf_counter()))
        setattr(owner, name, marked)

    for name in ("decode_gdn_layer", "decode_attention_layer", "decode_ple_gate"):
        wrap(native, name, name.replace("decode_", "").replace("_layer", ""))
    if hasattr(native.NativeLayers, "project"):
        wrap(native.NativeLayers, "project", "lm_head")
    else:                               # (a tree before it: the runner's module-level linear)
        import hebrus_torch.engine.runner as runner
        wrap(runner, "linear", "lm_head")
    bound = getattr(native, "BoundLayer", None)        # (a layer's call bound before the first layer: its op)
    if bound is not None:
        call = bound.__call__

        def marked_bound(self, h):
            label = "gdn" if "gdn" in str(self.op) else "attention"
            marks.append((label + ">", time.perf_counter()))
            try:
                return call(self, h)
            finally:
                marks.append(("<" + label, time.perf_counter()))
        bound.__call__ = marked_bound


def replay_step(engine, rounds: int) -> tuple[float, list[tuple[str, int]]]:
    """One step of ``engine`` with its ``hebrus`` op calls recorded, then those calls (but ``qsa_claim_cells``)
    replayed back to back ``rounds`` times: (the median seconds of a replay, [(op, calls)] in call order)."""
    import torch._ops as torch_ops

    recorded: list[tuple[object, tuple, dict]] = []
    original = torch_ops.OpOverload.__call__

    def recording(self, *args, **kwargs):
        if self.namespace == "hebrus":
            recorded.append((self, args, kwargs))
        return original(self, *args, **kwargs)

    torch_ops.OpOverload.__call__ = recording
    try:
        engine.step()
    finally:
        torch_ops.OpOverload.__call__ = original
    calls = [(op, args, kwargs) for op, args, kwargs in recorded if op.__name__.split(".")[0] != "qsa_claim_cells"]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for op, args, kwargs in calls:
            op._op(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    names: list[tuple[str, int]] = []
    for op, _, _ in recorded:
        name = op.__name__.split(".")[0]
        if names and names[-1][0] == name:
            names[-1] = (name, names[-1][1] + 1)
        else:
            names.append((name, 1))
    return statistics.median(times), names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--tiny", action="store_true", help="weights of 0.6 MB (the same layer types)")
    ap.add_argument("--replay", action="store_true", help="also replay one step's native op calls alone")
    ap.add_argument("--replay-rounds", type=int, default=300)
    args = ap.parse_args()

    from hebrus_torch.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    model = model_for(args.tiny).eval()
    marks: list[tuple[str, float]] = []
    mark_calls(marks)
    g = torch.Generator().manual_seed(1)
    n = args.steps
    engine = Engine(model, EngineConfig(capacity_tokens=n + 200, max_sequences=1, max_batch_tokens=4096,
                                        block_size=256))
    engine.add_request(torch.randint(4, model.config.vocab_size, (64,), generator=g).tolist(), request_id="r",
                       max_new_tokens=n + 20, eos_token_id=-1)
    segments: dict[str, list[float]] = {}
    steps: list[float] = []
    with torch.inference_mode():
        for _ in range(6):
            engine.step()
        for _ in range(n):
            marks.clear()
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            points = [("start", t0), *marks, ("end", t1)]
            for i, ((a, ta), (b, tb)) in enumerate(zip(points, points[1:])):
                segments.setdefault(f"{i:2d} {a} .. {b}", []).append(tb - ta)
            steps.append(t1 - t0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    print(f"weights {weights:.1f} MB; median step {statistics.median(steps) * 1e6:.0f} us over {n} steps")
    host = 0.0
    for name, values in segments.items():
        if len(values) != n:        # (a segment not in every step)
            continue
        median = statistics.median(values) * 1e6
        call = name.split()[1].endswith(">") and name.split()[3].startswith("<")
        host += 0 if call else median
        print(f"{median:8.1f} us  {name}{'' if call else '  (host)'}")
    print(f"{host:8.1f} us  host work, summed")
    if args.replay:
        with torch.inference_mode():
            replayed, names = replay_step(engine, args.replay_rounds)
        step = statistics.median(steps)
        listed = ", ".join(f"{name}{f' x{n}' if n > 1 else ''}" for name, n in names)
        print(f"the step's hebrus op calls ({listed}) replayed alone, but qsa_claim_cells: {replayed * 1e6:.0f} us "
              f"(median of {args.replay_rounds}); the step less them: {(step - replayed) * 1e6:.0f} us")


if __name__ == "__main__":
    main()

"""Structured output's cost (issue 39): what the grammar masks add to an engine step at 1, 8 and 64 constrained
requests against the same requests unconstrained, the masks alone (``constraints.mask_logits``: the host's mask
computation for every row, the one upload, the device's masking), and the time to compile a schema, cold and
cached.

No tokenizer is downloaded: a byte-level BPE of ``--vocab`` ids is trained here on the installed transformers'
modeling sources (code and English text: JSON's punctuation and words merge as in a real vocabulary), and a random
tiny Qwen4Exp of that vocabulary runs the steps (its step is milliseconds, so the masks' share is far larger than
against a real model's step: the absolute figures are what transfer).

    PYTHONPATH=$PWD python benchmarks/bench_structured.py [--vocab 32000] [--steps 12] [--write]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from common import RESULTS  # noqa: E402

SCHEMAS = {
    "enum (1 property)": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                          "required": ["color"], "additionalProperties": False},
    "person (nested, pattern)": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "kind": {"enum": ["person", "robot", "other"]},
            "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]}},
        "required": ["name", "age", "kind", "address"], "additionalProperties": False},
    "50 properties": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]}
                                                       for i in range(50)},
                      "required": [f"field_{i}" for i in range(0, 50, 5)]},
}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "kind": "person",
                  "address": {"city": "London", "zip": "12345"}}, separators=(",", ":"))


def train_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    import transformers

    root = os.path.dirname(transformers.__file__)
    files = sorted(glob.glob(os.path.join(root, "models", "*", "modeling_*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def compile_times(tokenizer, vocab: int) -> list[tuple[str, float, float]]:
    from hebrus_torch.engine.constraints import Constraint, compile_constraint

    rows = []
    for name, schema in SCHEMAS.items():
        cold = compile_constraint(Constraint.json_schema(schema), tokenizer, vocab).seconds
        t0 = time.perf_counter()
        compile_constraint(Constraint.json_schema(schema), tokenizer, vocab)
        rows.append((name, cold, time.perf_counter() - t0))
    return rows


def mask_only(tokenizer, vocab: int, rows: int, device: str) -> float:
    """Median seconds of ``mask_logits`` for ``rows`` constrained rows, each at another point of DOC (the
    ``person`` schema), over every point of DOC."""
    from types import SimpleNamespace

    from hebrus_torch.engine.constraints import Constraint, MaskBuffer, compile_constraint, mask_logits
    from hebrus_torch.engine.logits_layout import LogitsLayout

    compiled = compile_constraint(Constraint.json_schema(SCHEMAS["person (nested, pattern)"]), tokenizer, vocab)
    ids = tokenizer.encode(DOC)
    layout = LogitsLayout.of([1] * rows)
    buffer, times = MaskBuffer(), []
    logits = torch.randn(rows, vocab, device=device)
    for start in range(len(ids) - 1):
        states = []
        for r in range(rows):
            s = compiled.state()
            s.advance(ids[:(start + r) % (len(ids) - 1)])
            states.append(s)
        chunks = [SimpleNamespace(request=SimpleNamespace(constraint=s), drafts=[]) for s in states]
        work = logits.clone()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        mask_logits(chunks, layout, work, buffer)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_times(model, tokenizer, rows: int, constrained: bool, steps: int) -> float:
    """Median seconds of an engine decode step with ``rows`` greedy requests decoding (any JSON object when
    ``constrained``), over the first ``steps`` steps where all of them decode."""
    from hebrus_torch.engine import Engine, EngineConfig
    from hebrus_torch.engine.constraints import Constraint

    engine = Engine(model, EngineConfig(capacity_tokens=rows * 128, max_sequences=rows, max_batch_tokens=rows * 16),
                    tokenizer=tokenizer)
    prompt = tokenizer.encode("Write the record as JSON:")
    for i in range(rows):
        engine.add_request(prompt, request_id=f"r{i}", max_new_tokens=steps + 8, eos_token_id=-1,
                           constraint=Constraint.json_object() if constrained else None)
    times = []
    while engine.has_unfinished() and len(times) < steps:
        decoding = len(engine.scheduler.running) == rows and all(r.generated for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--device", default="cpu", help="where mask_logits' logits live (the engine runs on CPU)")
    parser.add_argument("--write", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(args.vocab)
    vocab = len(tokenizer)
    train_s = time.perf_counter() - t0
    from hebrus_torch.engine.constraints import Constraint, compile_constraint

    t0 = time.perf_counter()
    compile_constraint(Constraint.json_object(), tokenizer, vocab)      # the tokenizer's one-off llguidance table
    first_s = time.perf_counter() - t0
    compiles = compile_times(tokenizer, vocab)
    from json_tokenizer import make_json_model

    model = make_json_model(tokenizer)
    rows = [int(r) for r in args.rows.split(",")]
    table = []
    for n in rows:
        plain = step_times(model, tokenizer, n, False, args.steps)
        masked = step_times(model, tokenizer, n, True, args.steps)
        alone = mask_only(tokenizer, vocab, n, args.device)
        table.append((n, plain, masked, alone))
        print(f"{n:3d} rows: step {plain * 1e3:.2f} ms unconstrained, {masked * 1e3:.2f} ms constrained "
              f"(+{(masked - plain) * 1e3:.2f} ms); mask_logits alone {alone * 1e3:.3f} ms", flush=True)
    for name, cold, cached in compiles:
        print(f"compile {name}: cold {cold * 1e3:.2f} ms, cached {cached * 1e6:.1f} us")
    print(f"tokenizer trained in {train_s:.1f} s ({vocab} ids); first compile (llguidance's tokenizer table) "
          f"{first_s * 1e3:.0f} ms")
    if not args.write:
        return
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = ["\n## Structured output: grammar masks and schema compiles (issue 39)",
           f"Machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread; llguidance "
           f"{_version('llguidance')}. `python benchmarks/bench_structured.py --vocab {args.vocab} --steps "
           f"{args.steps} --rows {args.rows} --device {args.device}`. Load average at the start: {load:.1f}. "
           f"A byte-level BPE of {vocab} ids trained on transformers' modeling sources; a random tiny Qwen4Exp "
           f"of that vocabulary (its decode step is milliseconds: the masks' share of a real model's step is far "
           f"smaller, their absolute time is what transfers). Greedy requests decoding; median over the first "
           f"{args.steps} steps where all of them decode. Constrained: `response_format` json_object (any JSON "
           f"object). `mask_logits` alone: the masks of that many rows, each at another point of a 50-token "
           f"document of the `person` schema (computed on the calling thread, `constraints.MASK_THREADS` 0; on CPU "
           f"unpacked on the host and masked row by row, on a device uploaded once and masked there; logits on "
           f"`{args.device}`), median over the document's points.",
           "",
           "| constrained rows | step, unconstrained ms | step, constrained ms | added ms | added per row ms | "
           "mask_logits alone ms |",
           "|---|---|---|---|---|---|"]
    for n, plain, masked, alone in table:
        out.append(f"| {n} | {plain * 1e3:.2f} | {masked * 1e3:.2f} | {(masked - plain) * 1e3:.2f} | "
                   f"{(masked - plain) * 1e3 / n:.3f} | {alone * 1e3:.3f} |")
    out += ["", f"Schema compile (`compile_constraint`: JSON schema -> llguidance grammar, checked, a first matcher "
                f"built), cold and again (the cache: a dictionary lookup). The tokenizer's llguidance table is built "
                f"once per tokenizer: {first_s * 1e3:.0f} ms here.", "",
            "| schema | cold ms | cached us |", "|---|---|---|"]
    out += [f"| {name} | {cold * 1e3:.2f} | {cached * 1e6:.1f} |" for name, cold, cached in compiles]
    with open(RESULTS, "a") as f:
        f.write("\n".join(out) + "\n")


def _version(name: str) -> str:
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    main()

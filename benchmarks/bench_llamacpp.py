"""One person chatting: a 1-request greedy decode of the engine side by side with llama.cpp (issue 37).

The model is the small random Qwen4Exp llama.cpp's converter takes (``profile_engine_decode.llamacpp_variant``:
hidden 256, 4 layers, PLE on one layer with ``ple_embed_dim`` = hidden, sigmoid output gate, partial rotary 0.25
written in the config, vocab 4096), fp32, one thread. One request of ``--prompt`` random tokens decodes ``--new``
tokens greedily (each step timed in CPU time of the process, which a shared machine's other jobs stretch far
less than wall time; both paths run on this process's one thread):

- the engine (``Engine.step``; decode steps timed, the prefill step not),
- llama.cpp through llama-cpp-python (``Llama.eval`` of one token per step and an argmax of its logits, read
  from the context with ``llama_get_logits_ith``; the prompt's eval not timed), F32 and F16 KV cache, where
  ``llama_cpp`` imports. The model is converted with the converter of the llama.cpp tree given by
  ``--llama-cpp-dir`` (or ``$LLAMA_CPP_DIR``: the sdist's ``vendor/llama.cpp``, which holds
  ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py``); a random model has no tokenizer, so the GGUF gets
  a stand-in vocabulary of 4096 named tokens (ids are fed directly, no BOS added).
- transformers' ``generate`` (greedy), whose tokens both are checked against.

That both compute the same function is checked, not assumed: each row counts its greedy tokens equal to
transformers' (and says where the first one differs), and each llama.cpp row gives the largest difference of
llama.cpp's logits of the prompt (``logits_all``, a separate context, not timed) from transformers'.

Without llama-cpp-python the llama.cpp rows say so and give the figures issue 37 quotes, marked as quoted.
Writes its RESULTS.md section unless ``--no-write``.

    python benchmarks/bench_llamacpp.py [--prompt 64] [--new 64] [--llama-cpp-dir DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

QUOTED = ("issue 37 (quoted, not measured here): llama.cpp of llama-cpp-python 0.3.36 decodes 500-690 tok/s "
          "(a step of 1.5-2.8 ms) on this CPU, one thread, F16 or F32 KV, against the engine's 81-85 tok/s")


def convert_child(llama_dir: str, model_dir: str, outfile: str) -> None:
    """Run llama.cpp's converter on ``model_dir`` (in this process; it is run as a child) with a stand-in
    vocabulary and the PLE shard count the checkpoint holds."""
    import runpy

    sys.path.insert(0, llama_dir)
    sys.path.insert(1, os.path.join(llama_dir, "gguf-py"))
    import conversion.qwen4exp as q

    def set_vocab(self) -> None:
        n = int(self.hparams["vocab_size"])
        w = self.gguf_writer
        w.add_tokenizer_model("whitespace")
        w.add_tokenizer_pre("whitespace")
        w.add_token_list([f"t{i}" for i in range(n)])
        w.add_token_types([1] * n)
        w.add_token_merges(["t 0"])      # llama.cpp reads a "whitespace" vocabulary as BPE: it needs merges
        w.add_eos_token_id(int(self.hparams.get("eos_token_id") or 3))
        w.add_bos_token_id(int(self.hparams.get("bos_token_id") or 1))

    init = q.Qwen4ExpTextModel.__init__

    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        # transformers saves only the shards that hold rows, which may be fewer than split_ngram_parts
        self.hparams["split_ngram_parts"] = sum(".ngram_embedding.shard_" in n for n in self.model_tensors)

    q.Qwen4ExpTextModel.set_vocab = set_vocab
    q.Qwen4ExpTextModel.__init__ = __init__
    script = os.path.join(llama_dir, "convert_hf_to_gguf.py")
    sys.argv = [script, model_dir, "--outfile", outfile, "--outtype", "f32"]
    runpy.run_path(script, run_name="__main__")


def to_gguf(model, llama_dir: str, work: str) -> str:
    model_dir, out = os.path.join(work, "hf"), os.path.join(work, "model.gguf")
    model.save_pretrained(model_dir)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--convert-child", llama_dir, model_dir, out],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp's converter failed:\n{done.stderr[-3000:]}")
    return out


def engine_decode(model, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and the seconds of each decode step (the prefill step, which gives the first token, not
    timed)."""
    from profile_engine_decode import build_engine

    engine = build_engine(model, prompt, new)
    times = []
    with torch.inference_mode():
        engine.step()                           # the prompt (max_batch_tokens 512 >= its length): token 1
        while engine.has_unfinished():
            t0 = time.process_time()
            engine.step()
            times.append(time.process_time() - t0)
    return list(engine.requests["r"].generated), times


def last_logits(llm) -> "numpy.ndarray":
    """The float32 logits ``[vocab]`` of the last token ``llm`` evaluated, a view of llama.cpp's buffer (valid
    until the next eval). Read from the context: without ``logits_all``, llama-cpp-python 0.3.36's ``eval`` no
    longer copies them into ``Llama.scores``, which it leaves unwritten (an argmax of it is of garbage)."""
    import llama_cpp
    import numpy as np

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def open_llama(path: str, n_ctx: int, kv: str, logits_all: bool = False):
    """A llama-cpp-python ``Llama`` of the GGUF at ``path`` on one thread, its KV cache ``kv`` ('f32' or 'f16')."""
    import llama_cpp

    ggml = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[kv]
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=1, n_threads_batch=1,
                           type_k=ggml, type_v=ggml, logits_all=logits_all, verbose=False)


def llamacpp_decode(path: str, prompt: list[int], new: int, kv: str) -> tuple[list[int], list[float]]:
    import numpy as np

    llm = open_llama(path, len(prompt) + new + 16, kv)
    llm.eval(prompt)
    tokens, times = [int(np.argmax(last_logits(llm)))], []
    while len(tokens) < new:
        t0 = time.process_time()
        llm.eval([tokens[-1]])
        tokens.append(int(np.argmax(last_logits(llm))))
        times.append(time.process_time() - t0)
    return tokens, times


def llamacpp_prompt_logits(path: str, prompt: list[int], kv: str) -> "numpy.ndarray":
    """llama.cpp's float32 logits ``[len(prompt), vocab]`` of every prompt position (one eval, ``logits_all``)."""
    import numpy as np

    llm = open_llama(path, len(prompt) + 16, kv, logits_all=True)
    llm.eval(prompt)
    return np.array(llm.scores[:len(prompt)], dtype=np.float32)


def agreement(tokens: list[int], ref: list[int]) -> str:
    """'equal/total', and where the first token differs (0-based) if one does."""
    same = sum(a == b for a, b in zip(tokens, ref))
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    return f"{same}/{len(ref)}" + ("" if first is None else f" (first differs at {first})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="decodes per path (the median step over all is shown)")
    ap.add_argument("--llama-cpp-dir", default=os.environ.get("LLAMA_CPP_DIR"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="One request decoding: engine vs llama.cpp (issue 37)")
    ap.add_argument("--convert-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.convert_child:
        convert_child(*args.convert_child)
        return
    torch.set_num_threads(1)
    from common import machine, table, write_section
    from profile_engine_decode import llamacpp_variant

    model = llamacpp_variant()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, model.config.vocab_size, (args.prompt,), generator=g).tolist()
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=args.new, min_new_tokens=args.new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, args.prompt:].tolist()
        ref_logits = model(torch.tensor([prompt]), use_cache=False).logits[0].float().numpy()
    logit_diff: dict[str, float] = {}
    runs: dict[str, tuple[list[int], list[float]]] = {}
    engine_decode(model, prompt, 4)                                           # warm up
    paths = {"hebrus_torch engine": lambda: engine_decode(model, prompt, args.new)}
    why_not = None
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        why_not = "llama-cpp-python is not installed"
    if why_not is None and not args.llama_cpp_dir:
        why_not = "no --llama-cpp-dir (llama.cpp's converter) given"
    work = tempfile.mkdtemp(prefix="bench_llamacpp_")
    if why_not is None:
        try:
            gguf = to_gguf(model, args.llama_cpp_dir, work)
            for kv in ("f32", "f16"):
                name = f"llama.cpp, {kv.upper()} KV"
                paths[name] = lambda kv=kv: llamacpp_decode(gguf, prompt, args.new, kv)
                logit_diff[name] = float(abs(llamacpp_prompt_logits(gguf, prompt, kv) - ref_logits).max())
        except Exception as err:  # noqa: BLE001 - reported in the results
            why_not = f"conversion failed: {err}"
    for _ in range(args.repeat):                      # interleaved: a slow spell of the machine hits every path
        for name, run in paths.items():
            tokens, times = run()
            prev = runs.get(name, (tokens, []))
            if prev[0] != tokens:
                raise SystemExit(f"bench_llamacpp: {name} decoded different tokens in two runs")
            runs[name] = (tokens, prev[1] + times)
    engine_step = statistics.median(runs["hebrus_torch engine"][1])
    rows = []
    for name, (tokens, times) in runs.items():
        step = statistics.median(times)
        diff = f"{logit_diff[name]:.1e}" if name in logit_diff else "-"
        rows.append([name, f"{step * 1e3:.2f}", f"{1 / step:.0f}", f"{engine_step / step:.2f}",
                     agreement(tokens, ref), diff])
    load = os.getloadavg()
    lines = [
        f"Machine: {machine()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. Model: the llama.cpp-"
        f"convertible small random Qwen4Exp (hidden 256, 4 layers: linear, indexed, linear, indexed; PLE on "
        f"layer 0 with ple_embed_dim 256; sigmoid output gate; partial rotary 0.25; 8 experts top-2; vocab 4096), "
        f"fp32 weights. One request, a {args.prompt}-token random prompt, {args.new} greedy tokens; median decode step (CPU time) over "
        f"{args.repeat} decodes per path, interleaved (the prompt's step not counted); 'engine / this': the "
        f"engine's step over the row's. Tokens compared with transformers' greedy generate; 'prompt logits': the "
        f"largest absolute difference of llama.cpp's logits at the {args.prompt} prompt positions from transformers' "
        f"(largest absolute logit {abs(ref_logits).max():.2f}).",
        "",
        table(["path", "decode step (ms, median)", "tok/s", "engine / this", "tokens = transformers'",
               "prompt logits: largest difference from transformers'"], rows),
    ]
    if why_not is not None:
        lines += ["", f"llama.cpp not measured: {why_not}. For comparison, {QUOTED}."]
    text = "\n".join(lines)
    if not args.no_write:
        write_section(args.section, text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())

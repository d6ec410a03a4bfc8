"""Speculation from the model's own MTP block (issue 38), with a block trained here.

Random MTP weights accept nothing, so the block of the benchmark model is trained first (``--train-seconds``
of CPU on ``--threads`` threads): the model is bench_speculative.py's "copy" model (bench_engine.py's small
Qwen4Exp with its mixing paths scaled, so that its next token depends mostly on the last few; ``--layers``
gives it more decoder layers, so that the one-layer block is a smaller share of a step), its fixed
corpus is its own greedy continuations (``--corpus`` prompts of 64 random tokens, seed 11, 128 tokens each),
and the block learns, at every position p of a continuation, the token after next from the trunk's pre-mixer
streams at p - 1 and the token at p (one draft step, teacher-forced; cross entropy; Adam); with ``--unroll k``
it learns the draft as the drafter runs it, k steps from every frontier, steps 2..k fed its own output streams
(``unrolled_logits``; the loss summed over the k steps). The trained block
is written into the checkpoint in the released layout (``testing.save_mtp``), and the model measured is
that checkpoint loaded by ``hebrus_torch.from_pretrained`` (its MTP block read lazily at the first MTP
engine). A checkpoint that already has its block is measured as it is (``--retrain`` trains again).

Then, on other prompts (64 random tokens, seed 7), 1, 8 (and 64) requests arriving at once, greedy,
``--new`` tokens each: plain decoding, prompt lookup (``--k`` drafts), MTP with the trained block and MTP with
an untrained block (random weights: nothing accepted, the cost of the machinery: the block's K/V written in
every step, the drafting passes, verification and the back-off), and the untrained block without the
back-off (``adaptive=False``: every decode step drafts ``--k`` tokens and all are rejected: its ratio to plain
is the cost of such a step, the number of steps being the same). Per row: tokens/s (median of ``--repeat``
runs, the configurations' order rotating per repeat), each against plain (the median of the per-repeat
ratios), acceptance per draft position (accepted / drafted at positions 1, 2, ...), tokens per verification
row. The greedy tokens of every path are asserted equal to plain decoding's. Every path drafts only in steps where
at most ``SpeculativeConfig.disable_by_batch_size`` requests decode (the default); above that count the rows
"no batch cutoff" measure speculation with the cutoff off. ``--cpu-time`` times runs by the process's CPU time
(one thread; a machine shared with other jobs). ``--nothing-accepted-pairs N`` measures instead, in N paired
rounds, plain decoding against an engine that writes the block's K/V without drafting and against the untrained
block with its back-off (with and without the confidence rule; with its backed-off steps' block writes deferred,
as by default, and written in every step): the cost where nothing is accepted, less noisy
than the table's rotating repeats. The MTP rows draft under ``SpeculativeConfig.confidence_threshold`` (its
default, or ``--threshold``) unless they say "no confidence rule"; ``--baseline-checkpoint`` adds a row for
another checkpoint's block (the same trunk, e.g. one trained teacher-forced) with the rule off.

    python benchmarks/bench_mtp.py [--checkpoint DIR] [--train-seconds 180] [--counts 1,8] [--k 3] [--no-write]
        [--cpu-time]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, machine, table, write_section  # noqa: E402

from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402
from hebrus_torch.engine.speculative import SpecState, SpeculativeConfig  # noqa: E402

PROMPT = 64
CORPUS_NEW = 128
CLOCK = time.perf_counter
"""What a run is timed by: wall time, or the process's CPU time with ``--cpu-time`` (one thread: on a shared
machine wall time also counts the other jobs' turns, CPU time far less)."""


def generate(model, prompts, new: int, spec: SpeculativeConfig | None = None, defer: bool = True) -> dict:
    """One engine run of the prompts (``defer``: the MTP drafter's ``defer_writes``)."""
    cfg = EngineConfig(capacity_tokens=65536, max_sequences=max(8, len(prompts)), max_batch_tokens=512,
                       speculative=spec)
    engine = Engine(model, cfg)
    if engine.mtp_drafter is not None:
        engine.mtp_drafter.defer_writes = defer
    t0 = CLOCK()
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=new, eos_token_id=-1)
    engine.run()
    wall = CLOCK() - t0
    c = engine.counters
    return {"wall": wall, "tokens": sum(len(r.generated) for r in engine.requests.values()),
            "drafted": c.spec_drafted_tokens, "accepted": c.spec_accepted_tokens, "rows": c.spec_verify_rows,
            "steps": c.steps, "passes": getattr(engine.mtp_drafter, "passes", 0),
            "out": {r.request_id: r.generated for r in engine.requests.values()}}


def generate_solo(model, prompts, new: int, spec: SpeculativeConfig | None = None) -> dict:
    """Each prompt run alone (one request, an engine of its own), one after another: ``generate``'s figures summed
    over the prompts (one person's turns: how much a 1-request figure depends on the prompt)."""
    total: dict = {"out": {}}
    for i, p in enumerate(prompts):
        one = generate(model, [p], new, spec)
        for key, value in one.items():
            if key == "out":
                total["out"][f"r{i}"] = value["r0"]
            else:
                total[key] = total.get(key, 0) + value
    return total


def trunk_streams(model, tokens: torch.Tensor) -> torch.Tensor:
    """The trunk's pre-mixer streams [B, T, hc * hidden] (transformers' forward, a hook on the last layer)."""
    got = {}
    hook = model.model.layers[-1].register_forward_hook(lambda mod, args, out: got.__setitem__("h", out))
    try:
        with torch.no_grad():
            model.model(tokens)
    finally:
        hook.remove()
    return got["h"]


class _Keys:
    """The block's K/V of the draft steps run so far (transformers' cache interface, one layer): each step's
    attention sees the earlier steps' keys and its own."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def chain_mask(t: int, first: int, chains: int, step: int) -> torch.Tensor:
    """Bool Tensor[chains, t + (step - 1) * chains]: what draft step ``step`` (1-based, >= 2) of the chains from
    frontiers ``first``, ``first + 1``, ... sees among the keys of step 1 (the t entries a trunk step writes,
    position q built from the trunk's streams at q - 1 and the token at q) and of steps 2..step (``chains``
    entries each, chain c's at position first + c + i - 1): the step-1 entries at positions <= its frontier and
    its own chain's later entries, as the drafter's cache holds them when it runs pass ``step`` from that
    frontier."""
    frontier = first + torch.arange(chains)[:, None]
    trunk = torch.arange(t)[None, :] <= frontier
    own = torch.eye(chains, dtype=torch.bool).repeat(1, step - 1)
    return torch.cat([trunk, own], dim=1)


def unrolled_logits(model, mtp, inputs: torch.Tensor, tokens: torch.Tensor, first: int, unroll: int
                    ) -> list[torch.Tensor]:
    """The draft unrolled ``unroll`` steps from every frontier p >= ``first`` of a batch, as the drafter runs it,
    with the true tokens fed: inputs Tensor[B, T, hc * hidden] (entry q's trunk streams, those at q - 1),
    tokens Tensor[B, T] -> per step j (1-based) the logits Tensor[B, T - first - j, V] of the chains from
    frontiers first .. T - 1 - j (step j of chain p predicts the token at p + j).

    Step 1 is the block over all T entries (causal); step j + 1 of chain p is fed step j's output streams
    (before the mixer) and the token at p + j, at position p + j, and attends to the step-1 entries up to p
    and its own chain's (``chain_mask``; the earlier steps' K/V kept, not recomputed). The indexer must attend
    densely (``train`` replaces its forward)."""
    from hebrus_torch.models.qwen4_exp.mtp import causal_mask, mtp_logits

    batch, t = tokens.shape
    embed, rotary = model.model.embed_tokens, model.model.rotary_emb
    chains = t - 1 - first
    eager = mtp.block.self_attn.config._attn_implementation == "eager"
    keys = _Keys()
    x = mtp.fuse(inputs, embed(tokens))                                                   # step 1: [B, T, W]
    rows = torch.arange(t)
    out = []
    for j in range(1, unroll + 1):
        if j == 1:
            mask = causal_mask(mtp, t, x)
        else:
            mask = chain_mask(t, first, chains, j)[None, None]
            if eager:
                mask = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, torch.finfo(x.dtype).min)
        cos_sin = rotary(x[..., :mtp.hidden_size], (rows + j - 1).view(1, 1, -1).expand(3, batch, -1))
        h = mtp.block(x, position_embeddings=cos_sin, attention_mask=mask.expand(batch, 1, -1, -1),
                      past_key_values=keys)
        h = h[0] if isinstance(h, tuple) else h
        if j == 1:
            h = h[:, first:first + chains]                            # (the chains' first steps)
        out.append(mtp_logits(mtp, model.lm_head, h[:, :chains - (j - 1)]))
        if j < unroll:                              # step j + 1 of chain c: these streams, the token at p_c + j
            nxt = torch.cat([tokens[:, first + j:], tokens[:, -1:].expand(-1, j)], dim=1)[:, :chains]
            x = mtp.fuse(h, embed(nxt))                                # (chains past the end: unused)
            rows = first + torch.arange(chains)
    return out


def train(model, mtp, seconds: float, corpus: int, unroll: int = 1, lr: float = 3e-3, warm: float = 0.0,
          keep: Path | None = None) -> dict:
    """Training of ``mtp`` on the model's greedy continuations; returns what it did.

    ``unroll`` 1: one draft step, teacher-forced (entry p is the trunk's streams at p - 1 and the token at p,
    and predicts the token at p + 1). ``unroll`` k > 1: the draft as the drafter runs it (``unrolled_logits``),
    k steps from every frontier of the continuation, the block fed its own output streams from step 2 on; the
    loss is the sum of the k steps' cross entropies, the gradient flowing through the fed-back streams; the first
    ``warm`` share of ``seconds`` trains one step teacher-forced (a cheaper step: more of them). Adam; the
    learning rate falls linearly from ``lr`` to a tenth of it over ``seconds``. ``keep``: a file the corpus (its
    tokens and the trunk's streams) is read from when it holds this corpus, else written to."""
    g = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    prompts = [torch.randint(4, vocab, (PROMPT,), generator=g).tolist() for _ in range(corpus)]
    kept = torch.load(keep) if keep is not None and keep.exists() else None
    if kept is not None and kept["seqs"].shape == (corpus, PROMPT + CORPUS_NEW):
        seqs, streams = kept["seqs"], kept["streams"]
    else:
        with torch.inference_mode():
            out = generate(model, prompts, CORPUS_NEW)["out"]
        seqs = torch.tensor([p + out[f"r{i}"] for i, p in enumerate(prompts)])           # [N, T]
        streams = torch.cat([trunk_streams(model, seqs[i:i + 8]) for i in range(0, len(seqs), 8)])
        if keep is not None:
            torch.save({"seqs": seqs, "streams": streams}, keep)
    inputs = torch.cat([torch.zeros_like(streams[:, :1]), streams[:, :-1]], dim=1)     # entry p: (h_{p-1}, t_p)
    t = seqs.shape[1]
    indexer = mtp.block.self_attn.indexer
    assert t + unroll <= indexer.token_budget, "training attends densely: sequences within the indexer's budget"
    # (every query sees its whole history)
    indexer.forward = lambda hidden, pe, mask, cache: mask if mask.dtype == torch.bool else mask == 0
    for p in model.parameters():
        p.requires_grad_(False)
    experts = mtp.block.mlp.experts.config          # (the block's own config: per-expert matmuls train faster)
    implementation, experts._experts_implementation = experts._experts_implementation, "eager"
    mtp.train()
    opt = torch.optim.Adam(mtp.parameters(), lr=lr)
    steps, warm_steps, losses, t0 = 0, 0, [], time.perf_counter()
    batch = 8
    while (elapsed := time.perf_counter() - t0) < seconds:
        for group in opt.param_groups:
            group["lr"] = lr * max(0.1, 1.0 - elapsed / seconds)
        idx = torch.randint(0, len(seqs), (batch,))
        tokens = seqs[idx]
        per_step = [torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                      tokens[:, PROMPT + j:PROMPT + j + logits.shape[1]].reshape(-1))
                    for j, logits in enumerate(unrolled_logits(model, mtp, inputs[idx], tokens, PROMPT - 1,
                                                               1 if elapsed < warm * seconds else unroll))]
        loss = sum(per_step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        losses.append([x.item() for x in per_step])
        warm_steps += elapsed < warm * seconds
    del indexer.forward
    experts._experts_implementation = implementation
    mtp.eval()
    first = [statistics.mean(col) for col in zip(*losses[:5])]
    last = [statistics.mean(col) for col in zip(*losses[-5:])]
    return {"steps": steps, "seconds": time.perf_counter() - t0, "first": first[0], "last": last[0],
            "first_per_step": first, "last_per_step": last, "unroll": unroll, "lr": lr, "warm_steps": warm_steps,
            "sequences": len(seqs), "tokens": seqs.numel()}


def copy_model(layers: int) -> torch.nn.Module:
    """bench_speculative.py's copy model, with ``layers`` decoder layers (linear and indexed attention in turn;
    4: that model itself)."""
    from bench_speculative import LOCAL_SCALE, local_model

    if layers == 4:
        return local_model()
    from bench_engine import small_model
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling

    config = small_model().config
    config.num_hidden_layers = layers
    config.layer_types = ["linear_attention", "indexed_attention"] * (layers // 2)
    torch.manual_seed(0)
    model = modeling.Qwen4ExpForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv1d" in name or "norm" in name:
                p.normal_(0, 0.1)
            if any(k in name for k in ("o_proj", "out_proj", "down_proj", "value_proj")):
                p.mul_(LOCAL_SCALE)
    return model


def trained_checkpoint(path: Path, seconds: float, corpus: int, threads: int, retrain: bool, layers: int,
                       unroll: int = 1, lr: float = 3e-3, warm: float = 0.0, init: str | None = None) -> tuple:
    from hebrus_torch.loading import from_pretrained
    from hebrus_torch.testing import random_mtp, save_mtp

    if not (path / "config.json").exists():
        copy_model(layers).save_pretrained(path)
    model = from_pretrained(path)
    info = None
    record = path / "mtp_training.json"         # (how the saved block was trained, for a later run's section)
    if retrain or not model.hebrus_checkpoint.mtp:
        torch.set_num_threads(threads)
        mtp = random_mtp(model.config, 5)
        if init is not None:            # (go on from another checkpoint's block: the same trunk)
            from hebrus_torch.engine.mtp import mtp_module

            mtp.load_state_dict(mtp_module(from_pretrained(init)).state_dict())
        info = dict(train(model, mtp, seconds, corpus, unroll, lr, warm, keep=path / "mtp_corpus.pt"),
                    threads=threads, init=init)
        save_mtp(path, mtp)
        record.write_text(json.dumps(info))
        model = from_pretrained(path)
    elif record.exists():
        info = dict(json.loads(record.read_text()), earlier=True)
    return model, info


def per_position(log: list[tuple[int, int]], k: int) -> str:
    """accepted / drafted at each draft position from (drafted, accepted) per verification row."""
    cells = []
    for j in range(k):
        drafted = sum(1 for d, _ in log if d > j)
        accepted = sum(1 for d, a in log if d > j and a > j)
        cells.append(f"{accepted / drafted:.2f}" if drafted else "-")
    return " / ".join(cells)


def nothing_accepted_pairs(model, untrained, counts: list[int], k: int, new: int, pairs: int) -> tuple[list, str]:
    """The cost where nothing is accepted, paired: per count, ``pairs`` rounds of plain decoding, the block's K/V
    written without speculating (``SpeculativeConfig(0, method="mtp")``) and the untrained block with the
    back-off (its backed-off steps' block writes deferred, as by default, and written in every step), one after
    another in each round; per row the median of the per-round ratios of time to plain."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    configs = {"plain": (None, True), "MTP block's K/V written, no drafts": (SpeculativeConfig(0, method="mtp"), True),
               "MTP untrained, back-off": (SpeculativeConfig(k, method="mtp"), True),
               "MTP untrained, back-off, block written every step": (SpeculativeConfig(k, method="mtp"), False),
               "MTP untrained, back-off, no confidence rule": (SpeculativeConfig(k, method="mtp",
                                                                                confidence_threshold=0.0), True)}
    rows = []
    model.mtp = untrained
    for n in counts:
        prompts = [torch.randint(4, vocab, (PROMPT,), generator=g).tolist() for _ in range(n)]
        times: dict[str, list[float]] = {name: [] for name in configs}
        with torch.inference_mode():
            generate(model, prompts[:1], 4)
            for _ in range(pairs):
                for name, (spec, defer) in configs.items():
                    times[name].append(generate(model, prompts, new, spec, defer)["wall"])
        for name in configs:
            ratio = statistics.median(p / t for p, t in zip(times["plain"], times[name]))
            rows.append([str(n), name, f"{1e3 * statistics.median(times[name]) / new:.2f}", f"{ratio:.3f}x"])
            print(rows[-1], flush=True)
    text = table(["requests", "path", "time per generated token of a request (ms, median)", "vs plain (median of rounds)"],
                 rows)
    return rows, text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="/tmp/hebrus_bench_mtp")
    ap.add_argument("--train-seconds", type=float, default=300.0)
    ap.add_argument("--corpus", type=int, default=32)
    ap.add_argument("--unroll", type=int, default=1,
                    help="draft steps trained (1: teacher-forced; k: the draft unrolled as the drafter runs it)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--init-checkpoint", default=None,
                    help="train on from this checkpoint's MTP block (the same trunk) instead of a random one")
    ap.add_argument("--warm", type=float, default=0.0,
                    help="with --unroll: the share of --train-seconds trained teacher-forced first")
    ap.add_argument("--threshold", type=float, default=None,
                    help="the 'MTP trained' and 'MTP untrained' rows' confidence_threshold (default: the config's)")
    ap.add_argument("--baseline-checkpoint", default=None,
                    help="also measure this checkpoint's MTP block (same trunk), the confidence rule off")
    ap.add_argument("--paths", default=None, help="path names to measure, separated by ';' (default: all)")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--layers", type=int, default=4, help="the copy model's decoder layers (even; for a new checkpoint)")
    ap.add_argument("--threads", type=int, default=2, help="threads while training")
    ap.add_argument("--bench-threads", type=int, default=1)
    ap.add_argument("--counts", default="1,8")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--solo", type=int, default=1,
                    help="the 1-request row runs this many prompts, each alone, one after another (times summed)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="Speculation from the MTP block, trained here (issue 38)")
    ap.add_argument("--cpu-time", action="store_true", help="time runs by the process's CPU time, not wall time")
    ap.add_argument("--nothing-accepted-pairs", type=int, default=0,
                    help="instead of the table: N paired rounds of plain / K/V written only / untrained block")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    path = Path(args.checkpoint)
    path.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    model, info = trained_checkpoint(path, args.train_seconds, args.corpus, args.threads, args.retrain, args.layers,
                                     args.unroll, args.lr, args.warm, args.init_checkpoint)
    layers = model.config.num_hidden_layers
    print("training:", info, flush=True)
    torch.set_num_threads(args.bench_threads)
    from hebrus_torch.engine.mtp import mtp_module
    from hebrus_torch.testing import random_mtp

    trained = mtp_module(model)                     # (read from the checkpoint's files now)
    untrained = random_mtp(model.config, 6).to(trained.fc_hidden.weight.dtype)
    vocab = model.config.vocab_size
    threshold = SpeculativeConfig(args.k).confidence_threshold if args.threshold is None else args.threshold
    paths = {"prompt lookup": (SpeculativeConfig(args.k), None),
             "MTP trained": (SpeculativeConfig(args.k, method="mtp", confidence_threshold=threshold), trained),
             "MTP trained, no confidence rule": (SpeculativeConfig(args.k, method="mtp", confidence_threshold=0.0),
                                                 trained)}
    if args.baseline_checkpoint:         # (the same trunk, another block: e.g. one trained teacher-forced)
        from hebrus_torch.loading import from_pretrained

        baseline = mtp_module(from_pretrained(args.baseline_checkpoint))
        paths["MTP baseline block, no confidence rule"] = (
            SpeculativeConfig(args.k, method="mtp", confidence_threshold=0.0), baseline)
    paths.update({
        "MTP untrained": (SpeculativeConfig(args.k, method="mtp", confidence_threshold=threshold), untrained),
        "MTP untrained, no confidence rule": (SpeculativeConfig(args.k, method="mtp", confidence_threshold=0.0),
                                              untrained),
        "MTP untrained, no back-off": (SpeculativeConfig(args.k, adaptive=False, method="mtp",
                                                         disable_by_batch_size=None, confidence_threshold=0.0),
                                       untrained)})
    if args.paths:
        keep = args.paths.split(";")
        paths = {name: v for name, v in paths.items() if name in keep}
    cutoff = SpeculativeConfig(args.k).disable_by_batch_size
    uncut = {"prompt lookup, no batch cutoff": (SpeculativeConfig(args.k, disable_by_batch_size=None), None),
             "MTP trained, no batch cutoff": (SpeculativeConfig(args.k, method="mtp", disable_by_batch_size=None),
                                              trained)}
    log: list[tuple[int, int]] = []
    update = SpecState.update

    def recording(self, cfg, drafted, accepted):
        log.append((drafted, accepted))
        return update(self, cfg, drafted, accepted)
    if args.nothing_accepted_pairs:
        _, text = nothing_accepted_pairs(model, untrained, [int(x) for x in args.counts.split(",")], args.k,
                                         args.new, args.nothing_accepted_pairs)
        text = (f"`{command_line('bench_mtp.py', ap, args, given={'layers': layers})}`, "
                f"{time.strftime('%Y-%m-%d')}: {machine()}, load average at the start {load_start:.1f}, at the end "
                f"{os.getloadavg()[0]:.1f}. Model: bench_speculative.py's copy model with {layers} decoder layers, a "
                f"random MTP block (nothing accepted). Prompts: {PROMPT} random tokens, {args.new} greedy tokens per "
                f"request, every request at once. Each round runs the paths one after another "
                f"({'CPU time of the process' if args.cpu_time else 'wall time'}); {args.nothing_accepted_pairs} rounds. "
                f"Time per token: the run's time over the tokens one request generates.\n\n" + text)
        print(text)
        if not args.no_write:
            write_section(args.section, text)
        return
    SpecState.update = recording
    g = torch.Generator().manual_seed(7)
    rows = []
    for n in (int(x) for x in args.counts.split(",")):
        prompts = [torch.randint(4, vocab, (PROMPT,), generator=g).tolist() for _ in range(n)]
        solo = n == 1 and args.solo > 1
        if solo:                # (the first is the prompt above; g draws the later rows' prompts as before)
            again = torch.Generator().manual_seed(7)
            prompts = [torch.randint(4, vocab, (PROMPT,), generator=again).tolist() for _ in range(args.solo)]
        chosen = dict(paths, **(uncut if cutoff is not None and n > cutoff else {}))
        names = ["plain", *chosen]
        runs: dict[str, list[dict]] = {name: [] for name in names}
        logs: dict[str, list] = {name: [] for name in names}
        with torch.inference_mode():
            generate(model, prompts[:1], 4)                                              # warm-up
            for i in range(args.repeat):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    spec, mtp = chosen.get(name, (None, None))
                    if mtp is not None:
                        model.mtp = mtp
                    log.clear()
                    runs[name].append((generate_solo if solo else generate)(model, prompts, args.new, spec))
                    logs[name] = list(log)
        model.mtp = trained
        plain = runs["plain"]
        for name in names:
            assert all(r["out"] == plain[0]["out"] for r in runs[name]), f"{name} changed greedy tokens"
            tps = statistics.median(r["tokens"] / r["wall"] for r in runs[name])
            ratio = statistics.median(p["wall"] / r["wall"] for p, r in zip(plain, runs[name]))
            last = runs[name][-1]
            acc = f"{last['accepted'] / last['drafted']:.2f}" if last["drafted"] else "-"
            per_row = f"{(last['accepted'] + last['rows']) / last['rows']:.2f}" if last["rows"] else "-"
            rows.append([f"1 ({args.solo} prompts, each alone)" if solo else str(n), name, f"{tps:.1f}", f"{ratio:.2f}x", acc,
                         per_position(logs[name], args.k) if name != "plain" else "-", per_row, str(last["steps"]),
                         str(last["passes"]) if name.startswith("MTP") else "-"])
            print(rows[-1], flush=True)
    SpecState.update = update
    trained_note = ("the block as the checkpoint had it (not retrained in this run)" if info is None else
                    f"trained {info['seconds']:.0f} s ({info['steps']} Adam steps of 8 sequences, {info['sequences']} "
                    f"sequences of {PROMPT} + {CORPUS_NEW} tokens; "
                    + (f"{info.get('warm_steps', 0)} of them one step teacher-forced, then the draft unrolled "
                       f"{info['unroll']} steps"
                       + (f" (from the block of {info['init']})" if info.get("init") else "")
                       + ", cross entropy per step "
                       f"{' / '.join(f'{x:.2f}' for x in info['first_per_step'])} -> "
                       f"{' / '.join(f'{x:.2f}' for x in info['last_per_step'])}"
                       if info.get("unroll", 1) > 1 else
                       f"one draft step, teacher-forced, cross entropy {info['first']:.2f} -> {info['last']:.2f}")
                    + f"; Adam, lr {info.get('lr', 3e-3):g}) on {info['threads']} threads"
                    + (" by an earlier run of this script, not retrained in this one" if info.get("earlier") else ""))
    text = (f"`{command_line('bench_mtp.py', ap, args, given={'layers': layers})}`, {time.strftime('%Y-%m-%d')}: "
            f"{machine()}, "
            f"load average at the start {load_start:.1f}, at the end {os.getloadavg()[0]:.1f}.\n"
            f"Model: bench_speculative.py's copy model (bench_engine.py's small Qwen4Exp, {layers} layers, vocab 4096, "
            f"fp32, mixing paths scaled by 0.01) written as a checkpoint and loaded by from_pretrained, its MTP block "
            f"{trained_note}; untrained = a random block. Prompts: {PROMPT} random tokens (not the training "
            f"corpus's), {args.new} tokens generated per request, greedy, every request at once"
            + (f" (the 1-request row: {args.solo} prompts, each run alone in an engine of its own, one after "
               f"another; times, tokens, steps and counts summed over them)" if args.solo > 1 else "")
            + f"; engine capacity "
            f"65536, max_batch_tokens 512, up to {args.k} drafts per step with the adaptive length, no drafting in "
            f"a step where more than {cutoff} requests decode (the default `disable_by_batch_size`) unless the row "
            f"says 'no batch cutoff' (the 'no back-off' row has no cutoff either); the MTP rows' "
            f"`confidence_threshold` {threshold:g} unless the row says 'no confidence rule' (0). "
            f"tok/s: median of {args.repeat} runs "
            f"({'CPU time of the process' if args.cpu_time else 'wall time'}); vs plain: median of the per-repeat "
            f"ratios of that time; acceptance: accepted / "
            f"drafted, overall and per draft position, of the last run; steps and the MTP drafter's packed passes "
            f"of the last run. Greedy tokens "
            f"asserted equal to plain decoding's in every run.\n\n")
    text += table(["requests", "path", "tok/s", "vs plain", "acceptance", "acceptance per position",
                   "tokens per verification", "steps", "drafting passes"], rows)
    print(text)
    if not args.no_write:
        write_section(args.section, text)


if __name__ == "__main__":
    main()

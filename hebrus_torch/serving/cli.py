"""``python -m hebrus_torch.serve MODEL_DIR [transformers serve options] [--hebrus-* options]``: the hebrus
options are read here, the rest go to transformers' ``Serve`` (the typer command behind ``transformers
serve``), which then builds the patched app (:func:`hebrus_torch.serving.app.patch_transformers_serve`)."""

from __future__ import annotations

import argparse
import os
import sys

from .settings import API_KEY_ENV, HebrusServeSettings

__all__ = ["main", "USAGE"]


def _hebrus_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hebrus_torch.serve", add_help=False)
    p.add_argument("--hebrus-capacity-tokens", type=int, default=None,
                   help="cache cells shared by all requests (default: --cb-num-blocks x --cb-block-size, else 4096)")
    p.add_argument("--hebrus-max-sequences", type=int, default=None,
                   help="requests in flight at once (default 32)")
    p.add_argument("--hebrus-prefix-cache-tokens", type=int, default=None,
                   help="cells kept for finished requests' prefixes (default: half the capacity; 0: off)")
    p.add_argument("--hebrus-no-prefix-sharing", action="store_true",
                   help="no shared prefixes between requests and no prefix cache")
    p.add_argument("--prompt-cache-dir", default=None,
                   help="write finished requests' states to DIR and read them back after a restart")
    p.add_argument("--prompt-cache-max-bytes", type=int, default=None,
                   help="size cap of --prompt-cache-dir, least recently used files deleted first (default 4 GiB)")
    p.add_argument("--hebrus-debug", action="store_true", help="mount POST /hebrus/debug/kill_engine")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="speculative decoding: draft up to N tokens per step (prompt lookup, or --draft-model)")
    p.add_argument("--speculative-method", choices=("ngram", "mtp"), default=None,
                   help="who drafts: ngram (prompt lookup, or --draft-model; the default) or mtp (the checkpoint's "
                        "own MTP block; 3 tokens unless --speculative-tokens says otherwise)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="no request drafts in a step where more than N requests decode (default: the engine's, "
                        "8; 0: no limit)")
    p.add_argument("--speculative-confidence-threshold", type=float, default=None,
                   help="--speculative-method mtp: a draft ends after the first token the MTP block is less sure of "
                        "than this probability (default: the engine's, 0.1; 0: off)")
    p.add_argument("--speculative-first-token-threshold", type=float, default=None,
                   help="--speculative-method mtp: a round proposes nothing for a request whose first drafted token "
                        "the MTP block is less sure of than this probability (default: the engine's, 0.02; 0: off)")
    p.add_argument("--draft-model", default=None,
                   help="a small Qwen4Exp checkpoint with the same tokenizer that drafts for speculation")
    p.add_argument("--ple-table", choices=("auto", "disk", "memory"), default="auto",
                   help="the PLE n-gram table: read from the checkpoint's files, in memory, or auto (disk past a "
                        "quarter of physical memory)")
    p.add_argument("--ple-cache-bytes", type=int, default=None,
                   help="with the table on disk, release its mapped pages past N bytes (default: 1/8 of memory)")
    p.add_argument("--ple-prefetch", choices=("auto", "on", "off"), default="auto",
                   help="with the table on disk, gather each step's rows on a worker thread: on, off, or auto (on "
                        "for a model on CUDA or MPS, off on the CPU)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/*, /hebrus/* and /metrics "
                        f"(default: ${API_KEY_ENV})")
    return p


USAGE = """usage: python -m hebrus_torch.serve MODEL_DIR [transformers serve options] [hebrus options]

Serves MODEL_DIR (a local Qwen4Exp checkpoint) through `transformers serve` with continuous batching on the
hebrus engine. Clients name the model exactly as MODEL_DIR was given (or leave `model` out).

hebrus options:
  --hebrus-capacity-tokens N      cache cells shared by all requests (default: num_blocks x block size, else 4096)
  --hebrus-max-sequences N        requests in flight at once (default: 32)
  --hebrus-prefix-cache-tokens N  cells kept for finished requests (default: half the capacity; 0: off)
  --hebrus-no-prefix-sharing      no shared prefixes between requests and no prefix cache
  --prompt-cache-dir DIR          write finished requests' states to DIR (one file each) and read them back
                                  after a restart: a conversation's next turn prefills only its new tokens
  --prompt-cache-max-bytes N      size cap of DIR, least recently used files deleted first (default: 4 GiB)
  --hebrus-debug                  mount POST /hebrus/debug/kill_engine
  --speculative-tokens N          speculative decoding: every request drafts up to N tokens per step (prompt
                                  lookup over its prompt and output, or --draft-model) and the engine verifies
                                  them in the packed step; greedy output is unchanged (docs/engine.md)
  --speculative-method {ngram,mtp}
                                  who drafts: ngram (prompt lookup, or --draft-model; default) or mtp: the
                                  checkpoint's own MTP block (mtp.*; refused at start without one), 3 tokens
                                  per step unless --speculative-tokens says otherwise
  --speculative-disable-by-batch-size N
                                  no request drafts in a step where more than N requests are decoding (default
                                  8, SpeculativeConfig.disable_by_batch_size; 0: no limit; on a CPU-only server
                                  1 is faster: docs/engine.md)
  --speculative-confidence-threshold P
                                  with --speculative-method mtp, a request's draft ends after the first token
                                  whose probability under the MTP block is below P (default 0.1,
                                  SpeculativeConfig.confidence_threshold; 0: every draft has its full length)
  --speculative-first-token-threshold P
                                  with --speculative-method mtp, a drafting round proposes nothing for a request
                                  whose first drafted token's probability is below P, and counts as a miss for
                                  its back-off (default 0.02, SpeculativeConfig.first_token_threshold; 0: off)
  --draft-model DIR               a small Qwen4Exp checkpoint (same tokenizer) that drafts instead
  --ple-table {auto,disk,memory}  the PLE n-gram table (95 GiB in the released checkpoint): `disk` gathers each
                                  step's rows from the checkpoint's own files (memory-mapped), `memory` holds it
                                  as one tensor, `auto` (default) is disk when it is over a quarter of physical
                                  memory; the log says which ran (docs/ple.md)
  --ple-cache-bytes N             with the table on disk, release the pages it maps past about N bytes (they stay
                                  in the OS page cache); default: an eighth of physical memory
  --ple-prefetch {auto,on,off}    with the table on disk, gather each step's rows on a worker thread while the
                                  layers before the PLE layer run: `auto` (default) is on for a model on CUDA or
                                  MPS and off on the CPU, where the worker competes with torch's threads
  --api-key KEY                   require `Authorization: Bearer KEY` on /v1/*, /hebrus/* and /metrics
                                  (/health stays open); default: the HEBRUS_API_KEY environment variable

transformers serve options (passed through; `--continuous-batching` is added unless
`--no-continuous-batching` is given):
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, rest = _hebrus_parser().parse_known_args(argv)
    if not rest or rest[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        if any(a in ("-h", "--help") for a in rest):
            _run_serve(["--help"])
            return
        raise SystemExit(2)
    if ns.speculative_tokens is not None and not 0 <= ns.speculative_tokens <= 32:
        raise SystemExit(f"--speculative-tokens must be in [0, 32], got {ns.speculative_tokens}")
    if ns.speculative_disable_by_batch_size is not None and ns.speculative_disable_by_batch_size < 0:
        raise SystemExit(f"--speculative-disable-by-batch-size must be >= 0, got {ns.speculative_disable_by_batch_size}")
    for flag in ("confidence", "first_token"):
        value = getattr(ns, f"speculative_{flag}_threshold")
        name = f"--speculative-{flag.replace('_', '-')}-threshold"
        if value is not None and not 0.0 <= value < 1.0:       # (NaN too)
            raise SystemExit(f"{name} must be in [0, 1), got {value}")
        if value is not None and ns.speculative_method != "mtp":
            raise SystemExit(f"{name} applies to --speculative-method mtp only")
    if ns.speculative_method == "mtp" and ns.draft_model is not None:
        raise SystemExit("--speculative-method mtp drafts with the checkpoint's MTP block: leave --draft-model out")
    if ns.draft_model is not None and not os.path.isdir(ns.draft_model):
        raise SystemExit(f"--draft-model: {ns.draft_model!r} is not a directory")
    if ns.prompt_cache_max_bytes is not None and ns.prompt_cache_max_bytes < 1:
        raise SystemExit(f"--prompt-cache-max-bytes must be >= 1, got {ns.prompt_cache_max_bytes}")
    if ns.ple_cache_bytes is not None and ns.ple_cache_bytes < 1:
        raise SystemExit(f"--ple-cache-bytes must be >= 1, got {ns.ple_cache_bytes}")
    if ns.prompt_cache_dir is not None:
        from hebrus_torch.engine.prompt_cache import check_directory

        problem = check_directory(ns.prompt_cache_dir)
        if problem is not None:
            raise SystemExit(f"--prompt-cache-dir: {problem}")
    from .app import patch_transformers_serve
    from .loading import PLEOptions, set_ple_options

    set_ple_options(PLEOptions(table=ns.ple_table, cache_bytes=ns.ple_cache_bytes, prefetch=ns.ple_prefetch))

    patch_transformers_serve(HebrusServeSettings(capacity_tokens=ns.hebrus_capacity_tokens,
                                                 max_sequences=ns.hebrus_max_sequences,
                                                 prefix_cache_tokens=ns.hebrus_prefix_cache_tokens,
                                                 block_sharing=not ns.hebrus_no_prefix_sharing,
                                                 debug=ns.hebrus_debug,
                                                 prompt_cache_dir=ns.prompt_cache_dir,
                                                 prompt_cache_max_bytes=ns.prompt_cache_max_bytes,
                                                 speculative_tokens=ns.speculative_tokens,
                                                 speculative_method=ns.speculative_method or "ngram",
                                                 speculative_disable_by_batch_size=ns.speculative_disable_by_batch_size,
                                                 speculative_confidence_threshold=ns.speculative_confidence_threshold,
                                                 speculative_first_token_threshold=(
                                                     ns.speculative_first_token_threshold),
                                                 draft_model=ns.draft_model,
                                                 api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None))
    if not any(a in ("--continuous-batching", "--no-continuous-batching") for a in rest):
        rest.append("--continuous-batching")
    _run_serve(rest)


def _run_serve(args: list[str]) -> None:
    import typer
    from transformers.cli.serve import Serve

    app = typer.Typer(add_completion=False)
    app.command()(Serve)
    app(args=args, prog_name="python -m hebrus_torch.serve")

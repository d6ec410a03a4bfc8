"""The PLE n-gram table read from disk vs held in memory (issue 35), on a checkpoint of the released shapes per
layer, in one run: process memory (anonymous and file-backed RSS, peak while loading), time to first token of a
long prompt with the shards' page cache dropped and warm, decode tokens/s at 1 and 8 requests; with the table on disk
both with the step's rows prefetched on a worker thread (the default on CUDA and MPS) and gathered in the PLE layer.

    python benchmarks/bench_ple_disk.py --dir /tmp/hebrus-ple-bench [--table-gib 4] [--experts 16] [--prompt 4096]

The checkpoint (written once into --dir by ``hebrus_torch.testing.write_checkpoint``, then its n-gram table
replaced by one of --table-gib written shard by shard): released shapes per layer (hidden 2560, experts x 640
with top 10, GDN 16/48 heads of 128, attention 24/2 heads of 256, indexer 4 x 128, hc 4 / 320, one PLE layer at
index 1 with 16 n-gram heads of 160, 16 table shards), 4 layers (3 linear + 1 indexed), fewer experts than 512
and a vocabulary of 32768 (not 248320) so that it fits this machine; fp32 by default (``--dtype``: this CPU's
bf16 matrix-vector products are some 10x slower than fp32's, which would bury the table's cost). Each mode loads
in its own process (its memory is its own); times are compared inside the disk process, its table swapped for an
in-memory copy between runs; ``--gather-only``: the row store alone. Linux only (/proc/self/status,
posix_fadvise).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

TEXT_PREFIX = "model.language_model."
TABLE = TEXT_PREFIX + "layers.1.ple.ple_embedding"
SHARDS = 16
ROW = 160


def released_shapes(experts: int, base: int):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=32768, hidden_size=2560, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["indexed_attention"],
        num_attention_heads=24, num_key_value_heads=2, head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=experts, num_experts_per_tok=10, moe_intermediate_size=640,
        shared_expert_intermediate_size=640, hc_count=4, hc_lowrank=320, indexer_n_heads=4, indexer_kv_heads=1,
        indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, ple_layer_ids=[2], ngram_size=3,
        heads_per_ngram=8, ngram_vocab_size_base=base, ple_embed_dim=2560, ple_conv_kernel_size=4,
        split_ngram_parts=SHARDS, eos_token_id=3, max_position_embeddings=65536)


# ------------------------------------------------------------------------------------------ the checkpoint
def write(directory: Path, table_gib: float, experts: int, dtype: torch.dtype) -> None:
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m

    from hebrus_torch.testing import write_checkpoint

    rows_wanted = int(table_gib * 2**30) // (ROW * dtype.itemsize)
    base = rows_wanted // 16
    write_checkpoint(directory, released_shapes(experts, 1000), seed=0, dtype=dtype,
                     max_shard_size="2GB", tokenizer=False, mtp=False)
    # the table of `base`: its head sizes as transformers computes them, written shard by shard
    sizes = [m._find_nth_prime_after(base - 1, h + 1) for h in range(16)]
    offsets = [sum(sizes[:h]) for h in range(16)]
    rows = -(-sum(sizes) // 128) * 128
    per_shard = rows // SHARDS
    gen = torch.Generator().manual_seed(1)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {k: v for k, v in index["weight_map"].items() if ".ngram_embedding.shard_" not in k}
    for i in range(SHARDS):
        name = f"ple-table-{i:03d}.safetensors"
        key = f"{TABLE}.ngram_embedding.shard_{i}.weight"
        _write_one_tensor(directory / name, key, per_shard, gen, dtype)
        weight_map[key] = name
    from safetensors.torch import save_file
    buffers = {f"{TABLE}.ngram_heads_vocab_sizes": torch.tensor(sizes, dtype=torch.long),
               f"{TABLE}.ngram_heads_offsets": torch.tensor(offsets, dtype=torch.long)}
    save_file(buffers, str(directory / "ple-buffers.safetensors"), metadata={"format": "pt"})
    weight_map.update({k: "ple-buffers.safetensors" for k in buffers})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["ngram_vocab_size_base"] = base
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {directory}: table {rows} rows x {ROW} {dtype} = {rows * ROW * dtype.itemsize / 2**30:.2f} GiB in "
          f"{SHARDS} files")


def _write_one_tensor(path: Path, key: str, rows: int, gen: torch.Generator, dtype: torch.dtype) -> None:
    nbytes = rows * ROW * dtype.itemsize
    name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    header = json.dumps({key: {"dtype": name, "shape": [rows, ROW], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for start in range(0, rows, 1 << 20):
            n = min(1 << 20, rows - start)
            f.write((torch.randn(n, ROW, generator=gen) * 0.02).to(dtype).view(torch.uint8).numpy().tobytes())


# ------------------------------------------------------------------------------------------ one mode
def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def drop_page_cache(directory: Path, model) -> None:
    """The table's pages out of this process (MADV_DONTNEED) and out of the page cache (POSIX_FADV_DONTNEED)."""
    from hebrus_torch.ple.row_store import DiskNgramEmbedding

    for mod in model.modules():
        if isinstance(mod, DiskNgramEmbedding):
            mod.store.release()
    for file in directory.glob("ple-table-*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ttft(model, prompt: list[int], max_batch_tokens: int, prefetch: bool = True) -> dict:
    """Time to first token of ``prompt`` (seconds; ``cpu_s``: the process's CPU seconds meanwhile, every thread, the
    prefetch worker's included: on a loaded machine the steadier measure of the work), the engine thread's seconds
    in the PLE layer ("ple" of the runner's timings: ids, the gather in place or the wait for the prefetch, upload, the layer's math) and the
    prefetcher's stats (None with prefetch off or the table in memory)."""
    import collections

    from hebrus_torch.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(capacity_tokens=len(prompt) + 64, max_sequences=1,
                                        max_batch_tokens=max_batch_tokens, allow_block_sharing=False,
                                        ple_prefetch=prefetch))
    engine.runner.timings = collections.Counter()
    t0, cpu0 = time.perf_counter(), time.process_time()
    engine.add_request(prompt, request_id="p", max_new_tokens=1, eos_token_id=-1)
    engine.run()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    engine.close()
    prefetcher = engine.runner.forward.prefetcher
    return {"s": seconds, "cpu_s": cpu, "ple_s": engine.runner.timings["ple"],
            "prefetch": None if prefetcher is None else dict(prefetcher.stats)}


def decode_rate(model, requests: int, new_tokens: int, seed: int, prefetch: bool = True) -> tuple[float, float]:
    """Generated tokens per second over the steps in which every request is past its prompt, and per second of
    the process's CPU time over those steps."""
    from hebrus_torch.engine import Engine, EngineConfig

    rng = random.Random(seed)
    engine = Engine(model, EngineConfig(capacity_tokens=requests * (64 + new_tokens + 8), max_sequences=requests,
                                        max_batch_tokens=None, allow_block_sharing=False, ple_prefetch=prefetch))
    for i in range(requests):
        engine.add_request([rng.randrange(4, 32768) for _ in range(32)], request_id=f"r{i}",
                           max_new_tokens=new_tokens, eos_token_id=-1)
    while any(r.num_computed < len(r.prompt) for r in engine.requests.values()):
        engine.step()
    before = sum(len(r.generated) for r in engine.requests.values())
    t0, cpu0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        engine.step()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(r.generated) for r in engine.requests.values()) - before
    engine.close()
    return tokens / seconds, tokens / cpu


def table_modules(model):
    from hebrus_torch.ple.row_store import DiskNgramEmbedding

    return [(owner, owner.ngram_embedding) for owner in model.modules()
            if isinstance(getattr(owner, "ngram_embedding", None), DiskNgramEmbedding)]


def comparison(directory: Path, model, prompt: list[int], chunk: int, new_tokens: int, rounds: int) -> dict:
    """In one process on the same weights, the table on disk (prefetch on and off) and as one tensor in memory
    (an nn.Embedding of the same rows) alternating, medians of ``rounds``: time to first token of ``prompt`` from
    disk with the page cache dropped and warm, and from memory; decode tokens/s at 1 and 8 requests."""
    import gc
    import statistics

    owners = table_modules(model)
    disk = [d for _, d in owners]
    in_memory: list = []
    after_disk: dict[str, int] = {}

    def memory_copy() -> list:
        """(built once, after the first round's disk prefills and decodes: the process's memory is read before)"""
        if not in_memory:
            after_disk.update(status())
            in_memory.extend(torch.nn.Embedding(d.num_embeddings, d.embedding_dim, _weight=d.store.gather(
                torch.arange(d.num_embeddings)), _freeze=True) for d in disk)
        return in_memory

    def use(modules):
        for (owner, _), module in zip(owners, modules):
            owner.ngram_embedding = module

    times: dict[str, list] = {}

    def add(key, value):
        times.setdefault(key, []).append(value)

    for _ in range(rounds):
        use(disk)
        for prefetch in (True, False):
            tag = "prefetch" if prefetch else "inplace"
            drop_page_cache(directory, model)
            add(f"ttft_disk_cold_{tag}", ttft(model, prompt, chunk, prefetch))
            add(f"ttft_disk_warm_{tag}", ttft(model, prompt, chunk, prefetch))
        for label, prefetch in (("disk_prefetch", True), ("disk_inplace", False)):
            for n in (1, 8):
                rate, cpu_rate = decode_rate(model, n, new_tokens, n, prefetch)
                add(f"decode_{label}_x{n}", rate)
                add(f"decode_{label}_x{n}_cpu", cpu_rate)
        use(memory_copy())
        add("ttft_memory", ttft(model, prompt, chunk))
        for n in (1, 8):
            rate, cpu_rate = decode_rate(model, n, new_tokens, n)
            add(f"decode_memory_x{n}", rate)
            add(f"decode_memory_x{n}_cpu", cpu_rate)
    use(disk)
    in_memory.clear()
    gc.collect()

    def median(values):
        if isinstance(values[0], dict):
            return sorted(values, key=lambda v: v["s"])[len(values) // 2]
        return statistics.median(values)
    return {k: median(v) for k, v in times.items()} | {"rounds": rounds, "after_disk_run": after_disk}


def run_mode(directory: Path, mode: str, prompt_len: int, chunk: int, new_tokens: int, rounds: int,
             cache_bytes: int) -> dict:
    import hebrus_torch

    t0 = time.perf_counter()
    model = hebrus_torch.from_pretrained(directory, ple_table=mode, ple_cache_bytes=cache_bytes)
    load_s = time.perf_counter() - t0
    loaded = status()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rng = random.Random(7)
    prompt = [rng.randrange(4, 32768) for _ in range(prompt_len)]
    out = {"mode": mode, "load_s": load_s, "after_load": loaded, "weights_bytes": weights,
           "table_bytes": model.hebrus_checkpoint.ple_table_bytes}
    with torch.inference_mode():
        ttft(model, prompt[:128], chunk)                                     # warm-up (kernels, allocator)
        if mode == "disk":       # (its prefills of the whole prompt are the comparison's)
            out["compare"] = comparison(directory, model, prompt, chunk, new_tokens, rounds)
        else:
            ttft(model, prompt, chunk)
        decode_rate(model, 8, 2, 0)
        out["after_run"] = status()                                          # after a prefill and a decode
        out["store_stats"] = [dict(d.store.stats) for _, d in table_modules(model)]
    return out


def _drop_shards(store, shards) -> None:
    store.release()
    for info in shards:
        fd = os.open(info.file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def gather_costs(directory: Path, repeat: int, overlap_s: float) -> list[dict]:
    """The row store alone, on the checkpoint's table: microseconds per call of a decode step's rows (16 per
    request) and of a 1024-token prefill chunk's (16384), warm (pages in the page cache) against an in-memory
    index_select of the same rows, and cold (the shards' page cache dropped before each call) with and without
    the MADV_WILLNEED hint; and what the engine thread spends with the prefetch (``PLEPrefetcher``: submit, then
    after ``overlap_s`` of other work - a sleep standing for the layers before the PLE layer - take the rows),
    warm and cold."""
    import statistics

    from hebrus_torch.loading.files import CheckpointFiles
    from hebrus_torch.ple.prefetch import PLEPrefetcher, PrefetchLayer
    from hebrus_torch.ple.row_store import PLERowStore, TableShard

    files = CheckpointFiles.open(directory)
    shards = sorted((info for key, info in files.tensors.items() if ".ngram_embedding.shard_" in key),
                    key=lambda i: int(i.key.rsplit("shard_", 1)[1].split(".")[0]))
    store = PLERowStore([TableShard(i.file, i.offset, i.shape[0]) for i in shards], shards[0].dtype, ROW)
    prefetcher = PLEPrefetcher()
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    out = []

    def median_us(fn) -> float:
        return statistics.median(fn(r) for r in range(repeat)) * 1e6

    def prefetched(ids, cold: bool) -> float:
        """The engine thread's seconds: submit + take after the overlap."""
        if cold:
            _drop_shards(store, shards)
        t0 = time.perf_counter()
        rows = prefetcher.submit([PrefetchLayer(1, ids.view(-1, 16), store)], cpu)
        spent = time.perf_counter() - t0
        time.sleep(overlap_s)
        t0 = time.perf_counter()
        rows.rows(1, store.dtype)
        return spent + time.perf_counter() - t0

    for n in (16, 128, 16384):
        ids = [torch.randint(0, store.num_rows, (n,), generator=gen) for _ in range(repeat)]
        resident = torch.cat([store.gather(i) for i in ids])                  # warm the pages, keep the rows
        table_rows = torch.arange(resident.shape[0]).view(repeat, n)

        def timed(fn) -> float:
            times = []
            for r in range(repeat):
                t0 = time.perf_counter()
                fn(r)
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e6

        row = {"rows": n, "warm_us": timed(lambda r: store.gather(ids[r])),
               "memory_us": timed(lambda r: resident.index_select(0, table_rows[r])),
               "prefetch_warm_us": median_us(lambda r: prefetched(ids[r], cold=False))}
        for label, minimum in (("cold_us", PLERowStore.WILLNEED_MIN_ROWS), ("cold_no_hint_us", 10**12)):
            store.WILLNEED_MIN_ROWS = minimum
            fresh = [torch.randint(0, store.num_rows, (n,), generator=gen) for _ in range(repeat)]

            def cold(r):
                _drop_shards(store, shards)
                t0 = time.perf_counter()
                store.gather(fresh[r])
                return time.perf_counter() - t0
            row[label] = median_us(cold)
        del store.WILLNEED_MIN_ROWS
        fresh = [torch.randint(0, store.num_rows, (n,), generator=gen) for _ in range(repeat)]
        row["prefetch_cold_us"] = median_us(lambda r: prefetched(fresh[r], cold=True))
        out.append(row)
    prefetcher.close()
    return out


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--table-gib", type=float, default=4.0)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512, help="engine max_batch_tokens while prefilling")
    p.add_argument("--new-tokens", type=int, default=8, help="decode: tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="decode: alternating disk/memory rounds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ple-cache-bytes", type=int, default=256 << 20, help="disk: the row store's page budget")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the checkpoint's dtype (this CPU's bf16 matrix-vector products are some 10x slower)")
    p.add_argument("--mode", choices=("disk", "memory"), default=None, help="(internal) run one mode")
    p.add_argument("--gather-only", action="store_true", help="only the row store's costs (gather_costs)")
    p.add_argument("--overlap-ms", type=float, default=200.0,
                   help="--gather-only: the work the engine thread does between submitting and taking prefetched rows")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode is not None:
        print("RESULT " + json.dumps(run_mode(args.dir, args.mode, args.prompt, args.chunk, args.new_tokens,
                                              args.rounds, args.ple_cache_bytes)))
        return
    if not (args.dir / "config.json").exists():
        write(args.dir, args.table_gib, args.experts, getattr(torch, args.dtype))
    if args.gather_only:
        print(f"load average at the start {os.getloadavg()}")
        print("| rows per call | warm (page cache) us | in memory (index_select) us | cold, WILLNEED us | "
              f"cold, no hint us | prefetch warm us | prefetch cold us (engine thread; {args.overlap_ms:.0f} ms "
              "overlap) |")
        print("|---|---|---|---|---|---|---|")
        for r in gather_costs(args.dir, repeat=5, overlap_s=args.overlap_ms / 1e3):
            print(f"| {r['rows']} | {r['warm_us']:.0f} | {r['memory_us']:.0f} | {r['cold_us']:.0f} | "
                  f"{r['cold_no_hint_us']:.0f} | {r['prefetch_warm_us']:.0f} | {r['prefetch_cold_us']:.0f} |")
        print(f"load average {os.getloadavg()}")
        return
    print(f"load average at the start {os.getloadavg()}")
    results = []
    for mode in ("disk", "memory"):
        cmd = [sys.executable, __file__, "--dir", str(args.dir), "--mode", mode, "--prompt", str(args.prompt),
               "--chunk", str(args.chunk), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
               "--rounds", str(args.rounds), "--ple-cache-bytes", str(args.ple_cache_bytes)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[0][len("RESULT "):]))
    gib = 2**30
    print(f"table {results[0]['table_bytes'] / gib:.2f} GiB, weights besides it "
          f"{results[0]['weights_bytes'] / gib:.2f} GiB, prompt {args.prompt}, {torch.get_num_threads()} threads, "
          f"disk budget {args.ple_cache_bytes / 2**20:.0f} MiB, store {results[0]['store_stats']}, load average "
          f"{os.getloadavg()}")
    print("| mode | load s | peak RSS while loading | RssAnon after load | RssFile after load | RssAnon after "
          "a prefill and decode | RssFile after |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        a = r["after_load"]
        b = r["compare"]["after_disk_run"] if "compare" in r else r["after_run"]   # (disk: before the memory copy)
        print(f"| {r['mode']} | {r['load_s']:.1f} | {a['VmHWM'] / gib:.2f} GiB | {a['RssAnon'] / gib:.2f} GiB | "
              f"{a['RssFile'] / gib:.2f} GiB | {b['RssAnon'] / gib:.2f} GiB | {b['RssFile'] / gib:.2f} GiB |")
    c = results[0]["compare"]
    mem = c["ttft_memory"]["s"]
    print(f"\nOne process, the same weights, the table on disk (prefetch on / off) and in memory alternating, "
          f"median of {c['rounds']}; TTFT of {args.prompt} tokens:")
    print("| table | page cache | TTFT | / memory | process CPU s | / memory | engine thread in the PLE layer | "
          "prefetch: steps ready / waited, wait |")
    print("|---|---|---|---|---|---|---|---|")
    for key, table, cache in (("ttft_disk_cold_prefetch", "disk, prefetch", "dropped"),
                              ("ttft_disk_cold_inplace", "disk, in place", "dropped"),
                              ("ttft_disk_warm_prefetch", "disk, prefetch", "warm"),
                              ("ttft_disk_warm_inplace", "disk, in place", "warm"), ("ttft_memory", "memory", "-")):
        r = c[key]
        pf = r["prefetch"]
        waited = "-" if pf is None else f"{pf['ready']} / {pf['waits']}, {pf['wait_seconds']:.2f} s"
        print(f"| {table} | {cache} | {r['s']:.1f} s | {r['s'] / mem:.2f}x | {r['cpu_s']:.1f} | "
              f"{r['cpu_s'] / c['ttft_memory']['cpu_s']:.2f}x | {r['ple_s']:.2f} s | {waited} |")
    print("\n| decode | tok/s x1 | tok/s x8 | tok per CPU s x1 | / memory | tok per CPU s x8 | / memory |\n"
          "|---|---|---|---|---|---|---|")
    for label, name in (("disk_prefetch", "disk, prefetch"), ("disk_inplace", "disk, in place"),
                        ("memory", "memory")):
        cpu1, cpu8 = c[f"decode_{label}_x1_cpu"], c[f"decode_{label}_x8_cpu"]
        print(f"| {name} | {c[f'decode_{label}_x1']:.2f} | {c[f'decode_{label}_x8']:.2f} | {cpu1:.2f} | "
              f"{cpu1 / c['decode_memory_x1_cpu']:.3f} | {cpu8:.2f} | {cpu8 / c['decode_memory_x8_cpu']:.3f} |")
    print(f"load average at the end {os.getloadavg()}")
    print("RAW " + json.dumps(results))


if __name__ == "__main__":
    main()

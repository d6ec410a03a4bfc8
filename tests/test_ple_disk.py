"""The PLE n-gram table read from the checkpoint's files (issue 35, docs/ple.md): the row store is exact in every
dtype, releases its pages past its budget, and the engine with the table on disk gives the tokens and the
state of the table in memory under every batch cut, cap, order, prefix sharing, the prompt cache and
speculation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_models import tiny_indexer_config  # noqa: E402  (skips without transformers)
from test_engine import EOS, eager_experts, prompts_for, row_invariant, run_engine  # noqa: F401

import hebrus_torch
from hebrus_torch import HebrusError
from hebrus_torch.engine import Engine, EngineConfig
from hebrus_torch.loading.files import read_header
from hebrus_torch.ple.row_store import DiskNgramEmbedding, PLERowStore, TableShard
from hebrus_torch.testing import write_checkpoint


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def store_of(tmp_path: Path, shards: list[torch.Tensor], files: list[list[int]], **kwargs) -> PLERowStore:
    """``shards`` saved in safetensors files (``files``: which shards go in each), read back as a row store."""
    from safetensors.torch import save_file

    for n, members in enumerate(files):
        save_file({f"shard_{i}": shards[i] for i in members}, str(tmp_path / f"f{n}.safetensors"))
    places = {}
    for n in range(len(files)):
        places.update(read_header(tmp_path / f"f{n}.safetensors"))
    infos = [places[f"shard_{i}"] for i in range(len(shards))]
    return PLERowStore([TableShard(i.file, i.offset, i.shape[0]) for i in infos], shards[0].dtype,
                       shards[0].shape[1], **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_are_bitwise_those_of_the_concatenated_table(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    rows = [37, 64, 5, 50]                                    # shards of unequal sizes, two files
    shards = [(torch.randn(r, 12, generator=gen) * 3).to(dtype) for r in rows]
    store = store_of(tmp_path, shards, [[0, 1], [2, 3]])
    table = torch.cat(shards)
    assert store.num_rows == table.shape[0] and store.dtype == dtype
    for shape in ((40,), (3, 5, 4), (1, 1), (0,), (2, 0, 3)):
        ids = torch.randint(0, table.shape[0], shape, generator=gen)
        got = store.gather(ids)
        assert got.shape == (*shape, 12) and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                           table[ids].view(torch.uint8 if dtype != torch.float32 else torch.int32))
    every = torch.arange(table.shape[0]).flip(0)
    assert torch.equal(store.gather(every), table[every])
    before = dict(store.stats)
    store.gather(torch.tensor([[7, 7, 7], [100, 7, 100]]))
    assert store.stats["rows"] - before["rows"] == 6 and store.stats["unique_rows"] - before["unique_rows"] == 2


def test_ids_outside_the_table_are_refused(tmp_path):
    store = store_of(tmp_path, [torch.zeros(10, 4), torch.ones(6, 4)], [[0, 1]])
    for bad in ([16], [0, -1], [3, 400]):
        with pytest.raises(HebrusError, match=r"row id -?\d+ outside \[0, 16\)"):
            store.gather(torch.tensor(bad))


def _rss_file_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssFile")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssFile from /proc (Linux)")
def test_past_its_budget_the_store_releases_its_pages_and_rows_stay_exact(tmp_path):
    gen = torch.Generator().manual_seed(1)
    shards = [torch.randn(8192, 64, generator=gen) for _ in range(4)]        # 8 MiB of fp32 rows
    table = torch.cat(shards)
    unbounded = store_of(tmp_path, shards, [[0, 1, 2, 3]])
    base = _rss_file_bytes()
    assert torch.equal(unbounded.gather(torch.arange(table.shape[0])), table)
    held = _rss_file_bytes() - base
    assert held > 6 * 2**20                                                   # the pages are mapped in
    unbounded.release()
    assert _rss_file_bytes() - base < held / 4                                # ... and let go

    bounded = store_of(tmp_path, shards, [[0, 1, 2, 3]], cache_bytes=2**20)
    base = _rss_file_bytes()
    for start in range(0, table.shape[0], 1024):
        ids = torch.arange(start, start + 1024)
        assert torch.equal(bounded.gather(ids), table[ids])
    assert bounded.stats["releases"] >= 7
    assert _rss_file_bytes() - base < 4 * 2**20


def test_the_stand_in_has_embeddings_call_and_no_weights(tmp_path):
    shards = [torch.randn(20, 6).to(torch.bfloat16)]
    module = DiskNgramEmbedding(store_of(tmp_path, shards, [[0]]), torch.float32)
    assert list(module.parameters()) == [] and list(module.buffers()) == [] and module.state_dict() == {}
    w = module.weight
    assert w.is_meta and w.shape == (20, 6) and w.dtype == torch.float32
    ids = torch.tensor([[3, 19], [0, 3]])
    assert torch.equal(module(ids), torch.nn.functional.embedding(ids, shards[0].float()))
    assert "on disk" in repr(module)


# ------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ple-disk"), tiny_indexer_config(split_ngram_parts=4), seed=4,
                            dtype=torch.float32, max_shard_size="40KB", tokenizer=False)


def load(checkpoint: Path, ple_table: str):
    model = eager_experts(hebrus_torch.from_pretrained(checkpoint, ple_table=ple_table))
    assert model.hebrus_checkpoint.ple_table == ple_table
    return model


@pytest.mark.parametrize("prefetch", [True, False])
def test_engine_tokens_and_state_with_the_table_on_disk_equal_memory_under_every_cut(checkpoint, row_invariant,
                                                                                      prefetch):
    memory, disk = load(checkpoint, "memory"), load(checkpoint, "disk")
    base = prompts_for(4, lengths=(14, 6, 21, 2))
    shared = base[2][:12]
    prompts = base + [shared + [9, 8, 7], shared + [9, 8, 7, 6, 5]]
    ref_tokens, ref_states = run_engine(memory, prompts, max_batch_tokens=None, allow_block_sharing=False)
    for s in (dict(max_batch_tokens=None, allow_block_sharing=False), dict(max_batch_tokens=1),
              dict(max_batch_tokens=7, max_requests_per_batch=2), dict(max_batch_tokens=16, order=[5, 3, 1, 0, 4, 2]),
              dict(max_batch_tokens=7, allow_block_sharing=True)):
        tokens, states = run_engine(disk, prompts, ple_prefetch=prefetch, **s)
        assert tokens == ref_tokens, s
        assert states == ref_states, s
    assert disk.model.layers[0].ple.ple_embedding.ngram_embedding.store.stats["calls"] > 0


def test_prefix_sharing_with_the_table_on_disk(checkpoint):
    disk = load(checkpoint, "disk")
    shared = prompts_for(5, lengths=(16,))[0]
    prompts = [shared + [10 + i, 20 + i, 30] for i in range(4)]
    engine = Engine(disk, EngineConfig(capacity_tokens=512, max_sequences=8, max_batch_tokens=64, block_size=4))
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=4, eos_token_id=-1)
    engine.run()
    assert engine.counters.prefix_hit_tokens == 3 * 16
    memory_tokens, _ = run_engine(load(checkpoint, "memory"), prompts, max_new_tokens=4, max_batch_tokens=64,
                                  allow_block_sharing=False)
    assert {r: q.generated for r, q in engine.requests.items()} == memory_tokens


def test_the_prompt_cache_with_the_table_on_disk(checkpoint, tmp_path):
    disk = load(checkpoint, "disk")
    turn1 = prompts_for(21, lengths=(14, 5))
    cfg = EngineConfig(capacity_tokens=1024, max_sequences=8, max_batch_tokens=16, block_size=4,
                       prompt_cache_dir=str(tmp_path))
    first = Engine(disk, cfg)
    for i, p in enumerate(turn1):
        first.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=EOS)
    first.run()
    first.close()
    turn2 = [p + first.requests[f"r{i}"].generated + [7, 8, 9] for i, p in enumerate(turn1)]
    second = Engine(load(checkpoint, "disk"), cfg)                  # a restart: a new model, the same files
    for i, p in enumerate(turn2):
        second.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=EOS)
    second.run()
    second.close()
    assert second.counters.prompt_cache_hits == 2
    assert second.counters.prefill_tokens == 2 * 4               # each turn 1 reply's last token and 3 new ones
    memory_tokens, _ = run_engine(load(checkpoint, "memory"), turn2)
    assert {r: q.generated for r, q in second.requests.items()} == memory_tokens


def test_speculation_with_the_table_on_disk_gives_the_plain_tokens(checkpoint):
    disk = load(checkpoint, "disk")
    base = prompts_for(14, lengths=(10, 16))
    prompts = [p + p[:6] + p for p in base]                       # passages that repeat: lookups find drafts
    plain, _ = run_engine(load(checkpoint, "memory"), prompts, max_new_tokens=16)
    engine = Engine(disk, EngineConfig(capacity_tokens=1024, max_sequences=8, max_batch_tokens=16, block_size=4))
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=16, eos_token_id=EOS, speculative=5)
    engine.run()
    assert engine.counters.spec_drafted_tokens > 0
    assert {r: q.generated for r, q in engine.requests.items()} == plain


@pytest.mark.parametrize("how", ["posix_fadvise", "madvise"])
def test_large_gathers_advise_the_kernel_of_every_page_their_rows_touch(tmp_path, monkeypatch, how):
    """WILLNEED ranges (runs of adjacent pages merged) cover every byte of every row gathered, in rows of less and
    more than a page; rows stay exact with the hint on. Where the OS has ``posix_fadvise`` the hint goes through it
    on the file (a call that releases the GIL), else through ``madvise`` on the map (macOS)."""
    import mmap as mmap_module

    if how == "madvise" and not hasattr(mmap_module, "MADV_WILLNEED"):
        pytest.skip("no MADV_WILLNEED here")
    if how == "posix_fadvise" and not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    page = mmap_module.PAGESIZE
    for dim in (40, 3 * page // 4 + 8):                          # fp32 rows of 160 bytes and of 3 pages + 32 bytes
        shards = [torch.randn(300, dim), torch.randn(200, dim)]
        store = store_of(tmp_path, shards, [[0, 1]])
        monkeypatch.setattr(PLERowStore, "WILLNEED_MIN_ROWS", 1)
        advised = []

        class Recording:
            def __init__(self, real):
                self.real = real

            def __len__(self):
                return len(self.real)

            def madvise(self, option, start, length):
                assert how == "madvise" and option == mmap_module.MADV_WILLNEED and start % page == 0
                advised.append((start, start + length))

        def fadvise(fd, start, length, advice):
            assert how == "posix_fadvise" and fd == store._shard_fds[0] and advice == os.POSIX_FADV_WILLNEED
            assert start % page == 0
            advised.append((start, start + length))
        store._shard_maps = [(Recording(m), off) for m, off in store._shard_maps]
        if how == "posix_fadvise":
            assert all(fd is not None for fd in store._shard_fds)
            monkeypatch.setattr(os, "posix_fadvise", fadvise)
        else:
            store._shard_fds = [None] * len(store._shard_fds)
        ids = torch.tensor([0, 1, 2, 57, 58, 299, 300, 301, 450, 499, 3])
        assert torch.equal(store.gather(ids), torch.cat(shards)[ids])
        monkeypatch.undo()
        covered = set()
        for start, stop in advised:
            covered.update(range(start, stop))
        for i in ids.unique().tolist():
            s = 0 if i < 300 else 1
            begin = store._shard_maps[s][1] + (i - (0 if s == 0 else 300)) * store.row_bytes
            assert all(b in covered for b in range(begin, begin + store.row_bytes, 64)), (dim, i)
            assert begin + store.row_bytes - 1 in covered, (dim, i)
        assert len(advised) < ids.numel()                        # adjacent rows' pages went in one call

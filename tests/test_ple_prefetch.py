"""A step's PLE rows gathered off the engine thread (issue 35, docs/ple.md "Prefetch"): the prefetched rows are
bitwise the in-place gather's, the engine gives bitwise the same logits and state with prefetch on and off, a
failure in the worker is that step's error on the engine thread (rolled back, retried, never wedging the
engine), and the worker stops with the engine and the manager."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from hf_models import tiny_indexer_config  # noqa: E402  (skips without transformers)
from test_engine import EOS, eager_experts, prompts_for, row_invariant, run_engine  # noqa: F401
from test_ple_disk import store_of

import hebrus_torch
from hebrus_torch.engine import Engine, EngineConfig, RequestStatus
from hebrus_torch.ple.prefetch import WORKER_NAME, PLEPrefetcher, PLEPrefetchError, PrefetchLayer
from hebrus_torch.ple.row_store import DiskNgramEmbedding
from hebrus_torch.testing import write_checkpoint


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefetched_rows_are_bitwise_the_in_place_gather(tmp_path, dtype):
    gen = torch.Generator().manual_seed(3)
    shared = store_of(tmp_path, [(torch.randn(r, 10, generator=gen) * 4).to(dtype) for r in (30, 41)], [[0], [1]])
    (tmp_path / "other").mkdir()
    other = store_of(tmp_path / "other", [torch.randn(25, 7, generator=gen).to(dtype)], [[0]])
    ids = {0: torch.randint(0, 71, (5, 6), generator=gen), 2: torch.randint(0, 71, (5, 6), generator=gen),
           3: torch.randint(0, 25, (5, 4), generator=gen), 4: torch.randint(0, 71, (0, 6), generator=gen)}
    ids[2][0] = ids[0][0]                                          # rows both layers read: gathered once
    stores = {0: shared, 2: shared, 3: other, 4: shared}
    prefetcher = PLEPrefetcher()
    try:
        for out_dtype in (dtype, torch.float32):
            rows = prefetcher.submit([PrefetchLayer(i, ids[i], stores[i]) for i in ids], torch.device("cpu"))
            for i in ids:
                want = DiskNgramEmbedding(stores[i], out_dtype)(ids[i])
                got = rows.rows(i, out_dtype)
                assert got.shape == want.shape and got.dtype == want.dtype == out_dtype
                assert torch.equal(_bits(got), _bits(want)), (i, out_dtype)
        shared_ids = torch.cat([ids[0].flatten(), ids[2].flatten()])
        assert prefetcher.stats["steps"] == 2 and prefetcher.stats["layers"] == 8
        assert prefetcher.stats["unique_rows"] == 2 * (shared_ids.unique().numel() + ids[3].unique().numel())
        assert prefetcher.stats["ready"] + prefetcher.stats["waits"] == 2 and prefetcher.stats["errors"] == 0
    finally:
        prefetcher.close()


def test_a_read_error_in_the_worker_is_the_error_of_the_step_that_asked(tmp_path):
    store = store_of(tmp_path, [torch.randn(12, 4)], [[0]])
    prefetcher = PLEPrefetcher()
    try:
        bad = prefetcher.submit([PrefetchLayer(1, torch.tensor([[3, 12]]), store)], torch.device("cpu"))
        with pytest.raises(PLEPrefetchError, match=r"PLE layer\(s\) \[1\].*row id 12 outside \[0, 12\)"):
            bad.rows(1, torch.float32)
        good = prefetcher.submit([PrefetchLayer(1, torch.tensor([[3, 11]]), store)], torch.device("cpu"))
        assert torch.equal(good.rows(1, torch.float32), DiskNgramEmbedding(store)(torch.tensor([[3, 11]])))
        assert prefetcher.stats["errors"] == 1
    finally:
        prefetcher.close()
    assert not prefetcher.running


# ------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # Three layers, the PLE one at index 1: the worker gathers while decoder layer 0 runs.
    config = tiny_indexer_config(split_ngram_parts=4, layer_types=["linear_attention", "linear_attention",
                                                                   "indexed_attention"], ple_layer_ids=[2],
                                    num_hidden_layers=3)
    return write_checkpoint(tmp_path_factory.mktemp("ple-prefetch"), config, seed=5, dtype=torch.float32,
                            max_shard_size="40KB", tokenizer=False)


def disk_model(checkpoint: Path):
    model = eager_experts(hebrus_torch.from_pretrained(checkpoint, ple_table="disk"))
    assert model.hebrus_checkpoint.ple_table == "disk"
    return model


def ple_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if layer.ple is not None]


def table_of(model) -> DiskNgramEmbedding:
    (idx,) = ple_layers(model)
    return model.model.layers[idx].ple.ple_embedding.ngram_embedding


def prefetch_workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(WORKER_NAME) and t.is_alive()]


def wait_until(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_the_checkpoint_has_its_ple_layer_after_another_layer(checkpoint):
    assert ple_layers(disk_model(checkpoint)) == [1]


def test_logits_and_state_with_prefetch_are_bitwise_those_of_the_gather_in_place(checkpoint):
    model = disk_model(checkpoint)
    prompts = prompts_for(11, lengths=(13, 5, 22))
    runs = {}
    for prefetch in (False, True):
        logits: list[torch.Tensor] = []
        hook = model.lm_head.register_forward_hook(lambda mod, args, out: logits.append(out.detach().clone()))
        engine = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=4, max_batch_tokens=9, block_size=4,
                                            ple_prefetch=prefetch))
        states = {}
        engine.on_prompt_done = lambda req, e=engine, s=states: s.__setitem__(
            req.request_id, tuple(h.digest(req.seq) for h in e.cache.holders))
        try:
            for i, p in enumerate(prompts):
                engine.add_request(p, request_id=f"r{i}", max_new_tokens=5, eos_token_id=-1)
            engine.run()
        finally:
            hook.remove()
            engine.close()
        prefetcher = engine.runner.forward.prefetcher
        if prefetch:
            # Every step's rows came from the worker, and the layer itself gathered nothing.
            assert prefetcher.stats["steps"] == engine.counters.steps == len(logits)
            assert prefetcher.stats["ready"] + prefetcher.stats["waits"] == engine.counters.steps
            assert table_of(model).store.stats["calls"] == calls_before + engine.counters.steps
        else:
            assert prefetcher is None
            calls_before = table_of(model).store.stats["calls"]
        runs[prefetch] = ({r: q.generated for r, q in engine.requests.items()}, states, logits)
    (tokens_off, states_off, logits_off), (tokens_on, states_on, logits_on) = runs[False], runs[True]
    assert tokens_on == tokens_off and states_on == states_off
    assert len(logits_on) == len(logits_off)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(logits_on, logits_off))


def test_engine_invariance_with_prefetch_on_under_every_cut(checkpoint, row_invariant):
    memory = eager_experts(hebrus_torch.from_pretrained(checkpoint, ple_table="memory"))
    disk = disk_model(checkpoint)
    base = prompts_for(4, lengths=(14, 6, 21, 2))
    shared = base[2][:12]
    prompts = base + [shared + [9, 8, 7], shared + [9, 8, 7, 6, 5]]
    ref_tokens, ref_states = run_engine(memory, prompts, max_batch_tokens=None, allow_block_sharing=False)
    used = {"steps": 0}
    submit = PLEPrefetcher.submit

    def counting(self, *args, **kwargs):
        used["steps"] += 1
        return submit(self, *args, **kwargs)
    PLEPrefetcher.submit = counting
    try:
        for s in (dict(max_batch_tokens=1), dict(max_batch_tokens=7, max_requests_per_batch=2),
                  dict(max_batch_tokens=16, order=[5, 3, 1, 0, 4, 2]), dict(max_batch_tokens=7, allow_block_sharing=True)):
            before = used["steps"]
            tokens, states = run_engine(disk, prompts, ple_prefetch=True, **s)
            assert tokens == ref_tokens, s
            assert states == ref_states, s
            assert used["steps"] > before, s
    finally:
        PLEPrefetcher.submit = submit


def test_auto_prefetches_on_a_device_and_not_on_the_cpu(checkpoint):
    """``ple_prefetch="auto"`` (the default): off for a model on the CPU (the worker would compete with torch's
    threads for the cores), on for CUDA and MPS; True and False are taken as they are; anything else is refused."""
    from hebrus_torch.errors import HebrusError
    from hebrus_torch.ple.prefetch import prefetch_enabled

    disk = disk_model(checkpoint)
    assert EngineConfig().ple_prefetch == "auto"
    for setting, on in (("auto", False), (True, True), (False, False)):
        engine = Engine(disk, EngineConfig(capacity_tokens=64, max_sequences=1, ple_prefetch=setting))
        assert (engine.runner.forward.prefetcher is not None) is on, setting
    assert [prefetch_enabled("auto", torch.device(d)) for d in ("cpu", "cuda", "mps", "meta")] == [False, True, True,
                                                                                                  False]
    assert prefetch_enabled(True, torch.device("cpu")) and not prefetch_enabled(False, torch.device("cuda"))
    for bad in ("on", 1, None):
        with pytest.raises(HebrusError, match="ple_prefetch must be a bool or 'auto'"):
            EngineConfig(ple_prefetch=bad)


def test_speculation_with_prefetch_gives_the_plain_tokens(checkpoint):
    disk = disk_model(checkpoint)
    base = prompts_for(14, lengths=(10, 16))
    prompts = [p + p[:6] + p for p in base]
    plain, _ = run_engine(disk, prompts, max_new_tokens=12, ple_prefetch=False)
    engine = Engine(disk, EngineConfig(capacity_tokens=1024, max_sequences=8, max_batch_tokens=16, block_size=4,
                                       ple_prefetch=True))
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=12, eos_token_id=EOS, speculative=5)
    engine.run()
    engine.close()
    assert engine.counters.spec_drafted_tokens > 0 and engine.counters.spec_rollbacks > 0
    assert engine.runner.forward.prefetcher.stats["steps"] == engine.counters.steps
    assert {r: q.generated for r, q in engine.requests.items()} == plain


def _failing_reads(monkeypatch, store, fail_on):
    """store.read_unique raises an OSError on the calls whose number (from 1) ``fail_on`` accepts."""
    real = store.read_unique
    calls = {"n": 0}

    def read_unique(*args, **kwargs):
        calls["n"] += 1
        if fail_on(calls["n"]):
            raise OSError(5, f"injected read error at call {calls['n']}")
        return real(*args, **kwargs)
    monkeypatch.setattr(store, "read_unique", read_unique)
    return calls


@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_read_error_in_the_worker_fails_that_step_which_rolls_back_and_is_retried(checkpoint, monkeypatch, k):
    model = disk_model(checkpoint)
    prompts = prompts_for(7, lengths=(10, 4, 15))
    clean, _ = run_engine(model, prompts, max_batch_tokens=7)
    engine = Engine(model, EngineConfig(capacity_tokens=1024, max_sequences=8, max_batch_tokens=7, block_size=4,
                                        ple_prefetch=True))
    _failing_reads(monkeypatch, table_of(model).store, lambda n: n == k)
    errors = []
    execute = engine.runner.execute

    def checked(*args):
        before = engine.cache.digest()
        try:
            return execute(*args)
        except PLEPrefetchError as err:
            assert threading.current_thread() is threading.main_thread()     # raised on the engine's thread
            assert engine.cache.digest() == before                          # nothing published
            errors.append(str(err))
            raise
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=EOS)
    engine.runner.execute = checked         # (from the first step on)
    engine.run()
    engine.close()
    assert len(errors) == 1 and f"OSError: [Errno 5] injected read error at call {k}" in errors[0]
    assert engine.counters.retried_steps == 1 and engine.runner.forward.prefetcher.stats["errors"] == 1
    assert {r: q.generated for r, q in engine.requests.items()} == clean


def test_a_worker_that_keeps_failing_fails_its_requests_and_the_engine_goes_on(checkpoint, monkeypatch):
    model = disk_model(checkpoint)
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, max_batch_tokens=64, ple_prefetch=True))
    broken = {"on": True}
    _failing_reads(monkeypatch, table_of(model).store, lambda n: broken["on"])
    engine.add_request([5, 6, 7, 8], request_id="doomed", max_new_tokens=3, eos_token_id=-1)
    engine.step()
    doomed = engine.requests["doomed"]
    assert doomed.status is RequestStatus.FAILED
    assert doomed.error.startswith("PLEPrefetchError: PLE prefetch: gathering the rows of PLE layer(s) [1]")
    assert "injected read error" in doomed.error
    broken["on"] = False
    engine.add_request([5, 6, 7, 8], request_id="next", max_new_tokens=3, eos_token_id=-1)
    engine.run()
    engine.close()
    want, _ = run_engine(model, [[5, 6, 7, 8]], max_new_tokens=3, ple_prefetch=False)
    assert engine.requests["next"].status is RequestStatus.FINISHED
    assert engine.requests["next"].generated == want["r0"]


def test_the_worker_stops_with_the_engine_and_with_the_manager(checkpoint):
    from transformers import GenerationConfig

    from hebrus_torch.engine.manager import HebrusBatchingManager

    model = disk_model(checkpoint)
    before = set(prefetch_workers())     # an earlier test's engine, not yet collected, may still hold its worker

    def prefetch_workers_here() -> list[threading.Thread]:
        return [t for t in prefetch_workers() if t not in before]

    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, max_batch_tokens=64, ple_prefetch=True))
    engine.add_request([5, 6, 7], request_id="a", max_new_tokens=2, eos_token_id=-1)
    engine.run()
    assert len(prefetch_workers_here()) == 1
    engine.close()
    assert wait_until(lambda: prefetch_workers_here() == [])
    engine.add_request([5, 6, 7], request_id="b", max_new_tokens=2, eos_token_id=-1)   # still runs after close
    engine.run()
    assert engine.requests["b"].generated == engine.requests["a"].generated
    engine.close()
    assert wait_until(lambda: prefetch_workers_here() == [])

    gc = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    config = EngineConfig(capacity_tokens=256, max_sequences=4, ple_prefetch=True)
    manager = HebrusBatchingManager(model, gc, engine_config=config)
    manager.start()
    try:
        rid = manager.add_request([5, 6, 7, 8])
        result = None
        for _ in range(300):
            result = manager.get_result(request_id=rid, timeout=0.2)
            if result is not None and result.is_finished():
                break
        assert result is not None and result.error is None and len(result.generated_tokens) == 3
        assert len(prefetch_workers_here()) == 1
    finally:
        manager.stop(block=True, timeout=30)
    assert not manager.is_running()
    assert wait_until(lambda: prefetch_workers_here() == [])


def test_on_emulated_mps_a_step_uploads_its_rows_once(checkpoint):
    """MPS emulated on the CPU (hebrus_torch._emulate counts dispatches, uploads and host reads): with the table
    on disk, prefetch on uploads and reads exactly what the gather in place does (one upload of the step's rows:
    a decode step's only PLE upload), and besides the step's one read of its logits (sampling) it reads only
    the ids, at the step's start. (The emulation takes the blocking copy of ``_to_host_async``; on a real MPS
    device that copy is queued and the worker, not the engine thread, waits for it on an MPS event:
    docs/ple.md, "Prefetch".) The tokens are those of prefetch off."""
    from hebrus_torch import _emulate
    from hebrus_torch.engine.step_counts import count_step

    tokens, counted = {}, {}
    for prefetch in (True, False):
        model = disk_model(checkpoint)
        with torch.no_grad(), _emulate.emulate("mps") as dev:
            engine = Engine(model.to(dev), EngineConfig(capacity_tokens=256, max_sequences=2, max_batch_tokens=16,
                                                        allow_block_sharing=False, ple_prefetch=prefetch))
            engine.add_request([5, 6, 7, 8, 9, 10, 11], request_id="r", max_new_tokens=4, eos_token_id=-1)
            counted[prefetch] = [count_step(engine), count_step(engine)]          # the prefill, a decode step
            engine.run()
            engine.close()
        tokens[prefetch] = engine.requests["r"].generated
        if prefetch:
            assert engine.runner.forward.prefetcher.stats["steps"] == engine.counters.steps
    for on, off in zip(counted[True], counted[False]):
        assert on.uploads == off.uploads and on.syncs == off.syncs
        assert on.total_syncs == 2
        sites = {(part, site.split(":")[0]) for part, _, site in on.sync_sites}
        assert sites == {("PLE", "ple/prefetch.py"), ("engine (schedule, sample)", "engine/sampling.py")}
    assert counted[True][1].uploads["PLE"] == 1
    assert tokens[True] == tokens[False]


# ------------------------------------------------------------------------------------------ on a CUDA device
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_prefetched_rows_are_bitwise_the_in_place_gather(tmp_path, dtype):
    """The device path: ids on CUDA copied to pinned host memory behind a CUDA event (the worker waits on the
    event), the step's rows uploaded once from a pinned buffer without waiting: bitwise DiskNgramEmbedding's
    rows for the same ids, on the ids' device."""
    gen = torch.Generator().manual_seed(8)
    store = store_of(tmp_path, [(torch.randn(r, 10, generator=gen) * 4).to(dtype) for r in (30, 41)], [[0], [1]])
    cuda = torch.device("cuda")
    prefetcher = PLEPrefetcher()
    try:
        for step in range(3):
            ids = {1: torch.randint(0, 71, (7, 6), generator=gen).to(cuda),
                   3: torch.randint(0, 71, (2, 6), generator=gen).to(cuda)}
            rows = prefetcher.submit([PrefetchLayer(i, ids[i], store) for i in ids], cuda)
            for i in ids:
                for out_dtype in (dtype, torch.float32):
                    want = DiskNgramEmbedding(store, out_dtype)(ids[i])
                    got = rows.rows(i, out_dtype)
                    assert got.device.type == "cuda" and want.device.type == "cuda" and got.dtype == out_dtype
                    assert torch.equal(_bits(got), _bits(want)), (step, i, out_dtype)
            assert prefetcher._uploaded is not None and prefetcher._uploaded.is_pinned()
            rows.discard()
        assert prefetcher.stats["steps"] == 3 and prefetcher.stats["errors"] == 0
    finally:
        prefetcher.close()


@needs_cuda
def test_on_cuda_the_engine_prefetches_by_default_and_gives_the_in_place_tokens_and_rows(checkpoint):
    """With the model on CUDA, ``ple_prefetch="auto"`` (the default) prefetches; every PLE layer's rows are bitwise
    those the in-place gather gives for the step's ids, and the greedy tokens (and every holder's digest after
    each prompt) are those of prefetch off."""
    from hebrus_torch.ple.prefetch import PrefetchedRows

    model = eager_experts(hebrus_torch.from_pretrained(checkpoint, ple_table="disk", device="cuda"))
    table = table_of(model)
    prompts = prompts_for(19, lengths=(13, 5, 22))
    checked = {"rows": 0}
    submit, rows_of = PLEPrefetcher.submit, PrefetchedRows.rows

    def recording_submit(self, layers, device):
        out = submit(self, layers, device)
        out._ids = {layer.layer_idx: layer.ids.clone() for layer in layers}
        return out

    def checking_rows(self, layer_idx, dtype):
        got = rows_of(self, layer_idx, dtype)
        want = table(self._ids[layer_idx])
        assert got.device.type == "cuda" and torch.equal(_bits(got), _bits(want))
        checked["rows"] += 1
        return got

    PLEPrefetcher.submit, PrefetchedRows.rows = recording_submit, checking_rows
    try:
        on, states_on = run_engine(model, prompts, max_new_tokens=5)
        engine = Engine(model, EngineConfig(capacity_tokens=64, max_sequences=1))
        assert engine.runner.forward.prefetcher is not None          # "auto" on CUDA: on
        engine.close()
    finally:
        PLEPrefetcher.submit, PrefetchedRows.rows = submit, rows_of
    off, states_off = run_engine(model, prompts, max_new_tokens=5, ple_prefetch=False)
    assert checked["rows"] > len(prompts)
    assert on == off and states_on == states_off

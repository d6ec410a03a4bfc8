"""The prompt cache that survives restarts (issue 27): ``Engine(..., prompt_cache_dir=...)``.

Two engines in one process share a directory: the first serves turn 1 and is closed; the second
serves turn 2 (turn 1's prompt + reply + a new message) from the files. Checked: the second prefills
only the new tokens, its tokens equal an engine that never stopped and ``generate``, and the state
after turn 2's prompt is bitwise that of the engine that never stopped (``digest(seq)`` of every
holder). Corrupt, truncated, foreign, garbage and other-version files are skipped with one warning
and change no answer; the size cap evicts least recently used files; the fault-injection and
invariance tests of tests/test_engine.py run again with the files on.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest

from test_engine import (EOS, SHAPES, eager_experts, inject_fault, make_model, prompts_for, reference_tokens,  # noqa: F401
                         row_invariant)

from hebrus_torch import HebrusError
from hebrus_torch.engine import Engine, EngineConfig, RequestStatus
from hebrus_torch.engine import prompt_cache as pc

CFG = dict(capacity_tokens=1024, max_sequences=8, max_batch_tokens=16, block_size=4)
NEW = [7, 8, 9, 10, 11]     # turn 2's new message


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def serve(model, prompts, *, order=None, max_new_tokens=6, **config):
    """Run ``prompts`` on a fresh engine; returns (engine, tokens by id, digests after each prompt).
    The engine is closed (its directory released) before it is returned."""
    cfg = dict(CFG)
    cfg.update(config)
    engine = Engine(model, EngineConfig(**cfg))
    states = {}
    engine.on_prompt_done = lambda req: states.__setitem__(
        req.request_id, tuple(h.digest(req.seq) for h in engine.cache.holders))
    for i in (order if order is not None else range(len(prompts))):
        engine.add_request(prompts[i], request_id=f"r{i}", max_new_tokens=max_new_tokens, eos_token_id=EOS)
    engine.run()
    assert all(req.status is RequestStatus.FINISHED for req in engine.requests.values())
    engine.close()
    return engine, {rid: req.generated for rid, req in engine.requests.items()}, states


def turn_two(turn1: list[list[int]], tokens: dict) -> list[list[int]]:
    return [p + tokens[f"r{i}"] + NEW for i, p in enumerate(turn1)]


def reused(engine, i: int) -> int:
    """Tokens of turn 1's request i the engine computed (its prompt and all but its last token)."""
    req = engine.requests[f"r{i}"]
    return len(req.prompt) + len(req.generated) - 1


# ------------------------------------------------------------------------------------------ restarts
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_restarted_engine_prefills_only_the_new_tokens_and_equals_one_that_never_stopped(shape, tmp_path):
    model = make_model(shape, seed=21)
    turn1 = prompts_for(21, lengths=(14, 5, 23))
    first, tokens1, _ = serve(model, turn1, prompt_cache_dir=tmp_path)
    assert first.counters.prompt_cache_writes == 3 and len(list(tmp_path.glob("*.hpc"))) == 3
    turn2 = turn_two(turn1, tokens1)

    second, tokens2, states2 = serve(model, turn2, prompt_cache_dir=tmp_path)
    c = second.counters
    assert (c.prompt_cache_hits, c.prompt_cache_misses, c.prompt_cache_skipped_files) == (3, 0, 0)
    want = [reused(first, i) for i in range(3)]
    assert c.prompt_cache_hit_tokens == c.prefix_hit_tokens == sum(want)
    assert c.prefill_tokens == sum(len(p) - n for p, n in zip(turn2, want))
    assert [second.requests[f"r{i}"].prefix_hit_tokens for i in range(3)] == want

    # an engine that never stopped: turn 1, then turn 2 from its in-memory prefix cache
    engine = Engine(model, EngineConfig(**CFG))
    for i, p in enumerate(turn1):
        engine.add_request(p, request_id=f"t{i}", max_new_tokens=6, eos_token_id=EOS)
    engine.run()
    states = {}
    engine.on_prompt_done = lambda req: states.__setitem__(
        req.request_id, tuple(h.digest(req.seq) for h in engine.cache.holders))
    for i, p in enumerate(turn2):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=EOS)
    engine.run()
    assert engine.counters.prefix_hit_tokens == sum(want)
    assert states2 == {k: v for k, v in states.items() if k.startswith("r")}       # bitwise the same state
    for i, p in enumerate(turn2):
        assert tokens2[f"r{i}"] == engine.requests[f"r{i}"].generated == reference_tokens(model, p, 6), (shape, i)


def test_files_serve_prefixes_that_memory_evicted_and_the_kwarg_matches_the_config(tmp_path):
    model = make_model("lin-idx", seed=22)
    turn1 = prompts_for(22, lengths=(12, 9))
    engine = Engine(model, EngineConfig(**CFG, prefix_cache_tokens=0), prompt_cache_dir=tmp_path)   # keeps nothing
    assert Path(engine.config.prompt_cache_dir) == tmp_path
    for i, p in enumerate(turn1):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=4, eos_token_id=-1)
    engine.run()
    assert engine.kept_sequences() == [] and engine.counters.prompt_cache_writes == 2
    p2 = turn1[0] + engine.requests["r0"].generated + NEW
    engine.add_request(p2, request_id="next", max_new_tokens=4, eos_token_id=-1)
    engine.run()
    assert engine.requests["next"].prefix_hit_tokens == len(turn1[0]) + 3
    assert engine.requests["next"].generated == reference_tokens(model, p2, 4)[:4]
    engine.close()
    with pytest.raises(HebrusError, match="differs"):
        Engine(model, EngineConfig(**CFG, prompt_cache_dir=tmp_path / "a"), prompt_cache_dir=tmp_path / "b")
    with pytest.raises(HebrusError, match="prompt_cache_max_bytes"):
        EngineConfig(prompt_cache_max_bytes=0)


def test_one_engine_per_directory(tmp_path):
    model = make_model("lin-idx", seed=23)
    first = Engine(model, EngineConfig(**CFG), prompt_cache_dir=tmp_path)
    with pytest.raises(HebrusError, match=r"in use by another engine \(pid \d+\)"):
        Engine(model, EngineConfig(**CFG), prompt_cache_dir=tmp_path)
    first.close()
    Engine(model, EngineConfig(**CFG), prompt_cache_dir=tmp_path).close()


# ------------------------------------------------------------------------------------------ bad files
def _flip(path: Path, where: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def _flipped(path: Path) -> bytes:
    """The entry's ModelCache blob with one byte of its payload flipped (its own checksum now wrong)."""
    state = bytearray(pc.decode(path.read_bytes())[1])
    state[len(state) // 2] ^= 0x01
    return bytes(state)


def _repack(path: Path, state: bytes | None = None, **meta_changes) -> None:
    """Rewrite an entry file with a consistent header (checksums right) but other metadata or state."""
    meta, old = pc.decode(path.read_bytes())
    state = old if state is None else state
    meta = {k: v for k, v in meta.items() if k not in ("state_bytes", "state_sha256")}
    meta.update(meta_changes)
    path.write_bytes(pc.encode_header(meta, state) + state)


CORRUPTIONS = {
    "payload byte flipped": lambda p: _flip(p, 0.9),
    "header byte flipped": lambda p: _flip(p, 0.01),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-100]),
    "garbage": lambda p: p.write_bytes(bytes(range(256)) * 40),
    "empty": lambda p: p.write_bytes(b""),
    "another entry version": lambda p: _repack(p, version=pc.VERSION + 1),
    "another fingerprint": lambda p: _repack(p, fingerprint="0" * 64),
    "a valid file holding a bad state": lambda p: _repack(p, state=b"not a ModelCache blob, 32 bytes or more"),
    "state bytes flipped, header rewritten to match": lambda p: _repack(p, state=_flipped(p)),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_file_is_skipped_with_one_warning_and_changes_no_answer(corruption, tmp_path):
    model = make_model("lin-idx", seed=24)
    turn1 = prompts_for(24, lengths=(13,))
    first, tokens1, _ = serve(model, turn1, prompt_cache_dir=tmp_path)
    path, = tmp_path.glob("*.hpc")
    CORRUPTIONS[corruption](path)
    turn2 = turn_two(turn1, tokens1)
    want = reference_tokens(model, turn2[0], 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second, tokens2, _ = serve(model, turn2, prompt_cache_dir=tmp_path)
        third, tokens3, _ = serve(model, turn2, prompt_cache_dir=tmp_path)     # a later engine of this process
    ours = [str(w.message) for w in caught if "hebrus prompt cache" in str(w.message)]
    assert len(ours) == 1 and path.name in ours[0], [str(w.message) for w in caught]
    for engine, tokens in ((second, tokens2), (third, tokens3)):
        c = engine.counters
        assert (c.prompt_cache_hits, c.prompt_cache_skipped_files) == (0, 1), corruption
        assert c.prefill_tokens == len(turn2[0]) and tokens["r0"] == want


def test_a_foreign_model_s_files_are_skipped(tmp_path):
    """Same config, other weights: the fingerprint differs, the file is not restored."""
    turn1 = prompts_for(25, lengths=(13,))
    _, tokens1, _ = serve(make_model("lin-idx", seed=25), turn1, prompt_cache_dir=tmp_path)
    other = make_model("lin-idx", seed=26)
    turn2 = turn_two(turn1, tokens1)
    with pytest.warns(RuntimeWarning, match="another model"):
        second, tokens2, _ = serve(other, turn2, prompt_cache_dir=tmp_path)
    assert second.counters.prompt_cache_hits == 0 and second.counters.prompt_cache_skipped_files == 1
    assert tokens2["r0"] == reference_tokens(other, turn2[0], 6)


def test_a_write_cut_short_leaves_no_entry(tmp_path):
    model = make_model("lin-idx", seed=27)
    turn1 = prompts_for(27, lengths=(11,))
    serve(model, turn1, prompt_cache_dir=tmp_path)
    path, = tmp_path.glob("*.hpc")
    tmp = tmp_path / f".tmp-{path.name}.12345"
    tmp.write_bytes(path.read_bytes()[:50])      # a crash mid-write: never renamed into place
    store = pc.PromptCacheStore(tmp_path, "x", 1 << 20)
    assert not tmp.exists() and store.counters.prompt_cache_skipped_files == 1   # (other fingerprint "x")
    store.close()


# ------------------------------------------------------------------------------------------ size cap
def test_the_size_cap_evicts_least_recently_used_files_across_restarts(tmp_path):
    state = bytes(1000)
    store = pc.PromptCacheStore(tmp_path, "fp", 1 << 20)
    one = store.put([5, 6], state) and (tmp_path / store._name((5, 6))).stat().st_size
    store.close()
    cap = 3 * one + one // 2                     # room for three files
    store = pc.PromptCacheStore(tmp_path, "fp", cap)
    for tokens in ([1], [2], [3]):
        assert store.put(tokens, state)
    names = {t: store._name(t) for t in ((5, 6), (1,), (2,), (3,))}
    assert not (tmp_path / names[(5, 6)]).exists()          # the oldest went for [3]
    assert store.read(store.lookup([1, 9], 2)) == state     # a use of [1]: now the newest
    assert store.lookup([2, 9], 1).tokens == (2,) and store.lookup([2], 0) is None
    store.close()

    store = pc.PromptCacheStore(tmp_path, "fp", cap)         # the order survives a restart
    assert [e.tokens for e in store.entries()] == [(2,), (3,), (1,)]
    (tmp_path / "junk.hpc").write_bytes(b"junk")             # unusable files go first
    store.close()
    with pytest.warns(RuntimeWarning, match="junk.hpc"):
        store = pc.PromptCacheStore(tmp_path, "fp", cap)
    assert store.put([4], state)                             # the junk, then the least recently used
    assert not (tmp_path / "junk.hpc").exists() and not (tmp_path / names[(2,)]).exists()
    assert [e.tokens for e in store.entries()] == [(3,), (1,), (4,)]
    assert store.total_bytes <= cap and store.counters.prompt_cache_evictions == 2
    assert not store.put([6], bytes(cap))                    # larger than the cap: not written
    store.close()


def test_writes_happen_off_the_caller_s_thread_and_readers_wait_for_what_they_could_see(tmp_path, monkeypatch):
    """put_later returns before the disk is done; a lookup that a pending write could answer waits for it, one
    that no pending write matches does not; len, the counters after flush and close see every write."""
    import threading
    import time

    release = threading.Event()
    fsync = pc.os.fsync

    def slow_fsync(fd):
        assert release.wait(10), "the test never released the write"
        fsync(fd)
    monkeypatch.setattr(pc.os, "fsync", slow_fsync)
    store = pc.PromptCacheStore(tmp_path, "fp", 1 << 20)
    t0 = time.perf_counter()
    store.put_later([1, 2, 3], bytes(100))
    assert time.perf_counter() - t0 < 1.0 and store.counters.prompt_cache_writes == 0      # still on its way
    assert store.lookup([7, 8, 9], 3) is None                # nothing pending could match: no wait
    threading.Timer(0.2, release.set).start()
    t0 = time.perf_counter()
    assert store.lookup([1, 2, 3, 4], 4).tokens == (1, 2, 3)   # waited for the write
    assert time.perf_counter() - t0 >= 0.1
    store.put_later([5], bytes(10))
    assert len(store) == 2 and store.counters.prompt_cache_writes == 2
    store.close()


def test_a_file_read_ahead_is_read_on_the_store_s_thread(tmp_path, monkeypatch):
    import pathlib
    import threading

    store = pc.PromptCacheStore(tmp_path, "fp", 1 << 20)
    assert store.put([1, 2, 3], bytes(100))
    readers = []
    read_bytes = pathlib.Path.read_bytes

    def recorded(path):
        readers.append(threading.current_thread().name)
        return read_bytes(path)
    monkeypatch.setattr(pathlib.Path, "read_bytes", recorded)
    entry = store.lookup([1, 2, 3, 4], 4)
    store.prefetch(entry)
    assert store.read(entry) == bytes(100) and readers == ["hebrus-prompt-cache-io"]
    assert store.read(entry) == bytes(100) and readers[-1] == threading.current_thread().name   # not read ahead
    store.close()


def test_a_finished_request_s_file_is_serialised_on_the_store_s_thread(tmp_path, monkeypatch):
    """The engine's thread only copies a finished request's state out of the cache (issue 33): serialising and
    checksumming it (``blob.pack``) happen on the store's thread with the file I/O. (Before, ModelCache.save ran
    on the engine's thread: every blob was packed there.)"""
    import threading

    from hebrus_torch.state import blob

    packers = []
    pack = blob.pack

    def recorded(*args, **kwargs):
        packers.append(threading.current_thread().name)
        return pack(*args, **kwargs)
    monkeypatch.setattr(blob, "pack", recorded)
    engine, _, _ = serve(make_model("lin-idx", seed=7), prompts_for(7, lengths=(10, 4, 15)),
                         prompt_cache_dir=tmp_path)
    assert engine.counters.prompt_cache_writes >= 3
    assert packers and set(packers) == {"hebrus-prompt-cache-io"}, packers


def test_an_unpacked_save_is_a_copy_that_packs_to_the_bytes_of_save_at_that_time():
    """ModelCache.save_unpacked copies every holder's state: packed later, after the sequence ran on, it gives
    the bytes ModelCache.save gave when it was taken."""
    engine = Engine(make_model("lin-idx", seed=7), EngineConfig(**CFG))
    rid = engine.add_request(prompts_for(7, lengths=(15,))[0], max_new_tokens=6, eos_token_id=EOS)
    for _ in range(3):
        engine.step()
    req = engine.requests[rid]
    taken, saved = engine.cache.save_unpacked(req.seq), engine.cache.save(req.seq)
    engine.step()
    engine.step()
    assert engine.cache.save(req.seq) != saved           # the sequence moved on
    assert taken.pack() == saved
    engine.run()
    engine.close()


# ------------------------------------------------------------------------------------------ faults and invariance
@pytest.mark.parametrize("target", ["ple_conv", "qsa_select", "delta_rule", "native_gdn_layer",
                                    "native_attention_layer", "hook"])
def test_a_fault_with_the_files_on_rolls_back_and_the_engine_completes_every_request(target, monkeypatch,
                                                                                      tmp_path):
    model = make_model("lin-idx", seed=7)
    turn1 = prompts_for(7, lengths=(10, 4, 15))
    warm = tmp_path / "warm"
    _, tokens1, _ = serve(model, turn1, max_batch_tokens=7, prompt_cache_dir=warm)
    turn2 = turn_two(turn1, tokens1)
    _, clean, _ = serve(model, turn2, max_batch_tokens=7)      # no files: a cold start of turn 2
    for k in (1, 3, 5, 7):      # (turn 2 from the files is 8 steps or more)
        directory = tmp_path / f"k{k}"
        shutil.copytree(warm, directory)
        # (GDNState.delta_rule and QSACache.plan run where the layer is not one native call)
        engine = Engine(model, EngineConfig(**dict(CFG, max_batch_tokens=7), prompt_cache_dir=directory,
                                            native_layers=target not in ("delta_rule", "qsa_select")))
        calls = inject_fault(engine, target, k, monkeypatch)
        for i, p in enumerate(turn2):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=EOS)
        engine.run()
        engine.close()
        assert calls["n"] >= k
        assert engine.counters.retried_steps == 1 and engine.counters.prompt_cache_hits == 3
        assert {r: q.generated for r, q in engine.requests.items()} == clean, (target, k)


@pytest.mark.parametrize("shape", ["lin-idx", "idx-lin-idx-lin"])
def test_tokens_and_state_after_a_restored_prompt_do_not_depend_on_cut_cap_or_order(shape, row_invariant, tmp_path):
    model = eager_experts(make_model(shape, seed=4))
    turn1 = prompts_for(4, lengths=(14, 6, 21, 2))
    warm = tmp_path / "warm"
    _, tokens1, _ = serve(model, turn1, max_batch_tokens=None, prompt_cache_dir=warm)
    turn2 = turn_two(turn1, tokens1)
    _, ref_tokens, ref_states = serve(model, turn2, max_batch_tokens=None, allow_block_sharing=False)
    settings = [dict(max_batch_tokens=1), dict(max_batch_tokens=7), dict(max_batch_tokens=16),
                dict(max_batch_tokens=64), dict(max_batch_tokens=7, max_requests_per_batch=2),
                dict(max_batch_tokens=16, order=[3, 1, 0, 2]), dict(max_batch_tokens=7, allow_block_sharing=False)]
    for n, s in enumerate(settings):
        directory = tmp_path / f"s{n}"
        shutil.copytree(warm, directory)
        engine, tokens, states = serve(model, turn2, prompt_cache_dir=directory, **s)
        assert engine.counters.prompt_cache_hits == len(turn2), s
        assert tokens == ref_tokens, s
        assert states == ref_states, s


def test_with_the_chunked_gdn_prefill_files_hold_aligned_states_that_keep_the_bits(tmp_path, row_invariant):
    """Prompts of whole GDN chunks (chunked prefill on: max_batch_tokens >= 64): a finished request's frontier
    lies past its last whole prompt chunk, where a continuing request's own path runs the chunked form, so the
    file holds the state at that chunk's end (a multiple of 64); turn 2 continues from there, with the state
    and tokens of an engine that never stopped and of a cold engine without files or sharing."""
    model = eager_experts(make_model("lin-idx", seed=24))
    turn1 = prompts_for(24, lengths=(100, 140))
    cfg = dict(max_batch_tokens=64)
    first, tokens1, _ = serve(model, turn1, prompt_cache_dir=tmp_path, **cfg)
    assert first.chunk_align == 64 and first.counters.prompt_cache_writes == 2
    turn2 = turn_two(turn1, tokens1)
    second, tokens2, states2 = serve(model, turn2, prompt_cache_dir=tmp_path, **cfg)
    assert [second.requests[f"r{i}"].prefix_hit_tokens for i in range(2)] == [64, 128]
    assert second.counters.prompt_cache_hits == 2
    cold, tokens_cold, states_cold = serve(model, turn2, allow_block_sharing=False, **cfg)
    assert cold.counters.prefix_hit_tokens == 0
    assert states2 == states_cold and tokens2 == tokens_cold

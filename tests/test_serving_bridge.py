"""The serving boundary in-process: the manager's queue as the only way to the engine, and the bridge that
transformers serve's handlers call (``HebrusCBGenerateManager``), driven on an asyncio loop of the test's own.

Each test builds a tiny engine (tests/test_engine.py's models) behind a ``HebrusBatchingManager``; every wait
has a timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

pytest.importorskip("fastapi", reason="needs the serve extra (pip install -e .[serve])")

from test_engine import make_model  # noqa: E402  (skips without transformers)
from test_serve import make_tokenizer  # noqa: E402

from hebrus_torch import serve  # noqa: E402
from hebrus_torch.engine import Engine, EngineConfig  # noqa: E402
from hebrus_torch.engine import manager as manager_module  # noqa: E402
from hebrus_torch.engine.manager import HebrusBatchingManager  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402

WAIT = 30.0          # seconds any one wait may take before the test fails
THREAD_NAME = "hebrus-continuous-batching"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def generation_config(max_new_tokens: int = 4):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def started_manager(model, **config) -> HebrusBatchingManager:
    config = {"capacity_tokens": 256, "max_sequences": 4, **config}
    manager = HebrusBatchingManager(model, generation_config(), engine_config=EngineConfig(**config))
    manager.start()
    return manager


def bridge_on(manager: HebrusBatchingManager):
    """transformers serve's CB bridge (ours) on ``manager``, as ``init_cb`` leaves it."""
    bridge = serve._cb_manager_class()()
    bridge._cb = manager
    return bridge


def status_of(err: BaseException) -> int | None:
    return getattr(err, "status_code", None)


def test_after_stop_all_managers_a_request_is_a_503_at_once_streaming_or_not():
    """SIGTERM runs stop_all_managers() while uvicorn still accepts for a moment: a request arriving then was
    refused by add_request (None) and its HTTP request waited forever, its result handler left registered."""
    model, tokenizer = make_model("lin-idx", seed=31), make_tokenizer()
    manager = started_manager(model)
    serve._MANAGERS.add(manager)
    bridge = bridge_on(manager)
    try:
        assert serve.stop_all_managers() >= 1

        async def requests():
            for streaming in (False, True):
                rid = f"after-stop-{streaming}"
                try:
                    if streaming:
                        queue, _ = bridge.generate_streaming(model, tokenizer, {"input_ids": [5, 6, 7]},
                                                             generation_config(), rid)
                        await asyncio.wait_for(queue.get(), WAIT)
                    else:
                        await asyncio.wait_for(bridge.generate_non_streaming(
                            model, tokenizer, {"input_ids": [5, 6, 7]}, generation_config(), rid), WAIT)
                except asyncio.TimeoutError:
                    pytest.fail(f"streaming={streaming}: no answer in {WAIT}s after the managers were stopped")
                except Exception as err:  # noqa: BLE001 - the answer under test
                    assert status_of(err) == 503, repr(err)
                else:
                    pytest.fail(f"streaming={streaming}: served after the managers were stopped")
                assert rid not in manager.output_router.result_handlers
        asyncio.run(requests())
    finally:
        manager.stop(block=True, timeout=WAIT)


def test_a_stopped_manager_builds_no_engine_for_checks_or_engine_calls(tmp_path, monkeypatch):
    """check_request and call_in_engine_thread on a stopped manager built a whole new Engine on the caller's
    thread, which took the prompt-cache directory's lock again (a later server on it was refused)."""
    model = make_model("lin-idx", seed=32)
    manager = started_manager(model, prompt_cache_dir=str(tmp_path / "prompts"))
    manager.stop(block=True, timeout=WAIT)
    assert manager.engine is None
    built = []
    original = manager_module.Engine

    def counting(*args, **kwargs):
        built.append(threading.current_thread().name)
        return original(*args, **kwargs)
    monkeypatch.setattr(manager_module, "Engine", counting)
    with pytest.raises(HebrusError, match="stopped"):
        manager.check_request([5, 6, 7], max_new_tokens=2)
    with pytest.raises(HebrusError, match="stopped"):
        manager.call_in_engine_thread(lambda engine: engine.config.capacity_tokens)
    assert built == [] and manager.engine is None
    monkeypatch.setattr(manager_module, "Engine", original)
    later = started_manager(model, prompt_cache_dir=str(tmp_path / "prompts"))   # the directory is free
    later.stop(block=True, timeout=WAIT)


def test_a_duplicate_request_id_is_a_409_naming_it_and_the_first_request_completes():
    """Two requests with the same X-Request-ID: the second replaced the first's result handler and was
    refused as already in flight with a 500; the first never got its answer."""
    model, tokenizer = make_model("lin-idx", seed=33), make_tokenizer()
    manager = started_manager(model)
    bridge = bridge_on(manager)
    try:
        async def two():
            first = asyncio.create_task(bridge.generate_non_streaming(
                model, tokenizer, {"input_ids": [5, 6, 7, 8]}, generation_config(48), "same-id"))
            await asyncio.sleep(0)       # the first is open (queued, its channel registered)
            for streaming in (False, True):
                try:
                    if streaming:
                        bridge.generate_streaming(model, tokenizer, {"input_ids": [9, 10]}, generation_config(),
                                                  "same-id")
                    else:
                        await asyncio.wait_for(bridge.generate_non_streaming(
                            model, tokenizer, {"input_ids": [9, 10]}, generation_config(), "same-id"), WAIT)
                except asyncio.TimeoutError:
                    pytest.fail("the duplicate got no answer")
                except Exception as err:  # noqa: BLE001 - the answer under test
                    assert 400 <= (status_of(err) or 0) < 500 and "same-id" in str(err.detail), repr(err)
                else:
                    pytest.fail("a duplicate request id was served")
            try:
                return await asyncio.wait_for(first, WAIT)
            except asyncio.TimeoutError:
                pytest.fail("the first request never got its answer")
        text, prompt_len, generated = asyncio.run(two())
        assert prompt_len == 4 and len(generated) == 48
        with torch.inference_mode():
            expected = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=48, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
        assert generated == expected
    finally:
        manager.stop(block=True, timeout=WAIT)


def test_requests_are_validated_and_made_on_the_engine_thread(monkeypatch):
    """make_request reads engine.requests, which the engine thread writes: every request (transformers'
    add_request and the server's path alike) is validated and made on the manager's thread."""
    model, tokenizer = make_model("lin-idx", seed=34), make_tokenizer()
    threads = []
    original = Engine.make_request

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(Engine, "make_request", recording)
    manager = started_manager(model)
    bridge = bridge_on(manager)
    try:
        rid = manager.add_request([5, 6, 7], max_new_tokens=2)
        bad = manager.add_request([], max_new_tokens=2)
        results = {}
        while len(results) < 2:
            out = manager.get_result(timeout=WAIT)
            assert out is not None, "no result"
            results[out.request_id] = out
        assert len(results[rid].generated_tokens) == 2 and "empty" in results[bad].error

        async def served():
            ok = await asyncio.wait_for(bridge.generate_non_streaming(
                model, tokenizer, {"input_ids": [5, 6, 7]}, generation_config(3), "http-ok"), WAIT)
            try:
                await asyncio.wait_for(bridge.generate_non_streaming(
                    model, tokenizer, {"input_ids": [5, 10**6]}, generation_config(3), "http-bad"), WAIT)
            except Exception as err:  # noqa: BLE001 - the answer under test
                assert status_of(err) == 400 and "vocabulary" in str(err.detail) and "http-bad" in str(err.detail)
            else:
                pytest.fail("a prompt outside the vocabulary was served")
            return ok
        assert len(asyncio.run(served())[2]) == 3
    finally:
        manager.stop(block=True, timeout=WAIT)
    assert threads and set(threads) == {THREAD_NAME}, threads

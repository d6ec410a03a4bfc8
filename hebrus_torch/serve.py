"""``python -m hebrus_torch.serve MODEL_DIR [transformers serve options] [--hebrus-* options]``.

Serves a local Qwen4Exp checkpoint through transformers' own OpenAI-compatible server (``transformers
serve``: its FastAPI app, its OpenAI schemas, its streaming, its CLI options), with the model patched by
``hebrus_torch.integrations.transformers.apply`` and continuous batching on the hebrus engine.

Nothing here is a server: :func:`patch_transformers_serve` replaces four names that transformers'
``Serve.__init__`` imports when it runs, each by a subclass or wrapper of transformers' own:

- ``serving.model_manager.ModelManager`` -> :class:`HebrusModelManager`: a Qwen4Exp checkpoint is loaded as
  the text-only ``Qwen4ExpForCausalLM`` with its tokenizer (transformers would load the multimodal class
  with its processor, class it MULTIMODAL and refuse continuous batching), then ``apply``-ed, and its
  ``init_continuous_batching`` returns a :class:`~hebrus_torch.engine.manager.HebrusBatchingManager`;
  ``/v1/models`` lists the served model.
- ``serving.utils.GenerationState`` -> :class:`HebrusGenerationState`, whose continuous-batching manager is a
  :class:`HebrusCBGenerateManager`: requests the engine would refuse get a 400 before anything is queued,
  each request's own sampling values, ``eos_token_id`` and ``stop`` reach the engine (transformers passes
  only ``max_new_tokens`` and EOS and samples every request with the first request's settings), the result
  handler is registered before the request is queued, a sampled request's ``seed`` seeds its own generator,
  and a non-streaming request whose task is cancelled, or whose client disconnects, cancels its engine request.
- ``serving.chat_completion.ChatCompletionHandler`` and ``serving.completion.CompletionHandler``: the body
  is checked (``messages``/``prompt``, ``max_tokens`` >= 1, ranges of ``temperature``/``top_p``, and the
  OpenAI parameters transformers does not carry: ``n``, ``logprobs``, ``top_logprobs``, ``logit_bias``,
  ``presence_penalty``, ``frequency_penalty``) before the model is touched, so a bad request is a 400 rather
  than a 500; on the batching path the response (``n`` choices, log-probabilities, stop strings cut off) is
  built by :mod:`hebrus_torch.serve_choices`.
- ``serving.server.build_server``: transformers' app, plus ``GET /hebrus/stats`` (capacity, occupancy and
  engine counters), ``POST /hebrus/prefix_cache/clear`` and, with ``--hebrus-debug``, ``POST
  /hebrus/debug/kill_engine`` (the engine thread dies at its next step: ``/health`` then answers 503).

Continuous batching is on unless ``--no-continuous-batching`` is given (transformers' one-request-at-a-time
``generate`` path on the patched model, kept for comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import copy
import logging
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["HebrusServeSettings", "patch_transformers_serve", "main"]

QWEN4_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")


@dataclass
class HebrusServeSettings:
    """What the hebrus options set (``None``: derived from transformers' ``--cb-*`` options).

    Attributes:
        capacity_tokens: cache cells shared by every request (prompt + output positions).
        max_sequences: requests in flight at once.
        prefix_cache_tokens: cells kept for finished requests (second chat turns); 0 disables the prefix cache.
        block_sharing: False turns prefix sharing off altogether (no shared blocks, no prefix cache).
        debug: mount ``POST /hebrus/debug/kill_engine``.
        api_key: when set, every ``/v1/*`` and ``/hebrus/*`` request must carry ``Authorization: Bearer
            <api_key>`` (else 401 with an OpenAI-style error body); ``/health`` stays open.
        prompt_cache_dir: finished requests' states are also written there and read back by the next
            server (``EngineConfig.prompt_cache_dir``); one server per directory.
        prompt_cache_max_bytes: the size cap of ``prompt_cache_dir`` (None: the engine's default, 4 GiB).
        speculative_tokens: every request speculates with prompt lookup drafting up to this many tokens per
            step (``EngineConfig.speculative``), or with ``draft_model`` when one is given; None/0: off.
        draft_model: a directory with a small Qwen4Exp checkpoint of the same tokenizer: the drafts come
            from it (``engine/draft_model.py``).
    """

    capacity_tokens: int | None = None
    max_sequences: int | None = None
    prefix_cache_tokens: int | None = None
    block_sharing: bool = True
    debug: bool = False
    api_key: str | None = None
    prompt_cache_dir: str | None = None
    prompt_cache_max_bytes: int | None = None
    speculative_tokens: int | None = None
    draft_model: str | None = None


SHUTDOWN_GRACE_S = 5.0     # uvicorn's wait for open connections after SIGTERM, once every request was ended

_SETTINGS = HebrusServeSettings()
_ORIGINALS: dict[str, Any] = {}
_MANAGERS: "weakref.WeakSet[Any]" = weakref.WeakSet()   # the hebrus managers this process built
# The OpenAI parameters of the current HTTP request that transformers does not carry (serve_choices.Options).
_REQUEST_OPTIONS: contextvars.ContextVar[Any] = contextvars.ContextVar("hebrus_request_options", default=None)
# What runs when an HTTP request's ASGI call ends, however it ends (set per request by _RequestEnd).
_ON_REQUEST_END: contextvars.ContextVar[list | None] = contextvars.ContextVar("hebrus_on_request_end", default=None)
# Callbacks run when the client of the current HTTP request disconnects before its response is complete.
_ON_DISCONNECT: contextvars.ContextVar[list | None] = contextvars.ContextVar("hebrus_on_disconnect", default=None)


# ----------------------------------------------------------------------------------------------- loading
def _modules():
    from transformers.cli.serving import chat_completion, completion, model_manager, server, utils

    return chat_completion, completion, model_manager, server, utils


def prepare_model(model: Any, tokenizer: Any = None) -> Any:
    """``apply`` the drop-in and make ``model.init_continuous_batching`` build a hebrus manager sized by the
    serve settings (idempotent)."""
    import hebrus_torch.integrations.transformers as hx
    from hebrus_torch.engine import manager as mgr

    if not hx.is_applied(model):
        hx.apply(model)
    mgr.install(model)   # apply() does it too once it is wired there; install is idempotent

    ref = weakref.ref(model)     # (no self-reference: a dropped model must not outlive its last reference)

    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None):
        self = ref()
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, mgr.HebrusBatchingManager):
            return cached
        gen = generation_config if generation_config is not None else self.generation_config
        overrides = {k: v for k, v in dict(capacity_tokens=_SETTINGS.capacity_tokens,
                                           max_sequences=_SETTINGS.max_sequences,
                                           prefix_cache_tokens=_SETTINGS.prefix_cache_tokens,
                                           prompt_cache_dir=_SETTINGS.prompt_cache_dir,
                                           prompt_cache_max_bytes=_SETTINGS.prompt_cache_max_bytes).items()
                     if v is not None}
        if not _SETTINGS.block_sharing:
            overrides["allow_block_sharing"] = False
        draft = None
        if _SETTINGS.speculative_tokens:
            from hebrus_torch.engine.speculative import SpeculativeConfig

            overrides["speculative"] = SpeculativeConfig(_SETTINGS.speculative_tokens)
        if _SETTINGS.draft_model:
            from transformers import AutoModelForCausalLM

            draft = AutoModelForCausalLM.from_pretrained(_SETTINGS.draft_model, dtype=self.dtype).to(self.device)
        engine_config = mgr.engine_config_from(self, continuous_batching_config, workload_hints, **overrides)
        manager = mgr.HebrusBatchingManager(self, gen, continuous_batching_config, workload_hints,
                                            engine_config=engine_config, tokenizer=tokenizer, draft_model=draft)
        _MANAGERS.add(manager)
        return manager

    model.__dict__["init_continuous_batching"] = init_continuous_batching
    return model


def _model_type(model_id: str, revision: str, trust_remote_code: bool) -> str | None:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code).model_type
    except Exception:  # noqa: BLE001 - let transformers' own loader report it
        return None


def _model_manager_class():
    _, _, model_manager, _, utils = _modules()
    base = _ORIGINALS.get("ModelManager", model_manager.ModelManager)

    class HebrusModelManager(base):
        """transformers' ModelManager; a Qwen4Exp checkpoint is served as a patched text-only LLM."""

        def _is_qwen4(self, model_id_and_revision: str, gguf_file: str | None) -> bool:
            if gguf_file is not None:
                return False
            model_id, revision = model_id_and_revision.split("@", 1)
            return _model_type(model_id, revision, self.trust_remote_code) in QWEN4_MODEL_TYPES

        def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
            if not self._is_qwen4(model_id_and_revision, gguf_file):
                return super()._load_processor(model_id_and_revision, gguf_file=gguf_file)
            from transformers import AutoTokenizer

            model_id, revision = model_id_and_revision.split("@", 1)
            return AutoTokenizer.from_pretrained(model_id, revision=revision, trust_remote_code=self.trust_remote_code)

        def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None,
                        gguf_file: str | None = None):
            if not self._is_qwen4(model_id_and_revision, gguf_file):
                return super()._load_model(model_id_and_revision, tqdm_class=tqdm_class,
                                           progress_callback=progress_callback, gguf_file=gguf_file)
            from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

            model_id, revision = model_id_and_revision.split("@", 1)
            kwargs = {"revision": revision, "attn_implementation": self.attn_implementation, "dtype": self.dtype,
                      "device_map": self.device, "trust_remote_code": self.trust_remote_code,
                      "tqdm_class": tqdm_class}
            quantization_config = self.get_quantization_config()
            if quantization_config is not None:
                kwargs["quantization_config"] = quantization_config
            if progress_callback is not None:
                progress_callback({"status": "loading", "model": model_id_and_revision, "stage": "config"})
            return Qwen4ExpForCausalLM.from_pretrained(model_id, **kwargs)

        def load_model_and_processor(self, model_id_and_revision: str, progress_callback=None, tqdm_class=None,
                                     gguf_file: str | None = None):
            model, processor = super().load_model_and_processor(
                model_id_and_revision, progress_callback=progress_callback, tqdm_class=tqdm_class,
                gguf_file=gguf_file)
            if type(model).__name__ == "Qwen4ExpForCausalLM" and not getattr(model, "_hebrus_served", False):
                prepare_model(model, tokenizer=getattr(processor, "tokenizer", processor))
                model._hebrus_served = True
            return model, processor

        @staticmethod
        def get_model_modality(model, processor=None):
            if type(model).__name__ == "Qwen4ExpForCausalLM":
                return utils.Modality.LLM
            return base.get_model_modality(model, processor=processor)

        def get_gen_models(self, cache_dir: str | None = None) -> list[dict]:
            try:
                listed = list(base.get_gen_models(cache_dir))
            except Exception:  # noqa: BLE001 - no hub cache here: list the served model alone
                listed = []
            if self.force_model is not None and not any(m.get("id") == self.force_model for m in listed):
                listed.insert(0, {"id": self.force_model, "object": "model", "created": 0, "owned_by": "local"})
            return listed

    return HebrusModelManager


# -------------------------------------------------------------------------------------------- generation
def _http_error(status: int, message: str):
    from fastapi import HTTPException

    return HTTPException(status_code=status, detail=message)


def _request_kwargs(gen_config: Any) -> dict[str, Any]:
    """What one request's GenerationConfig and OpenAI options ask of the engine (sampling values only when
    sampling)."""
    kwargs: dict[str, Any] = {"max_new_tokens": gen_config.max_new_tokens, "eos_token_id": gen_config.eos_token_id,
                              "do_sample": bool(gen_config.do_sample)}
    if gen_config.do_sample:
        kwargs.update(temperature=gen_config.temperature, top_k=gen_config.top_k, top_p=gen_config.top_p)
    if gen_config.repetition_penalty is not None:
        kwargs["repetition_penalty"] = gen_config.repetition_penalty
    stops = getattr(gen_config, "stop_strings", None)
    if stops:
        kwargs["stop_strings"] = [stops] if isinstance(stops, str) else list(stops)
    options = _REQUEST_OPTIONS.get()
    if options is not None:
        kwargs.update(options.engine_kwargs())
        if options.seed is not None and gen_config.do_sample:
            kwargs["seed"] = options.seed   # the request's own generator (transformers only reseeds torch globally)
    return kwargs


def _cb_manager_class():
    _, _, _, _, utils = _modules()

    class HebrusCBGenerateManager(utils.CBGenerateManager):
        """transformers' CB bridge, talking to a hebrus manager with per-request settings."""

        def init_cb(self, model, gen_config) -> None:
            if self._cb is not None:
                return
            # The engine's defaults are the model's own; each request brings its own values (add_request).
            cb = model.init_continuous_batching(generation_config=copy.deepcopy(model.generation_config),
                                                continuous_batching_config=self._cb_config)
            try:
                cb.start()
            except Exception as err:   # no engine: this request fails with a 503, the next one tries again
                raise utils.CBWorkerDeadError(f"the hebrus engine could not start: {type(err).__name__}: {err}") \
                    from err
            self._cb = cb

        def _begin(self, inputs: dict, gen_config: Any, request_id: str) -> tuple[Any, list[int], dict[str, Any]]:
            """(manager, prompt ids, engine kwargs) of a request the engine accepts; a 400 naming the problem
            for one it would refuse, before anything is registered or queued."""
            from hebrus_torch.errors import HebrusError

            cb = self._cb
            if cb is None:
                raise RuntimeError("CB manager not initialized. Call `init_cb()` first.")
            self._check_alive(request_id)
            input_ids = inputs["input_ids"]
            kwargs = _request_kwargs(gen_config)
            checker = getattr(cb, "check_request", None)
            if checker is not None:
                try:
                    checker(input_ids, **kwargs)
                except HebrusError as err:
                    raise _http_error(400, str(err).replace("__check__", request_id)) from None
            return cb, input_ids, kwargs

        def generate_choices(self, inputs: dict, gen_config: Any, request_id: str, n: int, streaming: bool):
            """Queue the request's ``n`` choices (``request_id`` and its children ``<id>__child#<i>``, forks of
            its prompt); returns an asyncio queue of ``(choice index, GenerationOutput)`` (every output when
            streaming, else each choice's final one) and the prompt ids. The unfinished choices are cancelled
            when the HTTP request ends (streaming) or its client disconnects (not streaming)."""
            cb, input_ids, kwargs = self._begin(inputs, gen_config, request_id)
            ids = [request_id] + [f"{request_id}__child#{i}" for i in range(n - 1)]
            queue: asyncio.Queue = asyncio.Queue()
            finished: set[int] = set()

            def handler(index: int):
                def on_output(output) -> None:
                    if output.is_finished() or output.error is not None:
                        finished.add(index)
                    queue.put_nowait((index, output))
                return on_output

            for i, rid in enumerate(ids):
                cb.register_result_handler(rid, handler(i))     # before the request can produce anything
            cb.add_request(input_ids, request_id=request_id, streaming=streaming, **kwargs)

            def cancel_unfinished() -> None:
                for i, rid in enumerate(ids):
                    if i not in finished:
                        cb.cancel_request(rid)

            hooks = (_ON_REQUEST_END if streaming else _ON_DISCONNECT).get()
            if hooks is not None:
                hooks.append(cancel_unfinished)
            return queue, input_ids, cancel_unfinished

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            cb, input_ids, kwargs = self._begin(inputs, gen_config, request_id)
            loop = asyncio.get_running_loop()
            text_queue: asyncio.Queue = asyncio.Queue()
            rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
            streamer = utils.CBStreamer(cb, request_id, rust_tokenizer, loop, text_queue,
                                        response_parser=response_parser)

            finished = []

            def _on_output(output):
                if output.is_finished() or output.error is not None:
                    finished.append(True)
                try:
                    streamer.put(output)
                    if output.error is not None:
                        text_queue.put_nowait(utils._StreamError(output.error))
                        streamer.end()
                    elif output.is_finished():
                        streamer.end()
                except Exception as e:  # noqa: BLE001 - as transformers does
                    text_queue.put_nowait(utils._StreamError(str(e)))

            cb.register_result_handler(request_id, _on_output)   # before the request can produce anything
            cb.add_request(input_ids, request_id=request_id, streaming=True, **kwargs)
            # transformers cancels a stream from its SSE generator's `except GeneratorExit/CancelledError`, which
            # runs only if the disconnect reaches the generator inside an await; cut while the generator sits at
            # a `yield` (Starlette cancels its send), it runs when the abandoned generator is garbage-collected,
            # or never before the request decoded to its end. The end of the HTTP request is certain: cancel there.
            on_end = _ON_REQUEST_END.get()
            if on_end is not None:
                on_end.append(lambda: None if finished else cb.cancel_request(request_id))
            return text_queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            cb, input_ids, kwargs = self._begin(inputs, gen_config, request_id)
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def _on_result(result):
                if not future.done():
                    future.set_result(result)

            cb.register_result_handler(request_id, _on_result)
            cb.add_request(input_ids, request_id=request_id, streaming=False, **kwargs)
            # A client that goes away before the reply: nothing would notice until the reply is sent (a
            # non-streaming handler is not cancelled by Starlette), so the request would decode to its end.
            on_disconnect = _ON_DISCONNECT.get()
            if on_disconnect is not None:
                on_disconnect.append(lambda: None if future.done() else cb.cancel_request(request_id))
            try:
                result = await future
            except asyncio.CancelledError:   # the task was cancelled (shutdown): free the request's state
                cb.cancel_request(request_id)
                raise
            if result.error is not None:
                if cb.background_thread_status.fatal_error is not None:
                    raise utils.CBWorkerDeadError(f"CB worker died during request {request_id}: {result.error}")
                raise RuntimeError(f"CB generation failed for {request_id}: {result.error}")
            generated_ids = result.generated_tokens
            text = processor.decode(generated_ids, skip_special_tokens=True)
            return text, len(input_ids), generated_ids

    return HebrusCBGenerateManager


def _generation_state_class():
    _, _, _, _, utils = _modules()
    base = _ORIGINALS.get("GenerationState", utils.GenerationState)
    cb_class = _cb_manager_class()

    class HebrusGenerationState(base):
        """transformers' GenerationState whose continuous-batching bridge is :class:`HebrusCBGenerateManager`."""

        def get_manager(self, model_id: str, use_cb: bool = False):
            if use_cb and (self._cb_manager is None or self._cb_model_id != model_id):
                if self._cb_manager is not None:
                    self._cb_manager.stop()
                self._cb_manager = cb_class(cb_config=self._cb_config)
                self._cb_model_id = model_id
            return super().get_manager(model_id, use_cb=use_cb)

        def hebrus_manager(self):
            """The running HebrusBatchingManager, or None before the first request."""
            return None if self._cb_manager is None else self._cb_manager._cb

    return HebrusGenerationState


# -------------------------------------------------------------------------------------------- validation
def _check_body(body: Any, kind: str):
    """The request's :class:`~hebrus_torch.serve_choices.Options`, or a 400 naming the problem for a body
    transformers would answer with a 500 (or accept silently)."""
    if not isinstance(body, dict):
        raise _http_error(400, "the request body must be a JSON object")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _http_error(400, "`messages` must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _http_error(400, f"`messages[{i}]` must be an object with a string `role`")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise _http_error(400, f"`messages[{i}].content` must be a string or a list of content parts")
            if isinstance(content, list) and "tool_calls" not in m:   # (transformers ignores it beside tool calls)
                for j, part in enumerate(content):
                    _check_content_part(part, f"messages[{i}].content[{j}]")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _http_error(400, "`prompt` must be a non-empty string")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _http_error(400, f"`{name}` must be an integer >= 1, got {value!r}")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not 0 <= temperature <= 100):
        raise _http_error(400, f"`temperature` must be a number >= 0, got {temperature!r}")
    top_p = body.get("top_p")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise _http_error(400, f"`top_p` must be a number in (0, 1], got {top_p!r}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _http_error(400, f"`seed` must be an integer, got {seed!r}")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                            and all(isinstance(s, str) for s in stop))):
        raise _http_error(400, "`stop` must be a string or a list of strings")
    for name, default in _UNSUPPORTED.items():
        value = body.get(name)
        if not (value is None or (default is None and not value) or (default is not None and value == default)):
            raise _http_error(400, f"`{name}` = {value!r} is not supported by this server (transformers serve "
                                   f"would ignore it); see docs/serving.md for the parameters it honours")
    return _options(body, kind)


# OpenAI parameters whose non-default values the serving path would otherwise ignore silently (transformers
# serve logs them once and answers as if they were absent): refused with a 400 instead. name -> the value
# that means "not asked for" (None: any falsy value).
_UNSUPPORTED: dict[str, Any] = {"best_of": 1, "echo": None, "suffix": None}
MAX_CHOICES = 16                # the most choices (`n`) one request may ask for
MAX_LEGACY_LOGPROBS = 5         # OpenAI's cap on the legacy completions' `logprobs`


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _options(body: dict, kind: str):
    """n, logprobs, top_logprobs, logit_bias, presence_penalty, frequency_penalty and seed, checked."""
    from hebrus_torch.engine.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS
    from hebrus_torch.serve_choices import Options

    n = body.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise _http_error(400, f"`n` must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _http_error(400, f"`logprobs` must be a boolean, got {logprobs!r}")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise _http_error(400, f"`top_logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
        if top and not logprobs:
            raise _http_error(400, f"`top_logprobs` = {top} needs `logprobs` = true")
        want, top = bool(logprobs), int(top or 0)
    else:
        if top is not None:
            raise _http_error(400, "`top_logprobs` is not a parameter of /v1/completions (use `logprobs`: 0..5)")
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LEGACY_LOGPROBS):
            raise _http_error(400, f"`logprobs` must be an integer in [0, {MAX_LEGACY_LOGPROBS}], got {logprobs!r}")
        want, top = logprobs is not None, int(logprobs or 0)
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise _http_error(400, f"`logit_bias` must be an object mapping token ids to biases, got {bias!r:.60}")
    bad_keys = [k for k in bias if not (isinstance(k, str) and k.isascii() and k.isdigit())]
    if bad_keys:
        raise _http_error(400, f"`logit_bias` keys must be token ids (strings of digits), got {bad_keys[:5]!r:.120}")
    bad_values = {k: v for k, v in bias.items() if not _is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS}
    if bad_values:
        raise _http_error(400, f"`logit_bias` values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                               f"got {dict(list(bad_values.items())[:5])!r:.120}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY):
            raise _http_error(400, f"`{name}` must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        penalties[name] = float(value or 0)
    return Options(n=n, logprobs=want, top_logprobs=top, logit_bias={int(k): float(v) for k, v in bias.items()},
                   seed=body.get("seed"), **penalties)


TEXT_PART_TYPES = ("text", "input_text", "output_text")


def _check_content_part(part: Any, where: str) -> None:
    """A 400 naming ``where`` unless ``part`` is a text content part, ``{"type": "text", "text": "..."}``.

    transformers' message parsing indexes ``part["type"]`` and ``part["text"]`` unchecked (a number, a bare
    string, a part without ``type`` or a text part without ``text`` was a 500) and, for a text-only model,
    drops image/audio/video parts silently; the served model is text-only, so those are refused too.
    """
    if not isinstance(part, dict):
        raise _http_error(400, f"`{where}` must be a content part object such as "
                               f'{{"type": "text", "text": "..."}}, got {type(part).__name__} {part!r:.40}')
    kind = part.get("type")
    if not isinstance(kind, str):
        raise _http_error(400, f"`{where}.type` must be a string (\"text\"), got {kind!r:.40}")
    if kind not in TEXT_PART_TYPES:
        raise _http_error(400, f"`{where}.type` is {kind!r:.40}: the served model is text-only "
                               f"(content parts of type {', '.join(TEXT_PART_TYPES)})")
    if not isinstance(part.get("text"), str):
        raise _http_error(400, f"`{where}.text` must be a string, got {part.get('text')!r:.40}")


def _checked_handler(base, kind: str):
    """transformers' chat or completions handler whose body is checked first and whose responses on the
    batching path are built by :mod:`hebrus_torch.serve_choices` (n choices, log-probabilities, stop strings
    cut off); the sequential path (``--no-continuous-batching``) stays transformers' and refuses what it
    would ignore."""
    import inspect

    from hebrus_torch import serve_choices

    signatures = {name: inspect.signature(getattr(base, name)) for name in ("_streaming", "_non_streaming")}

    class Checked(base):
        async def handle_request(self, body: dict, request_id: str):
            token = _REQUEST_OPTIONS.set(_check_body(body, kind))
            try:
                return await super().handle_request(body, request_id)
            finally:
                _REQUEST_OPTIONS.reset(token)

        def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
            # OpenAI's frequency_penalty and logit_bias are the engine's (transformers would map the first to a
            # repetition penalty, which is not OpenAI's, and the second to a sequence bias the engine has not)
            body = {k: v for k, v in body.items() if k not in ("frequency_penalty", "logit_bias")}
            return super()._build_generation_config(body, model_generation_config, use_cb=use_cb)

        def _call(self, name: str, args: tuple, kwargs: dict):
            """The call's serve_choices.Call on the batching path, else None (after refusing what transformers'
            sequential path would ignore)."""
            bound = signatures[name].bind(self, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            options = _REQUEST_OPTIONS.get() or serve_choices.Options()
            if not hasattr(a["gen_manager"], "generate_choices"):
                beyond = options.beyond_transformers
                if beyond:
                    raise _http_error(400, f"`{beyond[0]}` needs continuous batching (this server runs "
                                           f"--no-continuous-batching)")
                return None
            return serve_choices.Call(kind, self, a["request_id"], a["model"], a["processor"], a["model_id"],
                                      a["inputs"], a["gen_config"], a["gen_manager"], options, a.get("tools"))

        def _streaming(self, *args, **kwargs):
            call = self._call("_streaming", args, kwargs)
            if call is None:
                return super()._streaming(*args, **kwargs)
            return serve_choices.stream_response(call)

        async def _non_streaming(self, *args, **kwargs):
            call = self._call("_non_streaming", args, kwargs)
            if call is None:
                return await super()._non_streaming(*args, **kwargs)
            return await serve_choices.full_response(call)

    Checked.__name__ = Checked.__qualname__ = f"Hebrus{base.__name__}"
    return Checked


# ----------------------------------------------------------------------------------------------- the app
def _run_callbacks(callbacks: list, what: str) -> None:
    for fn in callbacks:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a cleanup must not mask the request's own outcome
            logging.getLogger(__name__).exception("hebrus serve: a %s callback failed", what)


class _RequestEnd:
    """ASGI middleware: the callbacks a request registers in ``_ON_REQUEST_END`` run when its ASGI call ends
    (response complete, client gone, or error), those in ``_ON_DISCONNECT`` as soon as its client
    disconnects before that.

    The client's messages are read by one pump task and handed to the app in order (``receive`` has one
    reader): after the body, the pump waits for ``http.disconnect``, which the server sends when the
    connection closes; the app reads it too (a streaming response listens for it) and, once it came, every
    later read returns it again."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        callbacks: list = []
        on_disconnect: list = []
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()

        async def pump() -> None:
            while True:
                message = await receive()
                messages.put_nowait(message)
                if message.get("type") == "http.disconnect":
                    gone.set()
                    _run_callbacks(on_disconnect, "disconnect")
                    return

        async def app_receive():
            if gone.is_set() and messages.empty():
                return {"type": "http.disconnect"}
            return await messages.get()

        token = _ON_REQUEST_END.set(callbacks)
        token_disconnect = _ON_DISCONNECT.set(on_disconnect)
        pump_task = asyncio.create_task(pump())
        try:
            return await self.app(scope, app_receive, send)
        finally:
            on_disconnect.clear()          # a disconnect after the response is no one's concern
            pump_task.cancel()
            _ON_REQUEST_END.reset(token)
            _ON_DISCONNECT.reset(token_disconnect)
            _run_callbacks(callbacks, "request-end")


def _build_server_wrapper():
    _, _, _, server, _ = _modules()
    original = _ORIGINALS.get("build_server", server.build_server)

    def build_server(model_manager, chat_handler, *args, **kwargs):
        from fastapi.responses import JSONResponse

        app = original(model_manager, chat_handler, *args, **kwargs)
        app.add_middleware(_RequestEnd)
        state = kwargs.get("generation_state", chat_handler.generation_state)
        if _SETTINGS.api_key:
            _require_api_key(app, _SETTINGS.api_key)

        def manager():
            getter = getattr(state, "hebrus_manager", None)
            return getter() if getter is not None else None

        @app.get("/hebrus/stats")
        def hebrus_stats():
            m = manager()
            if m is None:
                return JSONResponse({"engine": None, "continuous_batching": state._continuous_batching})
            try:
                return JSONResponse(m.stats(timeout=10.0))
            except Exception as err:  # noqa: BLE001 - a dead or stuck engine says so
                return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=503)

        @app.post("/hebrus/prefix_cache/clear")
        def hebrus_clear_prefix_cache():
            m = manager()
            if m is None:
                return JSONResponse({"status": "ok", "evicted": 0})
            try:
                evicted = m.call_in_engine_thread(_clear_prefix_cache, timeout=10.0)
            except Exception as err:  # noqa: BLE001
                return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=503)
            return JSONResponse({"status": "ok", "evicted": evicted})

        if _SETTINGS.debug:
            @app.post("/hebrus/debug/kill_engine")
            def hebrus_kill_engine():
                m = manager()
                if m is None or m.engine is None:
                    return JSONResponse({"error": "no engine yet"}, status_code=409)

                def dead_step(*_a, **_k):
                    raise RuntimeError("engine killed through /hebrus/debug/kill_engine")

                m.engine.step = dead_step    # the manager's thread dies at its next step
                return JSONResponse({"status": "ok"})

        return app

    build_server.__wrapped__ = original
    return build_server


API_KEY_ENV = "HEBRUS_API_KEY"
_PROTECTED_PREFIXES = ("/v1/", "/hebrus/")


def _require_api_key(app: Any, key: str) -> None:
    """Refuse every request under ``/v1/`` and ``/hebrus/`` whose ``Authorization`` header is not ``Bearer
    <key>`` with 401 and the error body OpenAI's API sends (``invalid_api_key``). The comparison takes the same
    time wherever the two first differ (``hmac.compare_digest``), so response times do not reveal the key."""
    import hmac

    from fastapi.responses import JSONResponse

    want = ("Bearer " + key).encode()

    @app.middleware("http")
    async def check_api_key(request, call_next):
        if request.url.path.startswith(_PROTECTED_PREFIXES):
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):
                message = ("Incorrect API key provided." if got else
                           "Missing API key: send it as 'Authorization: Bearer <key>'.")
                return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                               "code": "invalid_api_key"}}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


def _clear_prefix_cache(engine) -> int:
    n = len(engine.kept_sequences())
    engine.clear_prefix_cache()
    return n


# ------------------------------------------------------------------------------------------------ shutdown
def stop_all_managers(reason: str = "the server is shutting down") -> int:
    """Stop every running hebrus manager of this process at once, failing its queued and running requests
    with ``reason`` (their streams end, so their connections close); returns how many were stopped. Safe in a
    signal handler: it only sets each manager's stop flag."""
    n = 0
    for manager in list(_MANAGERS):
        if manager.is_running():
            manager.stop(block=False, hard_stop=True, reason=reason)
            n += 1
    return n


def _uvicorn_server_class():
    import uvicorn

    base = _ORIGINALS.get("uvicorn.Server", uvicorn.Server)

    class HebrusUvicornServer(base):
        """uvicorn's server that honours SIGTERM/SIGINT promptly under load.

        uvicorn's graceful shutdown waits, without limit by default, for every open connection to close,
        that is for every request in flight (a long stream, a queue of them) to finish. Here the first
        signal also stops the engine hard (every request ends at once with an error saying the server is
        shutting down), and the wait for connections is bounded (``SHUTDOWN_GRACE_S`` unless
        ``timeout_graceful_shutdown`` is set)."""

        def __init__(self, config):
            if getattr(config, "timeout_graceful_shutdown", None) is None:
                config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S
            super().__init__(config)

        def handle_exit(self, sig, frame) -> None:
            stop_all_managers()
            super().handle_exit(sig, frame)

    return HebrusUvicornServer


# ------------------------------------------------------------------------------------------------ patching
def patch_transformers_serve(settings: HebrusServeSettings | None = None) -> None:
    """Make transformers serve (in this process) serve Qwen4Exp on the hebrus engine; see the module doc."""
    global _SETTINGS
    if settings is not None:
        _SETTINGS = settings
    chat_completion, completion, model_manager, server, utils = _modules()
    if not _ORIGINALS:
        _ORIGINALS.update(ModelManager=model_manager.ModelManager, GenerationState=utils.GenerationState,
                          build_server=server.build_server,
                          ChatCompletionHandler=chat_completion.ChatCompletionHandler,
                          CompletionHandler=completion.CompletionHandler)
        with contextlib.suppress(ImportError):
            import uvicorn

            _ORIGINALS["uvicorn.Server"] = uvicorn.Server
    if "uvicorn.Server" in _ORIGINALS:
        import uvicorn

        uvicorn.Server = _uvicorn_server_class()
    model_manager.ModelManager = _model_manager_class()
    utils.GenerationState = _generation_state_class()
    server.build_server = _build_server_wrapper()
    chat_completion.ChatCompletionHandler = _checked_handler(_ORIGINALS["ChatCompletionHandler"], "chat")
    completion.CompletionHandler = _checked_handler(_ORIGINALS["CompletionHandler"], "completion")


def unpatch_transformers_serve() -> None:
    if not _ORIGINALS:
        return
    chat_completion, completion, model_manager, server, utils = _modules()
    model_manager.ModelManager = _ORIGINALS["ModelManager"]
    utils.GenerationState = _ORIGINALS["GenerationState"]
    server.build_server = _ORIGINALS["build_server"]
    chat_completion.ChatCompletionHandler = _ORIGINALS["ChatCompletionHandler"]
    completion.CompletionHandler = _ORIGINALS["CompletionHandler"]
    if "uvicorn.Server" in _ORIGINALS:
        import uvicorn

        uvicorn.Server = _ORIGINALS["uvicorn.Server"]


# --------------------------------------------------------------------------------------------------- CLI
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
    p.add_argument("--draft-model", default=None,
                   help="a small Qwen4Exp checkpoint with the same tokenizer that drafts for speculation")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /hebrus/* (default: ${API_KEY_ENV})")
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
  --draft-model DIR               a small Qwen4Exp checkpoint (same tokenizer) that drafts instead
  --api-key KEY                   require `Authorization: Bearer KEY` on /v1/* and /hebrus/* (/health stays
                                  open); default: the HEBRUS_API_KEY environment variable

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
    if ns.draft_model is not None and not os.path.isdir(ns.draft_model):
        raise SystemExit(f"--draft-model: {ns.draft_model!r} is not a directory")
    if ns.prompt_cache_max_bytes is not None and ns.prompt_cache_max_bytes < 1:
        raise SystemExit(f"--prompt-cache-max-bytes must be >= 1, got {ns.prompt_cache_max_bytes}")
    if ns.prompt_cache_dir is not None:
        from hebrus_torch.engine.prompt_cache import check_directory

        problem = check_directory(ns.prompt_cache_dir)
        if problem is not None:
            raise SystemExit(f"--prompt-cache-dir: {problem}")
    patch_transformers_serve(HebrusServeSettings(capacity_tokens=ns.hebrus_capacity_tokens,
                                                 max_sequences=ns.hebrus_max_sequences,
                                                 prefix_cache_tokens=ns.hebrus_prefix_cache_tokens,
                                                 block_sharing=not ns.hebrus_no_prefix_sharing,
                                                 debug=ns.hebrus_debug,
                                                 prompt_cache_dir=ns.prompt_cache_dir,
                                                 prompt_cache_max_bytes=ns.prompt_cache_max_bytes,
                                                 speculative_tokens=ns.speculative_tokens,
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


if __name__ == "__main__":
    main()

"""The manager bridge: transformers serve's continuous-batching manager (``CBGenerateManager``) on a
:class:`~hebrus_torch.engine.manager.HebrusBatchingManager`, reached through its queue only.

Each HTTP request opens its engine request with its own :class:`RequestChannel`
(``HebrusBatchingManager.open_request``): the engine thread validates it and answers the channel (accepted, or
refused with the reason: a 400), then hands it the request's outputs. A manager that takes no more work (shut
down, or dead) is a 503 at once and a request id already in flight a 409, with nothing registered. The
request's own values (sampling, ``seed``, ``stop``, ``n``, log-probabilities, ``logit_bias``, penalties) come
from its ``GenerationConfig`` and the :class:`~hebrus_torch.serving.options.Options` it carries.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Callable

from transformers.cli.serving import utils as tf_utils

from hebrus_torch.engine.manager import DuplicateRequestError, ManagerStoppedError

from . import metrics as serve_metrics
from . import options as request_options
from .middleware import on_disconnect, on_request_end
from .validation import http_error

__all__ = ["engine_kwargs", "RequestChannel", "HebrusCBGenerateManager", "HebrusGenerationState"]


def engine_kwargs(gen_config: Any) -> dict[str, Any]:
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
    options = request_options.of(gen_config)
    kwargs.update(options.engine_kwargs())
    if options.seed is not None and gen_config.do_sample:
        kwargs["seed"] = options.seed   # the request's own generator (transformers only reseeds torch globally)
    return kwargs


class RequestChannel:
    """One HTTP request's result channel (a ``ResultChannel`` of the manager) on its event loop.

    The manager calls ``accepted`` / ``refused`` / ``put`` on its thread; each hops to the loop. Outputs go to
    ``on_output(choice index, GenerationOutput)`` (default: the ``outputs`` queue).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_output: Callable[[int, Any], None] | None = None):
        self._loop = loop
        self._verdict: asyncio.Future = loop.create_future()
        self.outputs: asyncio.Queue = asyncio.Queue()
        self._on_output = on_output or (lambda index, output: self.outputs.put_nowait((index, output)))
        self.finished: set[int] = set()       # choices whose final output came
        self.refused_with: BaseException | None = None

    # ---------------------------------------------------------------- the manager's thread
    def accepted(self) -> None:
        self._hop(self._settle, None)

    def refused(self, error: BaseException) -> None:
        self._hop(self._settle, error)

    def put(self, outputs: list[tuple[int, Any]]) -> None:
        self._hop(self._put, outputs)

    def _hop(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:    # the loop is closed: nobody waits for this request any more
            pass

    # ---------------------------------------------------------------- the event loop
    def _settle(self, error: BaseException | None) -> None:
        self.refused_with = error
        if not self._verdict.done():
            self._verdict.set_result(error)

    def _put(self, outputs: list[tuple[int, Any]]) -> None:
        for index, output in outputs:
            if output.is_finished():
                self.finished.add(index)
            self._on_output(index, output)

    async def wait_accepted(self) -> None:
        """Return once the engine accepted the request; an HTTP error if it refused it (400: the engine's
        reason, naming the request; 503: the manager stopped before it was taken)."""
        error = await self._verdict
        if error is not None:
            raise http_error(503 if isinstance(error, ManagerStoppedError) else 400, str(error))


_BaseCBGenerateManager = tf_utils.CBGenerateManager
_BaseGenerationState = tf_utils.GenerationState


class HebrusCBGenerateManager(_BaseCBGenerateManager):
    """transformers' CB bridge, talking to a hebrus manager through its queue, each request with its own
    channel and values."""

    def __init__(self, cb_config: Any = None):
        super().__init__(cb_config)
        self._opening: dict[str, RequestChannel] = {}    # generate_streaming's channels, until accepted()

    def init_cb(self, model, gen_config) -> None:
        if self._cb is not None:
            return
        # The engine's defaults are the model's own; each request brings its own values (open_request).
        cb = model.init_continuous_batching(generation_config=copy.deepcopy(model.generation_config),
                                            continuous_batching_config=self._cb_config)
        try:
            cb.start()
        except Exception as err:   # no engine: this request fails with a 503, the next one tries again
            raise tf_utils.CBWorkerDeadError(f"the hebrus engine could not start: {type(err).__name__}: {err}") \
                from err
        metrics = serve_metrics.current()
        if metrics is not None:
            cb.observers.append(metrics.observe)
        self._cb = cb

    @property
    def manager(self) -> Any:
        """The HebrusBatchingManager (None before the first request)."""
        return self._cb

    def failure(self, request_id: str, output: Any) -> Exception:
        """The error a failed output is answered with: 503 (``CBWorkerDeadError``) if the engine thread died,
        else a 500."""
        cb = self._cb
        if cb is not None and cb.background_thread_status.fatal_error is not None:
            return tf_utils.CBWorkerDeadError(f"CB worker died during request {request_id}: {output.error}")
        return RuntimeError(f"CB generation failed for {request_id}: {output.error}")

    def _open(self, inputs: dict, gen_config: Any, request_id: str, streaming: bool,
              on_output: Callable[[int, Any], None] | None = None) -> tuple[RequestChannel, list[int], Callable]:
        """Queue the request (all its choices) with a new channel; returns the channel, the prompt ids and a
        function that cancels its unfinished choices."""
        cb = self._cb
        if cb is None:
            raise RuntimeError("CB manager not initialized. Call `init_cb()` first.")
        self._check_alive(request_id)
        input_ids = inputs["input_ids"]
        channel = RequestChannel(asyncio.get_running_loop(), on_output)
        try:
            ids = cb.open_request(input_ids, channel, request_id=request_id, streaming=streaming,
                                  **engine_kwargs(gen_config))
        except ManagerStoppedError as err:
            raise http_error(503, str(err)) from None
        except DuplicateRequestError as err:
            raise http_error(409, str(err)) from None

        def cancel_unfinished() -> None:
            if channel.refused_with is None:
                for index, rid in enumerate(ids):
                    if index not in channel.finished:
                        cb.cancel_request(rid)

        # A stream is cancelled when its HTTP request ends (whatever ended it), a full response when its
        # client goes away (Starlette does not cancel a plain endpoint on disconnect).
        (on_request_end if streaming else on_disconnect)(cancel_unfinished)
        return channel, input_ids, cancel_unfinished

    async def generate_choices(self, inputs: dict, gen_config: Any, request_id: str, streaming: bool):
        """Queue the request's ``n`` choices (``request_id`` and its children ``<id>__child#<i>``, forks of its
        prompt) and wait until the engine accepts them; returns an asyncio queue of ``(choice index,
        GenerationOutput)`` (every output when streaming, else each choice's final one), the prompt ids and
        the function that cancels the unfinished choices."""
        channel, input_ids, cancel = self._open(inputs, gen_config, request_id, streaming)
        await channel.wait_accepted()
        return channel.outputs, input_ids, cancel

    async def final_outputs(self, queue: asyncio.Queue, n: int, cancel: Callable[[], None],
                            request_id: str) -> dict[int, Any]:
        """Each of the ``n`` choices' final output (non-streaming); a failed one is raised (``failure``)."""
        outputs: dict[int, Any] = {}
        try:
            while len(outputs) < n:
                index, output = await queue.get()
                if output.error is not None:
                    cancel()
                    raise self.failure(request_id, output)
                if output.is_finished():
                    outputs[index] = output
        except asyncio.CancelledError:      # the task was cancelled (shutdown): free the choices' state
            cancel()
            raise
        return outputs

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        loop = asyncio.get_running_loop()
        text_queue: asyncio.Queue = asyncio.Queue()
        rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
        streamer = tf_utils.CBStreamer(self._cb, request_id, rust_tokenizer, loop, text_queue,
                                       response_parser=response_parser)

        def on_output(index: int, output: Any) -> None:
            try:
                streamer.put(output)
                if output.error is not None:
                    text_queue.put_nowait(tf_utils._StreamError(output.error))
                    streamer.end()
                elif output.is_finished():
                    streamer.end()
            except Exception as e:  # noqa: BLE001 - as transformers does
                text_queue.put_nowait(tf_utils._StreamError(str(e)))

        # transformers cancels a stream from its SSE generator's `except GeneratorExit/CancelledError`, which runs
        # only if the disconnect reaches the generator inside an await; the end of the HTTP request is certain:
        # _open cancels there.
        channel, _, _ = self._open(inputs, gen_config, request_id, True, on_output)
        self._opening[request_id] = channel
        return text_queue, streamer

    async def accepted(self, request_id: str) -> None:
        """Wait until the engine accepted the request that :meth:`generate_streaming` opened (an HTTP error
        if it refused it)."""
        channel = self._opening.pop(request_id, None)
        if channel is not None:
            await channel.wait_accepted()

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        queue, input_ids, cancel = await self.generate_choices(inputs, gen_config, request_id, streaming=False)
        result = (await self.final_outputs(queue, 1, cancel, request_id))[0]
        generated_ids = result.generated_tokens
        text = processor.decode(generated_ids, skip_special_tokens=True)
        return text, len(input_ids), generated_ids


class HebrusGenerationState(_BaseGenerationState):
    """transformers' GenerationState whose continuous-batching bridge is :class:`HebrusCBGenerateManager`."""

    def get_manager(self, model_id: str, use_cb: bool = False):
        if use_cb and (self._cb_manager is None or self._cb_model_id != model_id):
            if self._cb_manager is not None:
                self._cb_manager.stop()
            self._cb_manager = HebrusCBGenerateManager(cb_config=self._cb_config)
            self._cb_model_id = model_id
        return super().get_manager(model_id, use_cb=use_cb)

    def hebrus_manager(self) -> Any:
        """The running HebrusBatchingManager, or None before the first request."""
        return None if self._cb_manager is None else self._cb_manager.manager

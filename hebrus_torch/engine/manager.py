"""The transformers-facing manager: what ``init_continuous_batching`` / ``generate_batch`` / ``transformers serve``
call, running the hebrus engine on one background thread.

``install(model)`` (run by ``hebrus_torch.integrations.transformers.apply``) sets
``model.init_continuous_batching`` on the instance, so transformers' own ``generate_batch``,
``continuous_batching_context_manager`` and ``transformers serve --continuous-batching`` get a
:class:`HebrusBatchingManager`. It has the public surface of transformers 5.23's
``ContinuousBatchingManager`` (``start``, ``stop``, ``join``, ``destroy``, ``is_running``,
``warmup``/``warmed_up``, ``add_request(s)``, ``cancel_request``, ``get_result``, ``__iter__``,
``request_id_iter``, ``register_result_handler``, ``background_thread_status``,
``batch_processor.scheduler``) and delivers transformers' ``GenerationOutput`` objects. Only the
manager's thread runs steps; other threads talk to it through queues.

The manager's queue is the only way from other threads to the engine: ``add_request`` and
``open_request`` queue what they were given, and the engine thread validates it (``Engine.make_request``,
which reads the engine's request table) and submits it between two steps. A request the engine refuses
(empty prompt, ids outside the vocabulary, a prompt longer than the cache, bad sampling values) is
answered there with a FAILED ``GenerationOutput`` whose ``error`` names the problem (``open_request``:
its channel's ``refused``); the others are unaffected.

Servers use :meth:`HebrusBatchingManager.open_request`: each request brings its own
:class:`ResultChannel`, registered with the request in one step under the intake lock, so a request id
already open is refused (:class:`DuplicateRequestError`) before anything of the first one is touched,
and a manager that takes no more work refuses at once (:class:`ManagerStoppedError`) instead of leaving
the caller waiting for outputs that never come.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from ..errors import HebrusError
from .engine import Engine, EngineConfig, StepOutput, _token_ids
from .requests import Request, RequestStatus
from .sampling import BadRequestError, SamplingParams
from .speculative import MAX_DRAFT_TOKENS, SpeculativeConfig

__all__ = ["HebrusBatchingManager", "ResultChannel", "ManagerStoppedError", "DuplicateRequestError", "install",
           "uninstall", "engine_config_from", "choice_seed"]

logger = logging.getLogger(__name__)
_INSTALLED = "_hebrus_cb_installed"


class ManagerStoppedError(HebrusError):
    """The manager takes no new work: it was stopped (or is stopping), or its thread died."""


class DuplicateRequestError(BadRequestError):
    """A request id that is already open on this manager (its first request is left untouched)."""


class ResultChannel(Protocol):
    """Where the outputs of one request (all its choices) go; the manager calls it on its own thread.

    Exactly one of ``accepted`` / ``refused`` is called first, then (after ``accepted``) ``put`` with each
    step's outputs, the last of each choice being final (``is_finished()``). Implementations must not
    block or raise (hand the values to another thread or event loop).
    """

    def accepted(self) -> None: ...

    def refused(self, error: HebrusError) -> None: ...

    def put(self, outputs: list[tuple[int, Any]]) -> None:
        """``(choice index, GenerationOutput)`` pairs of one step, in order."""


@dataclass(eq=False)
class _Intake:
    """A request as a caller gave it, queued for the engine thread (which validates and submits it)."""

    prompt: Any
    ids: list[str]                  # the request's id, then its children's (choice 1, 2, ...)
    num_return_sequences: Any
    kwargs: dict[str, Any]          # make_request's keywords, sampling values among them
    channel: ResultChannel | None   # None: outputs go to the output router (transformers' API)


# make_request's own keywords among an intake's (the rest are sampling values, ``_sampling``'s)
_REQUEST_FIELDS = ("max_new_tokens", "streaming", "record_timestamps", "eos_token_id", "stop_strings", "constraint")


def _tf():
    from transformers.generation.continuous_batching import continuous_api, requests as tf_requests
    return continuous_api, tf_requests


def engine_config_from(model: torch.nn.Module, cb_config: Any = None, workload_hints: Any = None,
                       **overrides: Any) -> EngineConfig:
    """An EngineConfig from transformers' ``ContinuousBatchingConfig`` (and ``WorkloadHints``).

    ``max_batch_tokens``, ``max_requests_per_batch`` and ``allow_block_sharing`` are taken as they are;
    ``page_size`` is the prefix-sharing block; the cache holds ``num_blocks * page_size`` positions when
    ``num_blocks`` is set, else enough for the hinted workload (at least 4096 and at most 65536).
    """
    get = (lambda name, default=None: getattr(cb_config, name, default) if cb_config is not None else default)
    page = int(get("page_size", 256) or 256)
    hinted = 0
    max_seqs = get("max_requests_per_batch") or 32
    if workload_hints is not None:
        n = getattr(workload_hints, "num_requests", None) or 0
        per = (getattr(workload_hints, "max_prompt_length", 0) or 0) + (
            getattr(workload_hints, "max_generated_length", 0) or 0)
        hinted = n * (per + 1)
        if n and not get("max_requests_per_batch"):
            max_seqs = min(64, max(1, n))
    capacity = get("num_blocks") * page if get("num_blocks") else min(65536, max(4096, hinted))
    kwargs = dict(capacity_tokens=int(capacity), max_sequences=int(max_seqs),
                  max_batch_tokens=get("max_batch_tokens") or 512,
                  max_requests_per_batch=get("max_requests_per_batch"),
                  allow_block_sharing=bool(get("allow_block_sharing", True)), block_size=page)
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


class _BatchProcessor:
    """What transformers serve reads off ``manager.batch_processor``: the scheduler (and the engine)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.cache = engine.cache


class HebrusBatchingManager:
    """Continuous batching on the hebrus engine behind transformers' manager API.

    Args:
        model: the (patched) Qwen4Exp model.
        generation_config: defaults for every request (``max_new_tokens``, ``eos_token_id``, sampling,
            ``num_return_sequences``).
        continuous_batching_config: transformers' ``ContinuousBatchingConfig`` (see :func:`engine_config_from`).
        workload_hints: transformers' ``WorkloadHints`` (sizes the cache when ``num_blocks`` is unset).
        engine_config: an explicit ``EngineConfig`` (overrides the two above).
        tokenizer: for stop strings.
        draft_model: a small Qwen4Exp that drafts for speculative decoding (default: the generation config's
            ``assistant_model`` attribute, transformers' name for it; ``prompt_lookup_num_tokens`` there
            turns on prompt lookup instead).
    """

    def __init__(self, model: torch.nn.Module, generation_config: Any = None, continuous_batching_config: Any = None,
                 workload_hints: Any = None, *, engine_config: EngineConfig | None = None, tokenizer: Any = None,
                 draft_model: torch.nn.Module | None = None):
        continuous_api, _ = _tf()
        self.model = model.eval()
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        self.continuous_batching_config = continuous_batching_config
        self.engine_config = engine_config or engine_config_from(model, continuous_batching_config, workload_hints)
        if (getattr(self.generation_config, "speculative_method", None) == "mtp"
                and self.engine_config.speculative is None):
            # (generate_batch: GenerationConfig(speculative_method="mtp", num_assistant_tokens=k), and its
            # assistant_confidence_threshold, when set, as the drafter's confidence_threshold)
            k = getattr(self.generation_config, "num_assistant_tokens", None) or 3
            threshold = getattr(self.generation_config, "assistant_confidence_threshold", None)
            extra = {} if threshold is None else {"confidence_threshold": threshold}
            self.engine_config = dataclasses.replace(self.engine_config, speculative=SpeculativeConfig(
                min(int(k), MAX_DRAFT_TOKENS), method="mtp", **extra))
        self.tokenizer = tokenizer
        self.draft_model = (draft_model if draft_model is not None
                            else getattr(self.generation_config, "assistant_model", None))
        n = getattr(self.generation_config, "num_return_sequences", None)
        self.num_return_sequences = n if n is not None else 1
        self.background_thread_status = continuous_api.BackgroundThreadStatus()
        self.output_router = continuous_api.OutputRouter()
        self.input_queue: queue.Queue[_Intake] = queue.Queue()
        self.cancel_queue: queue.Queue[str] = queue.Queue()
        self.control_queue: queue.Queue[tuple[Callable[[Engine], Any], Future]] = queue.Queue()
        self.cancelled_requests = 0     # requests cancelled while queued or running (serving: disconnects)
        self.warmed_up = False
        self.batch_processor: _BatchProcessor | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._counter = 0
        self._lock = threading.Lock()
        self._stop_mode: str | None = None
        self._stop_reason = "the manager was stopped"
        # Taken by whoever queues work (requests, engine calls) and by the thread when it stops for good: work
        # is either refused or queued before the thread's last drain, never left in a queue nobody reads.
        self._intake_lock = threading.Lock()
        self._open: dict[str, tuple[_Intake, int]] = {}    # request id -> (its intake, its choice index)
        self.engine: Engine | None = None
        self.observers: list[Callable[[Engine, list[StepOutput]], None]] = []
        """Called on the engine's thread after every step with its outputs (a server's metrics); one that raises
        is dropped (logged), the engine goes on."""

    # ------------------------------------------------------------------ lifecycle
    def _ensure_engine(self) -> Engine:
        if self.engine is None:
            self.engine = Engine(self.model, self.engine_config, generation_config=self.generation_config,
                                 tokenizer=self.tokenizer, draft_model=self.draft_model)
            self.batch_processor = _BatchProcessor(self.engine)
        return self.engine

    def warmup(self) -> None:
        """Build the engine (its cache) ahead of the first request."""
        self._ensure_engine()
        self.warmed_up = True

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.is_running():
            logger.warning("hebrus manager: the thread is already running")
            return
        self._ensure_engine()
        self.background_thread_status.clear()
        self._stop_mode = None
        self._thread = threading.Thread(target=self._loop, name="hebrus-continuous-batching", daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False, reason: str = "the manager was stopped") -> None:
        """Stop the thread after the queued requests finish (``hard_stop``: at once, failing them with
        ``reason``). From this call on, new requests are refused."""
        if self._thread is None:
            logger.warning("hebrus manager: not started")
            return
        with self._intake_lock:
            self._stop_reason = reason
            if self._stop_mode != "hard":
                self._stop_mode = "hard" if hard_stop else "flush"
        self._wake.set()
        if block:
            self.join(timeout)
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self
        elif not self.is_running():
            if self.engine is not None:
                self.engine.close()     # its prompt cache directory, for a later engine
            self.batch_processor = None
            self.engine = None

    def join(self, timeout: float | None = None, *args: Any) -> None:
        if args:  # transformers' join(stop_trigger_time, timeout)
            timeout = args[0]
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if not self._thread.is_alive():
                self._thread = None

    def destroy(self) -> None:
        if self.is_running():
            self.stop(block=True)

    # ------------------------------------------------------------------ requests
    def _denial(self) -> str | None:
        """Why no new work is taken now (None: it is). Call with the intake lock held."""
        denial = self.background_thread_status.can_accept_new_requests()
        if denial is None and self._stop_mode is not None:
            denial = "The background thread is stopping."
        return denial

    def _intake(self, input_ids: Any, request_id: str | None, num_return_sequences: int | None,
                channel: ResultChannel | None, kwargs: dict[str, Any]) -> _Intake:
        if request_id is None:
            with self._lock:
                request_id = f"req_{self._counter}"
                self._counter += 1
        n = self.num_return_sequences if num_return_sequences is None else num_return_sequences
        valid_n = isinstance(n, int) and not isinstance(n, bool) and n >= 1
        ids = [request_id] + [f"{request_id}__child#{i}" for i in range(n - 1 if valid_n else 0)]
        return _Intake(input_ids, ids, n, kwargs, channel)

    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False,
                    eos_token_id: int | list[int] | None = None, stop_strings: list[str] | str | None = None,
                    num_return_sequences: int | None = None, **logit_processor_kwargs: Any) -> str | None:
        """Queue one request (plus its ``num_return_sequences - 1`` children); returns its id (None, with a
        warning, when the manager takes no new work). Its outputs go to the output router
        (``get_result``, ``register_result_handler``).

        The children ``<id>__child#<i>`` (choice i + 1; the request itself is choice 0) are forks of the
        request: its prompt is prefilled once, and each child samples from there with its own generator,
        seeded from ``seed`` and its choice index (:func:`choice_seed`) when a seed is given.
        Sampling values in ``logit_processor_kwargs`` (temperature, top_k, top_p, repetition_penalty,
        do_sample, seed, logprobs, top_logprobs, logit_bias (a mapping of token id -> bias),
        presence_penalty, frequency_penalty) override the generation config for this request;
        ``stop_strings`` need the manager's tokenizer. ``num_return_sequences`` overrides the generation
        config's. ``constraint`` (structured output: a ``constraints.Constraint``, which needs the manager's
        tokenizer, or a ``CompiledConstraint``) constrains every choice; without it, the generation config's
        ``constraint`` attribute does (what ``generate_batch`` passes for all its prompts). The engine thread
        validates the request: one it refuses gets FAILED outputs naming why.
        """
        kwargs = dict(logit_processor_kwargs, max_new_tokens=max_new_tokens, streaming=streaming,
                      record_timestamps=record_timestamps, eos_token_id=eos_token_id, stop_strings=stop_strings)
        intake = self._intake(input_ids, request_id, num_return_sequences, None, kwargs)
        with self._intake_lock:
            denial = self._denial()
            if denial is None:
                for index, rid in enumerate(intake.ids):
                    self._open.setdefault(rid, (intake, index))   # (a duplicate id is the engine's to refuse)
                self.input_queue.put(intake)
        if denial is not None:
            logger.warning(f"{denial}; request dropped")
            return None
        self._wake.set()
        return intake.ids[0]

    def open_request(self, input_ids: Sequence[int], channel: ResultChannel, *, request_id: str,
                     num_return_sequences: int | None = None, max_new_tokens: int | None = None,
                     streaming: bool = False, eos_token_id: int | list[int] | None = None,
                     stop_strings: list[str] | str | None = None, **sampling_kwargs: Any) -> list[str]:
        """Queue a request whose outputs go to its own ``channel`` (what servers use); returns the ids of its
        choices (``request_id`` and its children, as :meth:`add_request`).

        The engine thread validates it and calls ``channel.accepted()`` or ``channel.refused(error)``
        (a ``BadRequestError`` naming the problem), then ``channel.put`` with its outputs.

        Raises:
            ManagerStoppedError: the manager takes no new work (stopped, stopping, or its thread died);
                nothing was registered.
            DuplicateRequestError: one of the ids is already open (the open request is not touched).
        """
        kwargs = dict(sampling_kwargs, max_new_tokens=max_new_tokens, streaming=streaming, record_timestamps=False,
                      eos_token_id=eos_token_id, stop_strings=stop_strings)
        intake = self._intake(input_ids, request_id, num_return_sequences, channel, kwargs)
        with self._intake_lock:
            denial = self._denial()
            if denial is not None:
                raise ManagerStoppedError(f"hebrus manager: request {request_id!r} refused: {denial}")
            taken = [rid for rid in intake.ids if rid in self._open]
            if taken:
                raise DuplicateRequestError(f"request id {taken[0]!r} is already in flight")
            for index, rid in enumerate(intake.ids):
                self._open[rid] = (intake, index)
            self.input_queue.put(intake)
        self._wake.set()
        return list(intake.ids)

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs: Any) -> list[str]:
        with self._lock:
            ids = [f"req_{i}" for i in range(self._counter, self._counter + len(inputs))]
            self._counter += len(inputs)
        gen = self.generation_config
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        for rid, prompt in zip(ids, inputs):
            self.add_request(prompt, request_id=rid, max_new_tokens=max_new_tokens, streaming=streaming,
                             record_timestamps=record_timestamps, eos_token_id=eos, **logit_processor_kwargs)
        return ids

    def check_request(self, input_ids: list[int], max_new_tokens: int | None = None,
                      eos_token_id: int | list[int] | None = None, stop_strings: list[str] | str | None = None,
                      timeout: float | None = 10.0, **logit_processor_kwargs: Any) -> None:
        """Validate a request as the engine would, without queueing it (on the engine's thread, through
        :meth:`call_in_engine_thread`).

        Raises:
            BadRequestError: what the engine would refuse (empty prompt, ids outside the vocabulary, a prompt
                longer than the cache, ``max_new_tokens`` < 1, bad sampling values, stop strings without a
                tokenizer).
            ManagerStoppedError: the manager has no engine (stopped, or never started or warmed up).
        """
        logit_processor_kwargs.pop("num_return_sequences", None)

        def check(engine: Engine) -> None:
            engine.make_request(input_ids, request_id="__check__", max_new_tokens=max_new_tokens,
                                sampling=self._sampling(logit_processor_kwargs), eos_token_id=eos_token_id,
                                stop_strings=stop_strings)
        self.call_in_engine_thread(check, timeout=timeout)

    def call_in_engine_thread(self, fn: Callable[[Engine], Any], timeout: float | None = 10.0) -> Any:
        """Run ``fn(engine)`` on the manager's thread between two steps and return its result (or raise its
        error); called directly when no thread runs (before ``start``, or after the thread ended while its
        engine is kept). The engine is never touched by two threads, and none is built here.

        Raises:
            ManagerStoppedError: there is no engine (the manager was stopped, or never started or warmed up).
        """
        fut: Future = Future()
        with self._intake_lock:
            engine = self.engine
            queued = self.is_running() and self.background_thread_status.local_status < \
                self.background_thread_status.STOPPED
            if queued:
                self.control_queue.put((fn, fut))
        if not queued:
            if engine is None:
                raise ManagerStoppedError("hebrus manager: no engine (the manager is stopped or not started)")
            return fn(engine)
        self._wake.set()
        return fut.result(timeout=timeout)

    def stats(self, timeout: float | None = 10.0) -> dict[str, Any]:
        """Capacity and counters of the engine, read on its thread (a consistent snapshot)."""
        if self.engine is None:
            return {"engine": None, "running": self.is_running(), "cancelled_requests": self.cancelled_requests,
                    "fatal_error": _describe(self.background_thread_status.fatal_error)}
        snap = self.call_in_engine_thread(engine_stats, timeout=timeout)
        snap.update(running=self.is_running(), cancelled_requests=self.cancelled_requests,
                    fatal_error=_describe(self.background_thread_status.fatal_error))
        return snap

    def cancel_request(self, request_id: str) -> None:
        self.cancel_queue.put(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None):
        q = self.output_router.output_queue
        if q.empty() and (self._thread is None or self.background_thread_status.fatal_error is not None):
            return None
        try:
            result = q.get(block=True, timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            q.put(result)
            return None
        return result

    def __iter__(self) -> Iterator[Any]:
        while self.is_running() or not self.output_router.output_queue.empty():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Iterator[Any]:
        while self.is_running() or not self.output_router.output_queue.empty():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    def register_result_handler(self, request_id: str, callback: Callable) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        router = self.output_router

        def auto_cleanup(result: Any) -> None:
            callback(result)
            if result.is_finished():
                with router._lock:
                    router.result_handlers.pop(request_id, None)

        with router._lock:
            router.result_handlers[request_id] = (auto_cleanup, loop)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        engine = self.engine
        try:
            with torch.inference_mode():
                while True:
                    self._drain_inputs(engine)
                    if self._stop_mode == "hard":
                        self._fail_remaining(engine, self._stop_reason)
                        break
                    if engine.has_unfinished():
                        self._deliver(engine.step())
                        continue
                    if self._stop_mode == "flush" and self.input_queue.empty():
                        break
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
        except Exception as err:  # noqa: BLE001 - a dead engine fails everything and says why
            logger.error("hebrus manager: the engine thread died", exc_info=True)
            self.background_thread_status.record_fatal_error(err)
            self._fail_remaining(engine, f"engine error: {type(err).__name__}: {err}")
        finally:
            with self._intake_lock:     # nothing is queued after this: what is left is refused
                self.background_thread_status.mark_as_stopped()
                leftover = self._take_inputs()
                calls = []
                while True:
                    try:
                        calls.append(self.control_queue.get_nowait())
                    except queue.Empty:
                        break
            for intake in leftover:
                self._refuse(intake, ManagerStoppedError(f"hebrus manager: {self._stop_reason}"))
            for _, fut in calls:   # nobody will run these any more
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(HebrusError("hebrus manager: the engine thread has stopped"))

    def _take_inputs(self) -> list[_Intake]:
        taken = []
        while True:
            try:
                taken.append(self.input_queue.get_nowait())
            except queue.Empty:
                return taken

    def _drain_inputs(self, engine: Engine) -> None:
        for intake in self._take_inputs():
            self._admit(engine, intake)
        while True:
            try:
                engine.cancel(self.cancel_queue.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                fn, fut = self.control_queue.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(engine))
                except Exception as err:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(err)

    def _admit(self, engine: Engine, intake: _Intake) -> None:
        """Validate and submit one queued request, on the engine thread (``make_request`` reads the engine's
        request table, which only this thread writes)."""
        n, kwargs = intake.num_return_sequences, intake.kwargs
        try:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise BadRequestError(f"num_return_sequences must be an int >= 1, got {n!r}")
            seed = kwargs.get("seed")
            fields = {k: kwargs.get(k) for k in _REQUEST_FIELDS}
            if fields["constraint"] is None:      # generate_batch: the generation config's, for every request
                fields["constraint"] = getattr(self.generation_config, "constraint", None)
            reqs = [engine.make_request(intake.prompt, request_id=rid,
                                        sampling=self._sampling({**kwargs, "seed": choice_seed(seed, i)}), **fields)
                    for i, rid in enumerate(intake.ids)]
            reqs[0].forks = reqs[1:]
            engine.submit(reqs[0])
        except HebrusError as err:
            self._refuse(intake, err)
            return
        if intake.channel is not None:
            intake.channel.accepted()

    def _close(self, intake: _Intake) -> None:
        with self._intake_lock:
            for rid in intake.ids:
                if self._open.get(rid, (None,))[0] is intake:
                    del self._open[rid]

    def _refuse(self, intake: _Intake, err: HebrusError) -> None:
        """Answer a request that never entered the engine: its channel's ``refused``, or FAILED outputs."""
        self._close(intake)
        if intake.channel is not None:
            intake.channel.refused(err)
        else:
            for rid in intake.ids:
                self.output_router.deliver(self._failed_output(rid, intake.prompt, str(err)))

    def _route(self, outputs: list[Any]) -> None:
        """Hand outputs to their requests' channels, the others to the output router; a final output closes its
        choice."""
        by_channel: dict[int, tuple[ResultChannel, list]] = {}
        plain = []
        with self._intake_lock:
            for out in outputs:
                intake, index = self._open.get(out.request_id, (None, 0))
                if intake is not None and out.is_finished():
                    del self._open[out.request_id]
                if intake is None or intake.channel is None:
                    plain.append(out)
                else:
                    by_channel.setdefault(id(intake), (intake.channel, []))[1].append((index, out))
        for channel, items in by_channel.values():
            channel.put(items)
        if plain:
            self.output_router.deliver_batch(plain)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for observer in list(self.observers):
            try:
                observer(self.engine, outputs)
            except Exception:  # noqa: BLE001 - an observer's failure is not the engine's
                logger.exception("hebrus manager: an observer failed; it is dropped")
                self.observers.remove(observer)
        ready = [self.to_generation_output(o.request) for o in outputs
                 if o.finished or o.request.streaming]
        for o in outputs:
            if o.finished:
                if o.request.status is RequestStatus.CANCELLED:
                    self.cancelled_requests += 1
                # a long-running manager must not keep every finished request (the engine indexes them by id)
                if self.engine is not None and self.engine.requests.get(o.request.request_id) is o.request:
                    del self.engine.requests[o.request.request_id]
        if ready:
            self._route(ready)

    def _fail_remaining(self, engine: Engine | None, message: str) -> None:
        for intake in self._take_inputs():     # queued, never validated: refused with the reason
            self._refuse(intake, ManagerStoppedError(message) if intake.channel is not None else HebrusError(message))
        pending = []
        if engine is not None:
            running = list(engine.scheduler.requests())
            pending += running + [f for r in running for f in r.forks if not f.status.is_done]
            for req in running:
                try:
                    engine._finish(req, RequestStatus.FAILED, message)
                except Exception:  # noqa: BLE001 - the engine may be what failed
                    req.status, req.error = RequestStatus.FAILED, message
        for req in pending:
            req.status, req.error = RequestStatus.FAILED, message
        self._route([self.to_generation_output(req) for req in pending])

    # ------------------------------------------------------------------ conversions
    def _sampling(self, kwargs: dict[str, Any]) -> SamplingParams:
        known = {k: kwargs[k] for k in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
                                        "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty")
                 if k in kwargs}
        bias = kwargs.get("logit_bias")
        if bias:
            if not isinstance(bias, dict):
                raise BadRequestError(f"logit_bias must be a mapping of token id -> bias, got {bias!r:.80}")
            known["logit_bias"] = tuple(sorted(bias.items()))
        try:
            return SamplingParams.from_generation_config(self.generation_config, **known)
        except (TypeError, ValueError) as err:
            raise BadRequestError(f"bad sampling parameters: {err}") from None

    @staticmethod
    def to_generation_output(req: Request):
        _, tf_requests = _tf()
        status = {RequestStatus.WAITING: tf_requests.RequestStatus.PENDING,
                  RequestStatus.PREFILLING: tf_requests.RequestStatus.PREFILLING,
                  RequestStatus.DECODING: tf_requests.RequestStatus.DECODING,
                  RequestStatus.FINISHED: tf_requests.RequestStatus.FINISHED,
                  RequestStatus.FAILED: tf_requests.RequestStatus.FAILED,
                  RequestStatus.CANCELLED: tf_requests.RequestStatus.FAILED}[req.status]
        out = tf_requests.GenerationOutput(
            request_id=req.request_id, prompt_ids=list(req.prompt), generated_tokens=list(req.generated),
            logprobs=list(req.logprobs), error=req.error, status=status, created_time=req.created_time,
            lifespan=(req.first_scheduled_time, req.finished_time),
            timestamps=list(req.timestamps) if req.record_timestamps else None)
        # (beyond transformers' fields) the top alternatives per token, and why the request finished
        out.top_logprobs = list(req.top_logprobs)
        out.finish_reason = req.finish_reason.value if req.finish_reason is not None else None
        return out

    def _failed_output(self, request_id: str, prompt: Any, message: str):
        _, tf_requests = _tf()
        try:   # the prompt as given when it is token ids, else nothing (a refused "123" is not [1, 2, 3])
            prompt_ids = _token_ids(prompt, "prompt")
        except BadRequestError:
            prompt_ids = []
        return tf_requests.GenerationOutput(request_id=request_id, prompt_ids=prompt_ids, error=message,
                                            status=tf_requests.RequestStatus.FAILED)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed``: ``seed`` itself for choice 0 (so
    choice 0 of ``n`` choices is the reply to the same request with one), a 63-bit mix of both otherwise
    (splitmix64's finaliser: nearby seeds and indices give unrelated streams). None stays None."""
    if seed is None or index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def engine_stats(engine: Engine) -> dict[str, Any]:
    """Capacity, occupancy and counters of an engine (call it on the engine's own thread)."""
    import dataclasses

    sched = engine.scheduler
    return {
        "engine": type(engine).__name__,
        "capacity_tokens": engine.config.capacity_tokens,
        "free_cells": engine._free_cells(),
        "max_sequences": engine.config.max_sequences,
        "live_sequences": int(engine.cache.slots.live.sum()),
        "block_size": engine.config.block_size,
        "max_batch_tokens": engine.config.max_batch_tokens,
        "running_requests": len(sched.running),
        "waiting_requests": len(sched.waiting),
        "kept_sequences": len(engine.kept_sequences()),
        "kept_tokens": sum(engine._kept.values()),
        "prefix_cache_tokens": engine.prefix_cache_tokens,
        "prompt_cache_dir": (str(engine.prompt_cache.directory) if engine.prompt_cache is not None else None),
        "prompt_cache_files": len(engine.prompt_cache) if engine.prompt_cache is not None else 0,
        "prompt_cache_bytes": engine.prompt_cache.total_bytes if engine.prompt_cache is not None else 0,
        "counters": dataclasses.asdict(engine.counters),
        # the PLE table on disk: its steps' rows gathered on a worker thread (docs/ple.md, "Prefetch"); else None
        "ple_prefetch": (dict(engine.runner.forward.prefetcher.stats)
                         if engine.runner.forward.prefetcher is not None else None),
    }


def _describe(err: BaseException | None) -> str | None:
    return None if err is None else f"{type(err).__name__}: {err}"


def _init_continuous_batching(self, generation_config: Any = None, continuous_batching_config: Any = None,
                              workload_hints: Any = None) -> HebrusBatchingManager:
    cached = getattr(self, "_cached_continuous_batching_manager", None)
    if isinstance(cached, HebrusBatchingManager):
        return cached
    gen = generation_config if generation_config is not None else self.generation_config
    if continuous_batching_config is None:
        continuous_batching_config = getattr(gen, "continuous_batching_config", None)
    return HebrusBatchingManager(self, gen, continuous_batching_config, workload_hints)


def install(model: torch.nn.Module) -> None:
    """Make transformers' continuous-batching entry points of this model instance use the hebrus engine."""
    if getattr(model, _INSTALLED, False):
        return
    # A function holding a weak reference, not a bound method: the model must not reference itself, or a
    # patched model dropped without revert would live on until the cyclic GC (and stay "applied").
    ref = weakref.ref(model)

    def init_continuous_batching(generation_config: Any = None, continuous_batching_config: Any = None,
                                 workload_hints: Any = None) -> HebrusBatchingManager:
        return _init_continuous_batching(ref(), generation_config, continuous_batching_config, workload_hints)

    model.__dict__["init_continuous_batching"] = init_continuous_batching
    setattr(model, _INSTALLED, True)


def uninstall(model: torch.nn.Module) -> None:
    if getattr(model, _INSTALLED, False):
        model.__dict__.pop("init_continuous_batching", None)
        model.__dict__.pop(_INSTALLED, None)
        cached = model.__dict__.pop("_cached_continuous_batching_manager", None)
        if isinstance(cached, HebrusBatchingManager):
            cached.destroy()

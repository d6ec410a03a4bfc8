"""The native engine: ``Engine(model)``, ``add_request``, ``step()``.

One ``step()`` reads as schedule -> execute -> update:

- schedule: cancellations are applied, the step's drafts are proposed (``drafting.py``), and the scheduler
  plans the step with its cache manager (``scheduler.py``, ``cache_manager.py``: admission gives requests a
  sequence of the ModelCache, maybe forked from a shared prefix or restored from a file);
- execute: the runner runs the plan as one transaction, inside which the step's tokens are read off its
  logits (sampling, verification; ``LogitsLayout`` says where each row's logits sit). A step that raises
  anywhere before its tokens are known publishes nothing (the transaction rolls every holder back and the
  requests' generators are put back); it is retried once, and if it raises again its requests fail with the
  error while the others go on. A ``CapacityError`` (the cache is out of cells) evicts kept prefixes or
  preempts the newest request and replans instead;
- update: ``outputs.apply_step`` applies the tokens to the requests (the one place a step moves
  ``num_computed``), cuts verification rows back, finishes requests. A step that can plan nothing while work
  is left fails the request that cannot progress with a ``CapacityError`` message (the engine never spins on
  empty steps).

Users who drive the loop themselves call ``step()`` until ``has_unfinished()`` is False; the
transformers-facing manager (``hebrus_torch.engine.manager``) runs the same loop on a thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import CapacityError, HebrusError
from ..gdn.chunked import CHUNK
from ..model_cache import ModelCache
from ..state.handles import SeqHandle
from .cache_manager import CacheManager
from .config import EngineConfig, EngineCounters
from .constraints import MaskBuffer, grammar_drafts, mask_logits
from .drafting import propose_drafts
from .intake import build_request, id_set as _id_set, token_ids as _token_ids  # noqa: F401  (their old home)
from .logits_layout import LogitsLayout
from .outputs import StepOutput, StepResult, apply_step, fail, finish
from .prefix import PrefixIndex
from .prompt_cache import PromptCacheStore, fingerprint
from .requests import Request, RequestStatus
from .runner import ModelRunner, find_text_model
from .sampling import BadRequestError, Pick, SamplingParams, reads_history, sample_rows_reading
from .scheduler import ScheduledChunk, Scheduler, StepPlan
from .speculative import SpeculativeConfig, Verdict, verification

__all__ = ["Engine", "EngineConfig", "StepOutput", "BadRequestError"]


class Engine:
    """Continuous batching with chunked prefill over one ``ModelCache``.

    Args:
        model: a transformers Qwen4Exp causal LM (``hx.apply`` need not have run).
        config: sizes and policies.
        generation_config: defaults for requests (max_new_tokens, eos, sampling); the model's own if None.
        tokenizer: decodes outputs for stop strings (optional).
        cache: a ModelCache to use instead of building one from ``model``; the engine runs on it alone from then on
            (one engine a cache: its ``owner``; its ``load_state_dict`` is refused, ``state_dict`` still works; once
            this engine is discarded, ``cache.owner = None`` hands the cache to another one).
        prompt_cache_dir: ``config.prompt_cache_dir`` (either may be given; both only if equal).
        drafter: for requests that speculate, ``drafter(request, k)`` gives up to k draft tokens to follow
            the request's stream (``request.tokens``) instead of prompt lookup (a test's oracle, or a
            ``DraftModelDrafter``, whose ``propose_batch``, ``draft_probs`` and ``release`` the engine also
            uses when present). Called on the engine's thread before each step is planned.
        draft_model: a smaller model with the same tokenizer: ``drafter`` becomes a ``DraftModelDrafter``
            over it for a Qwen4Exp (batched, its own ModelCache), a ``CausalLMDrafter`` for any other
            transformers causal LM (``engine/draft_model.py``); requests speculate by default with the
            generation config's ``num_assistant_tokens`` (5 when unset).

    Raises:
        HebrusError: ``prompt_cache_dir`` is held by another engine (one process per directory).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, *,
                 generation_config: Any = None, tokenizer: Any = None, cache: ModelCache | None = None,
                 prompt_cache_dir: str | os.PathLike | None = None,
                 drafter: Callable[[Request, int], Sequence[int]] | None = None,
                 draft_model: torch.nn.Module | None = None):
        self.model = model
        self.drafter = drafter
        self.config = config or EngineConfig()
        if prompt_cache_dir is not None:
            held = self.config.prompt_cache_dir
            if held is not None and os.fspath(held) != os.fspath(prompt_cache_dir):
                raise HebrusError(f"Engine: prompt_cache_dir={prompt_cache_dir!r} differs from the config's "
                                  f"{held!r}")
            self.config = dataclasses.replace(self.config, prompt_cache_dir=prompt_cache_dir)
        cfg = self.config
        self.text_config = find_text_model(model).config
        self.vocab_size = int(self.text_config.vocab_size)
        self.generation_config = generation_config if generation_config is not None else getattr(
            model, "generation_config", None)
        self.tokenizer = tokenizer
        mtp = None
        if cfg.speculative is not None and cfg.speculative.method == "mtp":
            from .mtp import mtp_model_cache, mtp_module

            mtp = mtp_module(model)         # (HebrusError now for a checkpoint without mtp.*)
            if cache is None:
                cache = mtp_model_cache(model, mtp, capacity_tokens=cfg.capacity_tokens,
                                        max_sequences=cfg.max_sequences)
        self.cache = cache if cache is not None else ModelCache.from_transformers(
            model, capacity_tokens=cfg.capacity_tokens, max_sequences=cfg.max_sequences, with_kv=True)
        if self.cache.owner is not None:
            raise HebrusError(f"Engine: the ModelCache given is already run by {self.cache.owner}")
        self.runner = ModelRunner(model, self.cache, ple_prefetch=cfg.ple_prefetch,
                                  native_layers=cfg.native_layers)
        self.mtp_drafter = None
        """The MTP block's drafter (``engine/mtp.py``) when ``config.speculative.method == "mtp"``."""
        if mtp is not None:
            from .mtp import MTPDrafter

            self.mtp_drafter = MTPDrafter(model, mtp, self.runner, vocab_size=self.vocab_size,
                                          block_size=cfg.block_size)
        if draft_model is not None:
            if drafter is not None:
                raise HebrusError("Engine: pass a drafter or a draft_model, not both")
            from .draft_model import drafter_for

            self.drafter = drafter_for(draft_model, vocab_size=self.vocab_size, capacity_tokens=cfg.capacity_tokens,
                                       max_sequences=cfg.max_sequences)
        has_gdn = "linear_attention" in list(self.text_config.layer_types) and self.cache.gdn is not None
        self.chunk_align = (CHUNK if cfg.chunked_prefill and has_gdn and
                            (cfg.max_batch_tokens is None or cfg.max_batch_tokens >= CHUNK) else None)
        self.counters = EngineCounters()
        store = None
        if cfg.prompt_cache_dir is not None:
            store = PromptCacheStore(cfg.prompt_cache_dir, fingerprint(model, self.cache), cfg.prompt_cache_max_bytes,
                                     counters=self.counters)
        self.cache_manager = CacheManager(self.cache, cfg, self.counters, chunk_align=self.chunk_align,
                                          device=self.runner.device, prompt_cache=store)
        self.scheduler = Scheduler(max_batch_tokens=cfg.max_batch_tokens,
                                   max_requests_per_batch=cfg.max_requests_per_batch,
                                   max_sequences=cfg.max_sequences,
                                   block_size=cfg.block_size if cfg.allow_block_sharing else None,
                                   chunk_align=self.chunk_align, cache_manager=self.cache_manager)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._cancelled: list[str] = []
        self._fault_hook: Callable[[StepPlan], None] | None = None   # tests: raise inside a step
        self._masks = MaskBuffer()          # structured output's masks on the host (engine/constraints.py)
        self.on_prompt_done: Callable[[Request], None] | None = None
        """Called after the step in which a request's prompt entered the cache (its state is then the
        state after its prompt: what the chunk-invariance tests digest)."""
        self.cache.owner = "an Engine"      # (its load_state_dict is refused from now on: the requests own it)

    # ------------------------------------------------------------------ the cache manager's, by their old names
    @property
    def prompt_cache(self) -> PromptCacheStore | None:
        return self.cache_manager.prompt_cache

    @property
    def prefix(self) -> PrefixIndex | None:
        return self.cache_manager.prefix

    @property
    def prefix_cache_tokens(self) -> int:
        return self.cache_manager.prefix_cache_tokens

    @property
    def _kept(self):
        return self.cache_manager.kept

    def _free_cells(self) -> int:
        return self.cache_manager.free_cells()

    def kept_sequences(self) -> list[SeqHandle]:
        """Sequences held by the prefix cache, least recently used first."""
        return list(self.cache_manager.kept)

    def clear_prefix_cache(self) -> None:
        self.cache_manager.clear()

    def close(self) -> None:
        """Wait for the prompt cache's pending writes and release its directory (another engine may then open
        it), stop the PLE prefetch worker (the runner's and the draft model's); idempotent. The engine still
        runs, without files (a later step starts the worker again)."""
        self.cache_manager.close()
        self.runner.close()
        draft_runner = getattr(self.drafter, "runner", None)
        if isinstance(draft_runner, ModelRunner):
            draft_runner.close()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], *, request_id: str | None = None,
                    max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                    eos_token_id: int | Iterable[int] | None = None, stop_strings: Sequence[str] | None = None,
                    streaming: bool = False, record_timestamps: bool = False, user_data: Any = None,
                    speculative: SpeculativeConfig | int | None = None, constraint: Any = None) -> str:
        """Queue a request; returns its id. ``speculative``: a SpeculativeConfig, or the number of tokens
        prompt lookup drafts per step (0: off); None: the engine's default (``EngineConfig.speculative``).
        ``constraint``: structured output, a ``constraints.Constraint`` (compiled with the engine's tokenizer) or
        a ``CompiledConstraint`` (``engine/constraints.py``); None: unconstrained.

        Raises:
            BadRequestError: the prompt or a parameter is invalid; nothing is queued.
        """
        request = self.make_request(prompt, request_id=request_id, max_new_tokens=max_new_tokens,
                                    sampling=sampling, eos_token_id=eos_token_id, stop_strings=stop_strings,
                                    streaming=streaming, record_timestamps=record_timestamps,
                                    user_data=user_data, speculative=speculative, constraint=constraint)
        self.submit(request)
        return request.request_id

    def make_request(self, prompt: Sequence[int], *, request_id: str | None = None,
                     max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                     eos_token_id: int | Iterable[int] | None = None, stop_strings: Sequence[str] | None = None,
                     streaming: bool = False, record_timestamps: bool = False, user_data: Any = None,
                     speculative: SpeculativeConfig | int | None = None, constraint: Any = None) -> Request:
        """A validated Request (BadRequestError naming the problem otherwise; ``engine/intake.py``)."""
        rid = request_id if request_id is not None else f"req_{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise BadRequestError(f"engine: request_id must be a non-empty string, got {rid!r}")
        if rid in self.requests and not self.requests[rid].status.is_done:
            raise BadRequestError(f"engine: request {rid!r} is already in flight")
        request = build_request(self, rid, prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                eos_token_id=eos_token_id, stop_strings=stop_strings, streaming=streaming,
                                record_timestamps=record_timestamps, user_data=user_data, speculative=speculative,
                                constraint=constraint)
        if request.speculative.drafts_with_mtp and self.mtp_drafter is None:
            raise BadRequestError(f"engine: request {rid!r} speculates with method 'mtp', and this engine was not "
                                  f"built for it (EngineConfig(speculative=SpeculativeConfig(..., method='mtp')))")
        return request

    def submit(self, request: Request) -> None:
        """Queue a request made by :meth:`make_request`, with its ``forks`` (the other choices of its prompt,
        each made by ``make_request`` with the same prompt): they are registered here, and forked from its
        sequence once its prompt is in the cache."""
        if any(f.prompt != request.prompt for f in request.forks):
            raise BadRequestError(f"engine: request {request.request_id!r}: its forks must have its prompt")
        if any(_constraint_of(f) != _constraint_of(request) for f in request.forks):
            raise BadRequestError(f"engine: request {request.request_id!r}: its forks must have its constraint "
                                  f"(they sample their first token from its masked logits)")
        self.requests[request.request_id] = request
        for fork in request.forks:
            self.requests[fork.request_id] = fork
            fork.status = RequestStatus.WAITING
        self.scheduler.add(request)
        self.cache_manager.expect(request)

    def cancel(self, request_id: str) -> None:
        """Cancel a request at any point (queued, mid-prefill, decoding); its state is freed at the next step."""
        self._cancelled.append(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._cancelled)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StepOutput]:
        """Run one step: schedule -> execute -> update; returns what changed for each request touched (tokens
        gained, finished)."""
        t0 = time.perf_counter()
        outputs = self._apply_cancellations()
        drafts = propose_drafts(self.scheduler.running, self.drafter, vocab_size=self.vocab_size,
                                capacity_tokens=self.config.capacity_tokens, stop_speculating=self._stop_speculating,
                                mtp_drafter=self.mtp_drafter, counters=self.counters)
        drafts = grammar_drafts(drafts)
        if self.mtp_drafter is not None:      # (their rows' block entries wait until they draft again)
            self.mtp_drafter.defer([r for r in self.scheduler.running
                                    if r not in drafts and r.speculative.drafts_with_mtp])
        plan = self.scheduler.schedule(drafts=drafts)
        for victim in plan.preempted:
            self.release_draft(victim)
        self.counters.preemptions += len(plan.preempted)
        if plan:
            result = self._execute(plan)
            outputs += result if isinstance(result, list) else apply_step(self, result)
        elif self.scheduler.has_work():
            outputs += self._fail_stuck()
        self.counters.step_seconds += time.perf_counter() - t0
        return outputs

    def run(self, until: Callable[[], bool] | None = None) -> list[StepOutput]:
        """Step until every request is done (or ``until()`` is True); returns every output."""
        out: list[StepOutput] = []
        while self.has_unfinished() and not (until and until()):
            out += self.step()
        if self.prompt_cache is not None:
            self.prompt_cache.flush()      # (what the run wrote is on disk when it returns)
        return out

    # ------------------------------------------------------------------ execute
    def _execute(self, plan: StepPlan) -> StepResult | list[StepOutput]:
        """Run the plan as one transaction that also reads the step's tokens off its logits (sampling and
        verification run inside it, ``ModelRunner.execute``'s ``consume``): a failure before the tokens are
        known publishes nothing and puts the requests' generators back, so the retry draws what the first
        attempt would have. Returns the step's result, or the outputs of the requests it failed."""
        attempts = 0
        while True:
            chunks = plan.chunks
            verifying = {c.request.seq: c.width for c in chunks if c.drafts}
            layout = LogitsLayout.of_plan(chunks)
            forking = self._pending_forks(chunks)
            generators = _generator_states([c.request for c in chunks if c.needs_logits])
            try:
                t0 = time.perf_counter()
                if self._fault_hook is not None:
                    self._fault_hook(plan)
                with (self.cache.recording(verifying) if verifying else contextlib.nullcontext()) as recording:
                    picks, verdicts = self.runner.execute(
                        [c.request.seq for c in chunks], [c.tokens for c in chunks], layout,
                        [c.start for c in chunks], [c.start < self.scheduler.chunk_extent(c.request) for c in chunks],
                        lambda logits: self._read_tokens(chunks, layout, logits, forking))
                self.counters.model_seconds += time.perf_counter() - t0
                break
            except CapacityError as err:
                _restore_generators(generators)
                # Out of cells: drop kept prefixes first, else free the newest request (recomputed later).
                if self._kept:
                    self.cache_manager.evict_kept()
                    continue
                if len(self.scheduler.running) <= 1:
                    return fail(self, [c.request for c in chunks], f"CapacityError: the cache is full: {err}")
                victim = max(self.scheduler.running, key=lambda r: r.arrival)
                self.release(victim)
                self.scheduler.preempt(victim)
                self.counters.preemptions += 1
                plan = StepPlan([c for c in chunks if c.request is not victim])
                if not plan.chunks:
                    return []
            except Exception as err:  # noqa: BLE001 - any failure of a step rolls it back
                _restore_generators(generators)
                attempts += 1
                self.counters.failed_steps += 1
                if attempts > self.config.step_retries:
                    return fail(self, [c.request for c in chunks], f"{type(err).__name__}: {err}")
                self.counters.retried_steps += 1
        self.counters.steps += 1
        sampling = [c for c in chunks if c.needs_logits and not c.drafts]
        return StepResult(chunks, dict(zip(map(id, sampling), picks)), verdicts,
                          self._fork_choices(forking, picks[len(sampling):]), recording)

    def _read_tokens(self, chunks: Sequence[ScheduledChunk], layout: LogitsLayout, logits: torch.Tensor,
                     forked: list[tuple[int, Request]]) -> tuple[list[Pick], dict[int, Verdict]]:
        """The step's tokens, in one read of the device: the Picks of the chunks that sample one (then of the
        ``forked`` choices, each sampling from the row of the chunk of index given), and per verification row
        (by ``id(chunk)``) its Verdict."""
        logits = mask_logits(chunks, layout, logits, self._masks)     # structured output (no-op without)
        rows = {id(c): layout.starts[i] for i, c in enumerate(chunks)}
        sampling = [c for c in chunks if c.needs_logits and not c.drafts]
        reqs = [c.request for c in sampling] + [fork for _, fork in forked]
        spec = [c for c in chunks if c.drafts]
        also, finish_verdicts = None, None
        if spec:
            sreqs = [c.request for c in spec]
            q = []
            for c, r in zip(spec, sreqs):
                probs = getattr(self._drafter_of(r), "draft_probs", None)
                q.append(probs(r, len(c.drafts)) if probs is not None else None)
            also, finish_verdicts = verification(logits, [rows[id(c)] for c in spec], [c.drafts for c in spec],
                                                 [r.sampling for r in sreqs], [r.tokens for r in sreqs],
                                                 [r.generated for r in sreqs], [r.generator for r in sreqs], q)
        picks, values = sample_rows_reading(logits, [r.sampling for r in reqs],
                                            [r.tokens if reads_history(r.sampling) else () for r in reqs],
                                            [r.generator for r in reqs],
                                            rows=[rows[id(c)] for c in sampling] + [rows[id(chunks[i])] for i, _ in forked],
                                            generated=[r.generated for r in reqs], also=also)  # the step's one read
        return list(picks), ({id(c): v for c, v in zip(spec, finish_verdicts(values))} if spec else {})

    def _pending_forks(self, chunks: Sequence[ScheduledChunk]) -> list[tuple[int, Request]]:
        """(index of the chunk, fork) for each pending fork of a request whose prompt ends in this step (it then
        samples its first token from the same row), each with a fresh generator; nothing else changes until
        the step ran."""
        out: list[tuple[int, Request]] = []
        for i, chunk in enumerate(chunks):
            req = chunk.request
            if (chunk.drafts or not chunk.needs_logits or not req.forks or req.generated
                    or chunk.start + chunk.num_tokens != len(req.prompt)):
                continue
            for fork in req.forks:
                if not fork.status.is_done:
                    fork.generator = fork.sampling.generator(self.runner.device)
                    out.append((i, fork))
        return out

    def _fork_choices(self, forking: list[tuple[int, Request]], picks: Sequence[Pick]) -> list[tuple[Request, Pick]]:
        """After the step ran (each parent's sequence holds the state after its prompt): each pending fork gets
        a fork of its parent's sequence and joins the running requests at the end of the prompt with the token
        it sampled. A fork that gets no sequence slot (even after evicting kept prefixes) is queued instead
        and prefills on its own."""
        out: list[tuple[Request, Pick]] = []
        parents: dict[Request, None] = {}
        for (_, fork), pick in zip(forking, picks):
            parent = next(r for r in self.scheduler.running if fork in r.forks)
            parents[parent] = None
            if not self.cache_manager.fork(parent, fork):
                fork.generator = None
                self.scheduler.add(fork)
                continue
            fork.first_scheduled_time = time.perf_counter()
            self.scheduler.join(fork)
            self.counters.forked_choices += 1
            out.append((fork, pick))
        for parent in parents:
            parent.forks = []
        return out

    # ------------------------------------------------------------------ failures, releases
    def _fail_stuck(self) -> list[StepOutput]:
        """Work is left but the plan is empty: fail the request that cannot progress, saying why."""
        sched = self.scheduler
        free, cap = self._free_cells(), self.config.capacity_tokens
        if sched.running:
            req = max(sched.running, key=lambda r: r.arrival)
            what = (f"a cache cell for its next token ({req.num_computed} of its {req.num_tokens} tokens are in "
                    f"the cache)")
        else:
            req = sched.waiting[0]
            live = len(self.cache.slots.live_handles())
            if live >= self.config.max_sequences:
                what = f"a sequence slot (all {self.config.max_sequences} are held outside the engine's requests)"
            else:
                what = f"{self.cache_manager.cells_needed(req)} cache cell(s) to start"
        err = CapacityError(f"engine: request {req.request_id!r} cannot progress: it needs {what}, and {free} of "
                            f"the {cap} cells are free with {len(sched.running)} request(s) running and "
                            f"{len(self._kept)} prefix(es) kept; the other cells are held by sequences "
                            f"outside the engine's requests")
        return fail(self, [req], f"{type(err).__name__}: {err}")

    def _stop_speculating(self, req: Request, why: str) -> None:
        """The drafter failed for ``req``: it speculates no more (its tokens are those of plain decoding)."""
        req.spec.error = why
        self.counters.spec_drafter_errors += 1
        try:
            self.release_draft(req)
        except Exception:  # noqa: BLE001 - the drafter's own bookkeeping; the request goes on without it
            pass

    def release_draft(self, req: Request) -> None:
        """Free what the drafter holds for ``req`` (a draft model's sequence)."""
        release = getattr(self._drafter_of(req), "release", None)
        if release is not None:
            release(req)

    def _drafter_of(self, req: Request) -> Any:
        """Who drafts for ``req``: the MTP drafter for ``method="mtp"``, else the engine's drafter (None: prompt
        lookup)."""
        spec = req.speculative
        return self.mtp_drafter if spec is not None and spec.method == "mtp" else self.drafter

    def release(self, req: Request) -> None:
        """Free ``req``'s state: the drafter's and its sequence."""
        self.release_draft(req)
        self.cache_manager.release(req)

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """``outputs.finish`` (the manager ends requests it could not queue through it)."""
        finish(self, req, status, error)

    def _apply_cancellations(self) -> list[StepOutput]:
        outs = []
        for rid in self._cancelled:
            req = self.requests.get(rid)
            if req is None or req.status.is_done:
                continue
            finish(self, req, RequestStatus.CANCELLED, "cancelled")
            outs.append(StepOutput(req, [], True))
        self._cancelled.clear()
        return outs


def _constraint_of(req: Request) -> Any:
    """What a request's output is constrained to (None: nothing)."""
    return None if req.constraint is None else req.constraint.compiled.constraint


def _generator_states(requests: Iterable[Request]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The state of each request's generator (a step that fails puts them back: its retry draws the same)."""
    return [(r.generator, r.generator.get_state()) for r in requests if r.generator is not None]


def _restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for gen, state in states:
        gen.set_state(state)

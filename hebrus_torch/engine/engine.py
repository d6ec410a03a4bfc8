"""The native engine: ``Engine(model)``, ``add_request``, ``step()``.

One ``step()``: cancellations are applied, the scheduler plans the step (admitting requests, which
get a sequence of the ModelCache here, possibly forked from a shared prefix), the runner executes it
as one transaction, and each request whose chunk reached the end of its stream samples a token.
A step that raises publishes nothing (the transaction rolls every holder back); it is retried once,
and if it raises again its requests fail with the error while the others go on. A ``CapacityError``
(the cache is out of cells) preempts the newest request and replans instead.

Users who drive the loop themselves call ``step()`` until ``has_unfinished()`` is False; the
transformers-facing manager (``hebrus_torch.engine.manager``) runs the same loop on a thread.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import CapacityError, HebrusError
from ..gdn.chunked import CHUNK
from ..model_cache import ModelCache
from ..state.handles import SeqHandle
from .prefix import PrefixIndex
from .requests import FinishReason, Request, RequestStatus
from .runner import ModelRunner, find_text_model
from .sampling import BadRequestError, SamplingParams, sample_next
from .scheduler import ScheduledChunk, Scheduler, StepPlan

__all__ = ["Engine", "EngineConfig", "StepOutput", "BadRequestError"]


@dataclass
class EngineConfig:
    """Sizes and policies of one engine.

    Attributes:
        capacity_tokens: cache cells (token positions) shared by all sequences.
        max_sequences: sequence slots (requests in flight at once).
        max_batch_tokens: tokens per step (None: unlimited).
        max_requests_per_batch: requests per step (None: max_sequences).
        allow_block_sharing: requests whose prompts share whole blocks start from the state at the
            end of the shared part (prefix sharing).
        block_size: the prefix-sharing block (prefill chunks that cross a boundary end on one).
        step_retries: how often a failed step is retried before its requests fail.
        prefix_cache_tokens: with block sharing, finished requests' state is kept for later
            requests that extend their tokens (a second chat turn), least recently used first out,
            while the kept sequences hold at most this many cache cells (None: half the capacity;
            0: keep nothing). Kept state yields to running requests: it is evicted before any
            request is preempted.
        chunked_prefill: the GDN layers run a prompt's whole chunks of 64 positions (aligned to absolute
            positions) in the chunked (WY) form, ``hebrus::gdn_chunk_delta_rule_slots``, and the scheduler
            cuts prefill chunks at multiples of 64 below a prompt's last whole chunk (docs/engine.md: the
            alignment rule). It needs ``max_batch_tokens`` None or >= 64 (a smaller budget never feeds a
            whole chunk in one step): below that, and with False, the recurrent form runs throughout.
    """

    capacity_tokens: int = 16384
    max_sequences: int = 32
    max_batch_tokens: int | None = 512
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True
    block_size: int = 64
    step_retries: int = 1
    prefix_cache_tokens: int | None = None
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("capacity_tokens", "max_sequences", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HebrusError(f"EngineConfig: {name} must be an int >= 1, got {value!r}")
        for name in ("max_batch_tokens", "max_requests_per_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise HebrusError(f"EngineConfig: {name} must be None or an int >= 1, got {value!r}")
        if not isinstance(self.chunked_prefill, bool):
            raise HebrusError(f"EngineConfig: chunked_prefill must be a bool, got {self.chunked_prefill!r}")


@dataclass
class StepOutput:
    """What one step did to one request: the tokens it gained and whether it is done."""

    request: Request
    new_tokens: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class EngineCounters:
    steps: int = 0
    failed_steps: int = 0
    retried_steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0        # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0
    prefix_hit_tokens: int = 0     # prompt tokens taken from a shared prefix instead
    prefix_evictions: int = 0      # kept sequences evicted from the prefix cache
    step_seconds: float = 0.0
    model_seconds: float = 0.0


class Engine:
    """Continuous batching with chunked prefill over one ``ModelCache``.

    Args:
        model: a transformers Qwen4Exp causal LM (``hx.apply`` need not have run).
        config: sizes and policies.
        generation_config: defaults for requests (max_new_tokens, eos, sampling); the model's own if None.
        tokenizer: decodes outputs for stop strings (optional).
        cache: a ModelCache to use instead of building one from ``model``.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, *,
                 generation_config: Any = None, tokenizer: Any = None, cache: ModelCache | None = None):
        self.model = model
        self.config = config or EngineConfig()
        cfg = self.config
        self.text_config = find_text_model(model).config
        self.vocab_size = int(self.text_config.vocab_size)
        self.generation_config = generation_config if generation_config is not None else getattr(
            model, "generation_config", None)
        self.tokenizer = tokenizer
        self.cache = cache if cache is not None else ModelCache.from_transformers(
            model, capacity_tokens=cfg.capacity_tokens, max_sequences=cfg.max_sequences, with_kv=True)
        self.runner = ModelRunner(model, self.cache)
        has_gdn = "linear_attention" in list(self.text_config.layer_types) and self.cache.gdn is not None
        self.chunk_align = (CHUNK if cfg.chunked_prefill and has_gdn and
                            (cfg.max_batch_tokens is None or cfg.max_batch_tokens >= CHUNK) else None)
        self._extent: dict[SeqHandle, int] = {}     # seq -> the chunk extent of the request whose state it holds
        self.scheduler = Scheduler(max_batch_tokens=cfg.max_batch_tokens,
                                   max_requests_per_batch=cfg.max_requests_per_batch,
                                   max_sequences=cfg.max_sequences,
                                   block_size=cfg.block_size if cfg.allow_block_sharing else None,
                                   chunk_align=self.chunk_align)
        self.prefix = PrefixIndex(cfg.block_size) if cfg.allow_block_sharing else None
        self.requests: dict[str, Request] = {}
        self._kept: collections.OrderedDict[SeqHandle, int] = collections.OrderedDict()   # LRU: seq -> cells
        budget = cfg.prefix_cache_tokens
        # `is not None`: an empty PrefixIndex is falsy (len 0), which turned the prefix cache off
        self.prefix_cache_tokens = ((cfg.capacity_tokens // 2 if budget is None else budget)
                                    if self.prefix is not None else 0)
        self.counters = EngineCounters()
        self._ids = itertools.count()
        self._cancelled: list[str] = []
        self._failed_early: list[Request] = []
        self._fault_hook: Callable[[StepPlan], None] | None = None   # tests: raise inside a step
        self.on_prompt_done: Callable[[Request], None] | None = None
        """Called after the step in which a request's prompt entered the cache (its state is then the
        state after its prompt: what the chunk-invariance tests digest)."""

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], *, request_id: str | None = None,
                    max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                    eos_token_id: int | Iterable[int] | None = None, stop_strings: Sequence[str] | None = None,
                    streaming: bool = False, record_timestamps: bool = False, user_data: Any = None) -> str:
        """Queue a request; returns its id.

        Raises:
            BadRequestError: the prompt or a parameter is invalid; nothing is queued.
        """
        request = self.make_request(prompt, request_id=request_id, max_new_tokens=max_new_tokens,
                                    sampling=sampling, eos_token_id=eos_token_id, stop_strings=stop_strings,
                                    streaming=streaming, record_timestamps=record_timestamps,
                                    user_data=user_data)
        self.submit(request)
        return request.request_id

    def make_request(self, prompt: Sequence[int], *, request_id: str | None = None,
                     max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                     eos_token_id: int | Iterable[int] | None = None, stop_strings: Sequence[str] | None = None,
                     streaming: bool = False, record_timestamps: bool = False, user_data: Any = None) -> Request:
        """A validated Request (BadRequestError naming the problem otherwise)."""
        rid = request_id if request_id is not None else f"req_{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise BadRequestError(f"engine: request_id must be a non-empty string, got {rid!r}")
        if rid in self.requests and not self.requests[rid].status.is_done:
            raise BadRequestError(f"engine: request {rid!r} is already in flight")
        try:
            tokens = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        except (TypeError, ValueError):
            raise BadRequestError(f"engine: request {rid!r}: the prompt must be a sequence of token ids") from None
        if not tokens:
            raise BadRequestError(f"engine: request {rid!r}: the prompt is empty")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequestError(f"engine: request {rid!r}: token ids {bad[:5]} lie outside the vocabulary "
                                  f"[0, {self.vocab_size})")
        gen = self.generation_config
        if max_new_tokens is None:
            max_new_tokens = getattr(gen, "max_new_tokens", None)
            if max_new_tokens is None:
                max_length = getattr(gen, "max_length", None)
                max_new_tokens = max_length - len(tokens) if max_length else 20
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise BadRequestError(f"engine: request {rid!r}: max_new_tokens must be an int >= 1, got "
                                  f"{max_new_tokens!r}")
        if len(tokens) + 1 > self.config.capacity_tokens:
            raise BadRequestError(f"engine: request {rid!r}: a prompt of {len(tokens)} tokens does not fit the "
                                  f"cache ({self.config.capacity_tokens} token positions)")
        if sampling is None:
            sampling = SamplingParams.from_generation_config(gen)
        if not isinstance(sampling, SamplingParams):
            raise BadRequestError(f"engine: request {rid!r}: sampling must be SamplingParams, got "
                                  f"{type(sampling).__name__}")
        if eos_token_id is None:
            eos_token_id = getattr(gen, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = getattr(self.text_config, "eos_token_id", None)
        eos = _id_set(eos_token_id)
        stops = tuple(stop_strings or getattr(gen, "stop_strings", None) or ())
        if isinstance(stop_strings, str):
            stops = (stop_strings,)
        if stops and self.tokenizer is None:
            raise BadRequestError(f"engine: request {rid!r}: stop strings need the engine's tokenizer")
        return Request(rid, tokens, max_new_tokens, sampling, eos, stops, streaming, record_timestamps,
                       user_data=user_data)

    def submit(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def cancel(self, request_id: str) -> None:
        """Cancel a request at any point (queued, mid-prefill, decoding); its state is freed at the next step."""
        self._cancelled.append(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._cancelled)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StepOutput]:
        """Run one step; returns what changed for each request touched (tokens gained, finished)."""
        t0 = time.perf_counter()
        outputs = self._apply_cancellations()
        self._make_room()
        plan = self.scheduler.schedule(self._free_cells(), admit=self._admit, release=self._release_state)
        self.counters.preemptions += len(plan.preempted)
        if plan:
            outputs += self._run_plan(plan)
        self.counters.step_seconds += time.perf_counter() - t0
        return outputs

    def run(self, until: Callable[[], bool] | None = None) -> list[StepOutput]:
        """Step until every request is done (or ``until()`` is True); returns every output."""
        out: list[StepOutput] = []
        while self.has_unfinished() and not (until and until()):
            out += self.step()
        return out

    # ------------------------------------------------------------------ internals
    def _free_cells(self) -> int:
        qsa = self.cache.qsa
        if qsa is None:
            return self.config.capacity_tokens
        return int((qsa.cell_ref == 0).sum())

    def _admit(self, req: Request) -> bool | None:
        if self.prefix is not None and req.num_computed == 0 and self._leader_prefilling(req):
            return None
        hit = None
        extent = self.scheduler.chunk_extent(req)
        if self.prefix is not None:
            hit = self.prefix.lookup(req.tokens, req.num_tokens - 1,
                                     accept=lambda seq, n: self._shareable(seq, n, extent))
        try:
            if hit is not None:
                if hit.seq in self._kept:
                    self._kept.move_to_end(hit.seq)
                seq = self.cache.fork(hit.seq)
                if self.prefix.frontier(hit.seq) != hit.tokens:
                    try:
                        self.cache.rewind(seq, hit.tokens)
                    except HebrusError:
                        self.cache.free(seq)
                        raise
            else:
                seq = self.cache.new_sequence()
        except CapacityError:
            return False
        req.seq = seq
        self._extent[seq] = extent
        if len(self._extent) > 2 * self.config.max_sequences:     # forget the freed sequences
            live = {r.seq for r in self.scheduler.running} | set(self._kept) | {seq}
            self._extent = {s: e for s, e in self._extent.items() if s in live}
        if hit is not None:
            req.num_computed = hit.tokens
            req.prefix_hit_tokens += hit.tokens
            self.counters.prefix_hit_tokens += hit.tokens
        if req.generator is None:
            req.generator = req.sampling.generator(self.runner.device)
        if req.first_scheduled_time < 0:
            req.first_scheduled_time = time.perf_counter()
        return True

    def _shareable(self, seq: SeqHandle, n: int, extent: int) -> bool:
        """Whether a request of chunk extent ``extent`` may start from ``seq``'s state after ``n`` tokens with
        the bits of its own unshared path (docs/engine.md): the state must have run the same whole chunks
        chunked (those below min(C floor(n / C), extent)), and the request must be able to continue from n
        (n a multiple of C, or at or past its extent, where everything runs recurrently)."""
        c = self.chunk_align
        if not c:
            return True
        theirs = self._extent.get(seq)
        whole = n // c * c
        return theirs is not None and (n % c == 0 or n >= extent) and min(whole, theirs) == min(whole, extent)

    def _leader_prefilling(self, req: Request) -> bool:
        """Another running request is prefilling a prompt that shares at least one whole block with
        ``req`` and has not reached the end of that shared part: wait for it rather than prefill twice."""
        b = self.config.block_size
        for other in self.scheduler.running:
            if other.num_computed >= len(other.prompt):
                continue
            shared = _common_prefix(other.prompt, req.prompt)
            shared = min(shared, req.num_tokens - 1) // b * b
            if shared >= b and other.num_computed < shared:
                return True
        return False

    def _run_plan(self, plan: StepPlan) -> list[StepOutput]:
        attempts = 0
        while True:
            chunks = plan.chunks
            try:
                t0 = time.perf_counter()
                if self._fault_hook is not None:
                    self._fault_hook(plan)
                logits = self.runner.execute([c.request.seq for c in chunks], [c.tokens for c in chunks],
                                             [c.needs_logits for c in chunks], [c.start for c in chunks],
                                             [c.start < self.scheduler.chunk_extent(c.request) for c in chunks])
                self.counters.model_seconds += time.perf_counter() - t0
                break
            except CapacityError as err:
                # Out of cells: drop kept prefixes first, else free the newest request (recomputed later).
                if self._kept:
                    self._evict_kept()
                    continue
                if len(self.scheduler.running) <= 1:
                    return self._fail([c.request for c in chunks], f"the cache is full: {err}")
                victim = max(self.scheduler.running, key=lambda r: r.arrival)
                self._release_state(victim)
                self.scheduler.preempt(victim)
                self.counters.preemptions += 1
                plan = StepPlan([c for c in chunks if c.request is not victim])
                if not plan.chunks:
                    return []
            except Exception as err:  # noqa: BLE001 - any failure of a step rolls it back
                attempts += 1
                self.counters.failed_steps += 1
                if attempts > self.config.step_retries:
                    return self._fail([c.request for c in chunks], f"{type(err).__name__}: {err}")
                self.counters.retried_steps += 1
        self.counters.steps += 1
        outputs: list[StepOutput] = []
        row = 0
        now = time.perf_counter()
        for chunk in chunks:
            req = chunk.request
            needs_logits = chunk.needs_logits
            end = chunk.start + chunk.num_tokens
            if end <= len(req.prompt):
                self.counters.prefill_tokens += chunk.num_tokens
            else:
                self.counters.decode_tokens += chunk.num_tokens
            req.prefilled_tokens += chunk.num_tokens
            before, req.num_computed = req.num_computed, end
            self._record_prefix(req)
            if self.on_prompt_done is not None and before < len(req.prompt) <= end:
                self.on_prompt_done(req)
            if not needs_logits:
                continue
            token, logprob = sample_next(logits[row], req.sampling, req.tokens, req.generator)
            row += 1
            req.generated.append(token)
            if logprob is not None:
                req.logprobs.append(logprob)
            if req.first_token_time < 0:
                req.first_token_time = now
            if req.record_timestamps:
                req.timestamps.append(now)
            req.status = RequestStatus.DECODING
            out = StepOutput(req, [token])
            reason = self._stop_reason(req)
            if reason is not None:
                req.finish_reason = reason
                self._finish(req, RequestStatus.FINISHED)
                out.finished = True
            outputs.append(out)
        return outputs

    def _record_prefix(self, req: Request) -> None:
        """At a block boundary inside the prompt: snapshot the recurrent state and index the prefix."""
        if self.prefix is None:
            return
        n, b = req.num_computed, self.config.block_size
        if n % b or n > len(req.prompt) or n == 0:
            return
        self.cache.checkpoint(req.seq)
        self.prefix.record(req.seq, req.prompt[:n])

    def _stop_reason(self, req: Request) -> FinishReason | None:
        if req.generated[-1] in req.eos_token_ids:
            return FinishReason.EOS
        if req.stop_strings:
            text = self.tokenizer.decode(req.generated)
            if any(s in text for s in req.stop_strings):
                return FinishReason.STOP_STRING
        if len(req.generated) >= req.max_new_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.config.capacity_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        req.status = status
        req.error = error
        req.finished_time = time.perf_counter()
        self.scheduler.remove(req)
        if status is RequestStatus.FINISHED and req.seq is not None and self._keep(req):
            return
        self._release_state(req)

    # ------------------------------------------------------------------ the prefix cache
    def _keep(self, req: Request) -> bool:
        """Keep a finished request's state for requests that extend its tokens; False if it does not fit."""
        if self.prefix_cache_tokens <= 0 or req.num_computed > self.prefix_cache_tokens:
            return False
        seq, req.seq = req.seq, None
        self.prefix.record_frontier(seq, req.tokens[:req.num_computed])
        self._kept[seq] = req.num_computed
        while sum(self._kept.values()) > self.prefix_cache_tokens:
            self._evict_kept()
        return True

    def _evict_kept(self) -> None:
        seq, _ = self._kept.popitem(last=False)
        self.prefix.drop(seq)
        self.cache.free(seq)
        self.counters.prefix_evictions += 1

    def kept_sequences(self) -> list[SeqHandle]:
        """Sequences held by the prefix cache, least recently used first."""
        return list(self._kept)

    def clear_prefix_cache(self) -> None:
        while self._kept:
            self._evict_kept()

    def _make_room(self) -> None:
        """Evict kept prefixes while running requests or the next waiting one would lack cells or a slot."""
        if not self._kept:
            return
        sched = self.scheduler
        need = sum(1 for r in sched.running if r.remaining == 1)
        if sched.waiting:
            head = sched.waiting[0]
            need += min(head.remaining, self.config.max_batch_tokens or head.remaining)
            while self._kept and len(sched.running) + len(self._kept) >= self.config.max_sequences:
                self._evict_kept()
        while self._kept and self._free_cells() < need:
            self._evict_kept()

    def _release_state(self, req: Request) -> None:
        if req.seq is None:
            return
        if self.prefix is not None:
            self.prefix.drop(req.seq)
        try:
            self.cache.free(req.seq)
        finally:
            req.seq = None

    def _fail(self, requests: Iterable[Request], message: str) -> list[StepOutput]:
        outs = []
        for req in requests:
            self._finish(req, RequestStatus.FAILED, message)
            outs.append(StepOutput(req, [], True))
        return outs

    def _apply_cancellations(self) -> list[StepOutput]:
        outs = []
        for rid in self._cancelled:
            req = self.requests.get(rid)
            if req is None or req.status.is_done:
                continue
            self._finish(req, RequestStatus.CANCELLED, "cancelled")
            outs.append(StepOutput(req, [], True))
        self._cancelled.clear()
        return outs


def _id_set(value: int | Iterable[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, int):
        return frozenset([] if value < 0 else [value])
    return frozenset(int(v) for v in value if int(v) >= 0)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

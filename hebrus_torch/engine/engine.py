"""The native engine: ``Engine(model)``, ``add_request``, ``step()``.

One ``step()``: cancellations are applied, the scheduler plans the step (admitting requests, which
get a sequence of the ModelCache here, possibly forked from a shared prefix), the runner executes it
as one transaction, and each request whose chunk reached the end of its stream samples a token.
A step that raises publishes nothing (the transaction rolls every holder back); it is retried once,
and if it raises again its requests fail with the error while the others go on. A ``CapacityError``
(the cache is out of cells) preempts the newest request and replans instead. A step that can plan
nothing while work is left fails the request that cannot progress with a ``CapacityError`` message
(the engine never spins on empty steps).

Users who drive the loop themselves call ``step()`` until ``has_unfinished()`` is False; the
transformers-facing manager (``hebrus_torch.engine.manager``) runs the same loop on a thread.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import itertools
import operator
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..errors import CapacityError, HebrusError
from ..gdn.chunked import CHUNK
from ..model_cache import ModelCache
from ..state.handles import SeqHandle
from .prefix import PrefixHit, PrefixIndex
from .prompt_cache import PromptCacheStore, fingerprint
from .requests import FinishReason, Request, RequestStatus
from .runner import ModelRunner, find_text_model
from .sampling import BadRequestError, Pick, SamplingParams, sample_rows_reading
from .scheduler import ScheduledChunk, Scheduler, StepPlan
from .speculative import MAX_DRAFT_TOKENS, NgramIndex, SpeculativeConfig, Verdict, verification

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
            0: keep nothing). Kept state always yields to running work: it is evicted whenever a
            running request or an admission needs its cells, before any request is preempted.
        chunked_prefill: the GDN layers run a prompt's whole chunks of 64 positions (aligned to absolute
            positions) in the chunked (WY) form, ``hebrus::gdn_chunk_delta_rule_slots``, and the scheduler
            cuts prefill chunks at multiples of 64 below a prompt's last whole chunk (docs/engine.md: the
            alignment rule). It needs ``max_batch_tokens`` None or >= 64 (a smaller budget never feeds a
            whole chunk in one step): below that, and with False, the recurrent form runs throughout.
        prompt_cache_dir: a directory where every finished request's state is also written (one file
            per request, at finish), so that a later request, in this process or the next one, whose
            prompt extends a stored request's tokens is restored from it and prefills only the rest
            (``engine/prompt_cache.py``; one engine process per directory). None: no files.
        prompt_cache_max_bytes: the files of ``prompt_cache_dir`` stay within this many bytes (least
            recently used deleted first).
        speculative: how requests speculate unless they say otherwise (``add_request(speculative=)``):
            prompt lookup drafts (``engine/speculative.py``); None: from the generation config's
            ``prompt_lookup_num_tokens`` (off when it is unset).
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
    prompt_cache_dir: str | os.PathLike | None = None
    prompt_cache_max_bytes: int = 4 << 30
    speculative: SpeculativeConfig | None = None

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
        if self.prompt_cache_dir is not None and not isinstance(self.prompt_cache_dir, (str, os.PathLike)):
            raise HebrusError(f"EngineConfig: prompt_cache_dir must be None or a path, got {self.prompt_cache_dir!r}")
        value = self.prompt_cache_max_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HebrusError(f"EngineConfig: prompt_cache_max_bytes must be an int >= 1, got {value!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise HebrusError(f"EngineConfig: speculative must be None or a SpeculativeConfig, got "
                              f"{self.speculative!r}")


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
    forked_choices: int = 0        # choices forked from another request's prompt (Request.forks): not prefilled
    step_seconds: float = 0.0
    model_seconds: float = 0.0
    # the prompt cache's files (EngineConfig.prompt_cache_dir; engine/prompt_cache.py)
    prompt_cache_hits: int = 0          # requests restored from a file
    prompt_cache_misses: int = 0        # admitted requests that no file served (memory may have)
    prompt_cache_hit_tokens: int = 0    # prompt tokens restored from files (also in prefix_hit_tokens)
    prompt_cache_writes: int = 0        # files written
    prompt_cache_evictions: int = 0     # files deleted for the size cap
    prompt_cache_skipped_files: int = 0  # files skipped as corrupt, truncated, foreign or of another version
    prompt_cache_write_errors: int = 0
    prompt_cache_seconds: float = 0.0   # on the engine's thread: saving states, reading and restoring files
    prompt_cache_write_seconds: float = 0.0  # on the store's writer thread: writing files
    # speculative decoding (engine/speculative.py)
    spec_drafted_tokens: int = 0        # drafted tokens fed for verification
    spec_accepted_tokens: int = 0       # of them, accepted
    spec_verify_rows: int = 0           # verification rows (one per speculating request and step)
    spec_steps: int = 0                 # steps with at least one verification row
    spec_rollbacks: int = 0             # rows cut short after verification (ModelCache.truncate)
    spec_drafter_errors: int = 0        # requests that stopped speculating: their drafter raised or proposed junk


class Engine:
    """Continuous batching with chunked prefill over one ``ModelCache``.

    Args:
        model: a transformers Qwen4Exp causal LM (``hx.apply`` need not have run).
        config: sizes and policies.
        generation_config: defaults for requests (max_new_tokens, eos, sampling); the model's own if None.
        tokenizer: decodes outputs for stop strings (optional).
        cache: a ModelCache to use instead of building one from ``model``.
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
        self.cache = cache if cache is not None else ModelCache.from_transformers(
            model, capacity_tokens=cfg.capacity_tokens, max_sequences=cfg.max_sequences, with_kv=True)
        self.runner = ModelRunner(model, self.cache)
        if draft_model is not None:
            if drafter is not None:
                raise HebrusError("Engine: pass a drafter or a draft_model, not both")
            from .draft_model import drafter_for

            self.drafter = drafter_for(draft_model, vocab_size=self.vocab_size, capacity_tokens=cfg.capacity_tokens,
                                       max_sequences=cfg.max_sequences)
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
        self.prompt_cache: PromptCacheStore | None = None
        if cfg.prompt_cache_dir is not None:
            self.prompt_cache = PromptCacheStore(cfg.prompt_cache_dir, fingerprint(model, self.cache),
                                                 cfg.prompt_cache_max_bytes, counters=self.counters)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], *, request_id: str | None = None,
                    max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                    eos_token_id: int | Iterable[int] | None = None, stop_strings: Sequence[str] | None = None,
                    streaming: bool = False, record_timestamps: bool = False, user_data: Any = None,
                    speculative: SpeculativeConfig | int | None = None) -> str:
        """Queue a request; returns its id. ``speculative``: a SpeculativeConfig, or the number of tokens
        prompt lookup drafts per step (0: off); None: the engine's default (``EngineConfig.speculative``).

        Raises:
            BadRequestError: the prompt or a parameter is invalid; nothing is queued.
        """
        request = self.make_request(prompt, request_id=request_id, max_new_tokens=max_new_tokens,
                                    sampling=sampling, eos_token_id=eos_token_id, stop_strings=stop_strings,
                                    streaming=streaming, record_timestamps=record_timestamps,
                                    user_data=user_data, speculative=speculative)
        self.submit(request)
        return request.request_id

    def make_request(self, prompt: Sequence[int], *, request_id: str | None = None,
                     max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                     eos_token_id: int | Iterable[int] | None = None, stop_strings: Sequence[str] | None = None,
                     streaming: bool = False, record_timestamps: bool = False, user_data: Any = None,
                     speculative: SpeculativeConfig | int | None = None) -> Request:
        """A validated Request (BadRequestError naming the problem otherwise)."""
        rid = request_id if request_id is not None else f"req_{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise BadRequestError(f"engine: request_id must be a non-empty string, got {rid!r}")
        if rid in self.requests and not self.requests[rid].status.is_done:
            raise BadRequestError(f"engine: request {rid!r} is already in flight")
        tokens = _token_ids(prompt, f"engine: request {rid!r}: the prompt")
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
        outside = [t for t, _ in sampling.logit_bias if t >= self.vocab_size]
        if outside:
            raise BadRequestError(f"engine: request {rid!r}: logit_bias token ids {outside[:5]} lie outside the "
                                  f"vocabulary [0, {self.vocab_size})")
        if eos_token_id is None:
            eos_token_id = getattr(gen, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = getattr(self.text_config, "eos_token_id", None)
        eos = _id_set(eos_token_id, f"engine: request {rid!r}: eos_token_id")
        stops = tuple(stop_strings or getattr(gen, "stop_strings", None) or ())
        if isinstance(stop_strings, str):
            stops = (stop_strings,)
        if stops and self.tokenizer is None:
            raise BadRequestError(f"engine: request {rid!r}: stop strings need the engine's tokenizer")
        spec = self._speculative_config(speculative, f"engine: request {rid!r}")
        return Request(rid, tokens, max_new_tokens, sampling, eos, stops, streaming, record_timestamps,
                       user_data=user_data, speculative=spec)

    def _speculative_config(self, value: SpeculativeConfig | int | None, what: str) -> SpeculativeConfig:
        if value is None:
            value = self.config.speculative
        if value is None:
            gen = self.generation_config
            value = getattr(gen, "prompt_lookup_num_tokens", None) or 0
            if value and self.drafter is None:
                return SpeculativeConfig(min(int(value), MAX_DRAFT_TOKENS), max_ngram=int(
                    getattr(gen, "max_matching_ngram_size", None) or 3))
            if self.drafter is not None:
                value = min(int(getattr(gen, "num_assistant_tokens", None) or value or 5), MAX_DRAFT_TOKENS)
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequestError(f"{what}: speculative must be a SpeculativeConfig, an int or None, got {value!r}")
        return SpeculativeConfig(value)

    def submit(self, request: Request) -> None:
        """Queue a request made by :meth:`make_request`, with its ``forks`` (the other choices of its prompt,
        each made by ``make_request`` with the same prompt): they are registered here, and forked from its
        sequence once its prompt is in the cache."""
        if any(f.prompt != request.prompt for f in request.forks):
            raise BadRequestError(f"engine: request {request.request_id!r}: its forks must have its prompt")
        self.requests[request.request_id] = request
        for fork in request.forks:
            self.requests[fork.request_id] = fork
            fork.status = RequestStatus.WAITING
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
        self._propose_drafts()
        plan = self.scheduler.schedule(self._free_cells(), admit=self._admit, release=self._release_state,
                                       reclaim=self._reclaim, cells_needed=self._cells_needed)
        self.counters.preemptions += len(plan.preempted)
        if plan:
            outputs += self._run_plan(plan)
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

    # ------------------------------------------------------------------ internals
    def _free_cells(self) -> int:
        qsa = self.cache.qsa
        if qsa is None:
            return self.config.capacity_tokens
        return qsa.free_cells()          # host bookkeeping: no wait for the device

    def _admit(self, req: Request) -> bool | None:
        if self.prefix is not None and req.num_computed == 0 and self._leader_prefilling(req):
            return None
        extent = self.scheduler.chunk_extent(req)
        hit = self._prefix_hit(req)
        stored = self._from_prompt_cache(req, hit) if self.prompt_cache is not None else None
        try:
            if stored is not None:     # restored from a file: the request continues from its frontier
                seq, hit = stored.seq, stored
            elif hit is not None:
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

    def _shareable(self, seq: SeqHandle | None, n: int, extent: int, theirs: int | None = None) -> bool:
        """Whether a request of chunk extent ``extent`` may start from ``seq``'s state after ``n`` tokens with
        the bits of its own unshared path (docs/engine.md): the state must have run the same whole chunks
        chunked (those below min(C floor(n / C), extent)), and the request must be able to continue from n
        (n a multiple of C, or at or past its extent, where everything runs recurrently). ``theirs``: the
        chunk extent of the request that computed the state (default: ``seq``'s)."""
        c = self.chunk_align
        if not c:
            return True
        if theirs is None:
            theirs = self._extent.get(seq)
        whole = n // c * c
        return theirs is not None and (n % c == 0 or n >= extent) and min(whole, theirs) == min(whole, extent)

    def _file_shareable(self, entry, extent: int) -> bool:
        """``_shareable`` for a file, whose writer (this engine or another, with the chunked form on or off)
        ran its positions below ``entry.chunk_extent`` chunked: with the chunked form off here, only a state
        that ran no whole chunk chunked continues with this engine's bits."""
        n = len(entry.tokens)
        if not self.chunk_align:
            return min(n // CHUNK * CHUNK, entry.chunk_extent) == 0
        return self._shareable(None, n, extent, entry.chunk_extent)

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

    def _propose_drafts(self) -> None:
        """Draft tokens for every decoding request that speculates (prompt lookup over its own stream, or the
        engine's drafter), as many as its adaptive length, its ``max_new_tokens`` and the cache allow."""
        cap = self.config.capacity_tokens
        asking: list[tuple[Request, int]] = []
        for req in self.scheduler.running:
            spec, cfg = req.spec, req.speculative
            spec.draft = []
            if not cfg.enabled or req.remaining != 1 or not req.generated or spec.error is not None:
                continue
            k = min(spec.next_length(cfg), req.max_new_tokens - len(req.generated) - 1, cap - req.num_tokens - 1)
            if k <= 0:
                continue
            if self.drafter is None:
                if spec.lookup is None:
                    spec.lookup = NgramIndex(cfg.max_ngram, cfg.min_ngram)
                spec.draft = spec.lookup.propose(req.tokens, k)
            else:
                asking.append((req, k))
        if not asking:
            return
        for (req, k), draft in zip(asking, self._ask_drafter(asking)):
            req.spec.draft = draft

    def _ask_drafter(self, asking: list[tuple[Request, int]]) -> list[list[int]]:
        """The drafter's tokens for each ``(request, k)``, at most k each. A failure stays with its request: a
        batched call that raises is repeated one request at a time, and a request whose drafter raises or
        proposes something other than token ids of the vocabulary stops speculating (``spec.error`` says why;
        its tokens are those of plain decoding) while the others go on."""
        batch = getattr(self.drafter, "propose_batch", None)
        found: list[Any] | None = None
        if batch is not None:
            try:
                found = list(batch([r for r, _ in asking], [k for _, k in asking]))
            except Exception:  # noqa: BLE001 - which request it failed for is unknown: ask them one by one
                found = None
            if found is not None and len(found) != len(asking):
                found = None
        out = []
        for i, (req, k) in enumerate(asking):
            try:
                draft = found[i] if found is not None else self.drafter(req, k)
                draft = _token_ids(draft, f"engine: the drafter for {req.request_id!r}")[:k]
                bad = [t for t in draft if not 0 <= t < self.vocab_size]
                if bad:
                    raise HebrusError(f"engine: the drafter proposed token ids {bad[:5]} outside the vocabulary "
                                      f"[0, {self.vocab_size}) for {req.request_id!r}")
            except Exception as err:  # noqa: BLE001 - only this request stops speculating
                self._stop_speculating(req, f"{type(err).__name__}: {err}")
                draft = []
            out.append(draft)
        return out

    def _stop_speculating(self, req: Request, why: str) -> None:
        req.spec.error = why
        self.counters.spec_drafter_errors += 1
        try:
            self._release_draft(req)
        except Exception:  # noqa: BLE001 - the drafter's own bookkeeping; the request goes on without it
            pass

    def _run_plan(self, plan: StepPlan) -> list[StepOutput]:
        """Execute the plan as one transaction that also reads the step's tokens off its logits (sampling and
        verification run inside it, ``ModelRunner.execute(consume=)``): a failure before the tokens are known
        publishes nothing and puts the requests' generators back, so the retry draws what the first attempt
        would have. Then the tokens are applied to the requests."""
        attempts = 0
        while True:
            chunks = plan.chunks
            verifying = {c.request.seq: c.width for c in chunks if c.drafts}
            plain = [c for c in chunks if c.needs_logits and not c.drafts]
            forking = self._pending_forks(plain)
            generators = _generator_states([c.request for c in chunks if c.needs_logits])
            try:
                t0 = time.perf_counter()
                if self._fault_hook is not None:
                    self._fault_hook(plan)
                with (self.cache.recording(verifying) if verifying else contextlib.nullcontext()) as recording:
                    picks, verdicts = self.runner.execute(
                        [c.request.seq for c in chunks], [c.tokens for c in chunks],
                        [c.width if c.drafts else c.needs_logits for c in chunks], [c.start for c in chunks],
                        [c.start < self.scheduler.chunk_extent(c.request) for c in chunks],
                        lambda logits: self._pick(chunks, logits, forking))
                self.counters.model_seconds += time.perf_counter() - t0
                break
            except CapacityError as err:
                _restore_generators(generators)
                # Out of cells: drop kept prefixes first, else free the newest request (recomputed later).
                if self._kept:
                    self._evict_kept()
                    continue
                if len(self.scheduler.running) <= 1:
                    return self._fail([c.request for c in chunks], f"CapacityError: the cache is full: {err}")
                victim = max(self.scheduler.running, key=lambda r: r.arrival)
                self._release_state(victim)
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
                    return self._fail([c.request for c in chunks], f"{type(err).__name__}: {err}")
                self.counters.retried_steps += 1
        self.counters.steps += 1
        sampled = dict(zip(map(id, plain), picks))
        forked = self._fork_choices(forking, picks[len(plain):])
        emitted, recomputing, failed = self._keep_verified(chunks, verdicts, recording) if verdicts else ({}, set(), {})
        if recording is not None:
            recording.release()
        outputs: list[StepOutput] = []
        now = time.perf_counter()
        for chunk in chunks:
            req = chunk.request
            if req in failed:
                outputs += self._fail([req], failed[req])
                continue
            try:
                out = self._apply_chunk(chunk, sampled.get(id(chunk)), emitted.get(id(chunk)), req in recomputing, now)
            except Exception as err:  # noqa: BLE001 - host bookkeeping of one request (a tokenizer, a callback)
                if not req.status.is_done:
                    outputs += self._fail([req], f"{type(err).__name__}: {err}")
                continue
            if out is not None:
                outputs.append(out)
        outputs += [self._take(fork, pick, now) for fork, pick in forked]
        return outputs

    def _apply_chunk(self, chunk: ScheduledChunk, pick: Pick | None, emitted: tuple | None, recomputing: bool,
                     now: float) -> StepOutput | None:
        """Apply one executed chunk to its request: the tokens now in the cache, then the token it sampled
        (``pick``) or the tokens its verification emitted (``emitted``; ``recomputing``: its state could
        not be cut back and was freed, so it recomputes from scratch). None when it samples nothing."""
        req = chunk.request
        needs_logits = chunk.needs_logits      # (before num_computed moves)
        end = chunk.start + chunk.num_tokens
        if chunk.drafts:
            new_tokens, logprobs, tops = emitted
            # the step's first token and the kept drafts (none if the request must recompute)
            end = 0 if recomputing else chunk.start + len(new_tokens)
            self.counters.decode_tokens += chunk.width
        elif end <= len(req.prompt):
            self.counters.prefill_tokens += chunk.num_tokens
        else:
            self.counters.decode_tokens += chunk.num_tokens
        req.prefilled_tokens += chunk.width
        before, req.num_computed = req.num_computed, end
        self._record_prefix(req)
        if self.on_prompt_done is not None and before < len(req.prompt) <= end:
            self.on_prompt_done(req)
        if not needs_logits:
            return None
        if chunk.drafts:
            return self._append(req, new_tokens, logprobs, tops, now, not recomputing)
        return self._take(req, pick, now)

    def _take(self, req: Request, pick: Pick, now: float) -> StepOutput:
        """Append a sampled token (a ``sampling.Pick``) to ``req``; finish it if it stops there."""
        return self._append(req, [pick.token], None if pick.logprob is None else [pick.logprob],
                            [pick.top] if pick.logprob is not None and req.sampling.top_logprobs else None, now)

    def _append(self, req: Request, tokens: list[int], logprobs: list[float] | None,
                tops: list[tuple] | None, now: float, running: bool = True) -> StepOutput:
        """Append a step's tokens to ``req`` (``running``: False when it must recompute: its status stays);
        finish it if it stops at the last."""
        req.generated.extend(tokens)
        if logprobs is not None:
            req.logprobs.extend(logprobs)
        if tops is not None:
            req.top_logprobs.extend(tops)
        if req.first_token_time < 0:
            req.first_token_time = now
        if req.record_timestamps:
            req.timestamps.extend([now] * len(tokens))
        if running:
            req.status = RequestStatus.DECODING
        out = StepOutput(req, list(tokens))
        reason = self._stop_reason(req)
        if reason is not None:
            req.finish_reason = reason
            self._finish(req, RequestStatus.FINISHED)
            out.finished = True
        return out

    def _pending_forks(self, sampled: list[ScheduledChunk]) -> list[tuple[int, Request]]:
        """For each chunk of ``sampled`` (row i: the logits row its request samples from) that ends its
        request's prompt in this step, the request's pending ``forks`` as (row, fork): they sample their first
        token from the same row, each with a fresh generator (nothing else changes until the step ran)."""
        out: list[tuple[int, Request]] = []
        for row, chunk in enumerate(sampled):
            req = chunk.request
            if not req.forks or req.generated or chunk.start + chunk.num_tokens != len(req.prompt):
                continue
            for fork in req.forks:
                if not fork.status.is_done:
                    fork.generator = fork.sampling.generator(self.runner.device)
                    out.append((row, fork))
        return out

    def _fork_choices(self, forking: list[tuple[int, Request]], picks: Sequence[Pick]) -> list[tuple[Request, Pick]]:
        """After the step ran (each parent's sequence holds the state after its prompt): fork the parent's
        sequence for each pending fork, which joins the running requests at the end of the prompt with the
        token it sampled. A fork that gets no sequence slot (even after evicting kept prefixes) is queued
        instead and prefills on its own."""
        out: list[tuple[Request, Pick]] = []
        parents: dict[Request, None] = {}
        for (row, fork), pick in zip(forking, picks):
            parent = next(r for r in self.scheduler.running if fork in r.forks)
            parents[parent] = None
            while self._kept and len(self.cache.slots.live_handles()) >= self.config.max_sequences:
                self._evict_kept()
            try:
                seq = self.cache.fork(parent.seq)
            except CapacityError:
                fork.generator = None
                self.scheduler.add(fork)
                continue
            fork.seq, fork.num_computed = seq, len(parent.prompt)
            self._extent[seq] = self._extent.get(parent.seq, self.scheduler.chunk_extent(fork))
            fork.first_scheduled_time = time.perf_counter()
            self.scheduler.join(fork)
            self.counters.forked_choices += 1
            out.append((fork, pick))
        for parent in parents:
            parent.forks = []
        return out

    def _pick(self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor,
              forked: list[tuple[int, Request]]) -> tuple[list[Pick], dict[int, Verdict]]:
        """The step's tokens, in one read of the device: the Picks of the rows that sample one (then of the
        ``forked`` choices, which sample from their parent's row), and per verification row (by ``id(chunk)``)
        its Verdict."""
        rows, offsets, at = [], [], 0
        for c in chunks:
            if c.drafts:
                offsets.append(at)
                at += c.width
            elif c.needs_logits:
                rows.append(at)
                at += 1
        reqs = [c.request for c in chunks if c.needs_logits and not c.drafts]
        rows += [rows[i] for i, _ in forked]
        reqs += [fork for _, fork in forked]
        spec = [c for c in chunks if c.drafts]
        also, finish = None, None
        if spec:
            sreqs = [c.request for c in spec]
            probs = getattr(self.drafter, "draft_probs", None)
            q = [probs(r, len(c.drafts)) if probs is not None else None for c, r in zip(spec, sreqs)]
            also, finish = verification(logits, offsets, [c.drafts for c in spec], [r.sampling for r in sreqs],
                                        [r.tokens for r in sreqs], [r.generated for r in sreqs],
                                        [r.generator for r in sreqs], q)
        picks, values = sample_rows_reading(logits, [r.sampling for r in reqs], [r.tokens for r in reqs],
                                            [r.generator for r in reqs], rows=rows,
                                            generated=[r.generated for r in reqs], also=also)  # the step's one read
        return list(picks), ({id(c): v for c, v in zip(spec, finish(values))} if spec else {})

    def _keep_verified(self, chunks: Sequence[ScheduledChunk], verdicts: dict[int, Verdict], recording
                       ) -> tuple[dict[int, tuple], set[Request], dict[Request, str]]:
        """Turn each verification row's Verdict into the tokens it emits (cut at the first that stops the
        request) and cut the step short for the rows that keep fewer tokens than they fed. Returns, by
        ``id(chunk)``, (tokens, logprobs or None, top alternatives or None); the requests whose state could not
        be cut (freed instead: they recompute, keeping their tokens); and the requests whose tokens could not be
        judged (a stop string's tokenizer raised), with why: they fail, and nothing of theirs is cut."""
        cut: dict[SeqHandle, int] = {}
        emitted_by: dict[int, tuple] = {}
        failed: dict[Request, str] = {}
        for chunk in chunks:
            if not chunk.drafts:
                continue
            req, verdict = chunk.request, verdicts[id(chunk)]
            emitted = verdict.emitted(chunk.drafts)
            base, n = len(req.generated), 0
            try:
                for token in emitted:                   # stop where decoding token by token would have stopped
                    req.generated.append(token)
                    n += 1
                    if self._stop_reason(req) is not None:
                        break
            except Exception as err:  # noqa: BLE001 - this request fails alone
                failed[req] = f"{type(err).__name__}: {err}"
                continue
            finally:
                del req.generated[base:]
            req.spec.update(req.speculative, len(chunk.drafts), verdict.accepted)
            self.counters.spec_verify_rows += 1
            self.counters.spec_drafted_tokens += len(chunk.drafts)
            self.counters.spec_accepted_tokens += verdict.accepted
            emitted_by[id(chunk)] = (emitted[:n], None if verdict.logprobs is None else verdict.logprobs[:n],
                                     None if verdict.tops is None else verdict.tops[:n])
            if n < chunk.width:                     # the cache keeps the step's first token and n - 1 drafts
                cut[req.seq] = n
        self.counters.spec_steps += 1
        if not cut:
            return emitted_by, set(), failed
        try:
            self.cache.truncate(recording, cut)
            self.counters.spec_rollbacks += len(cut)
            return emitted_by, set(), failed
        except Exception:  # noqa: BLE001 - never expected; the requests recompute rather than run on a bad state
            recomputing = set()
            for chunk in chunks:
                if chunk.request.seq in cut:
                    recomputing.add(chunk.request)
                    self._release_state(chunk.request)
                    self.scheduler.preempt(chunk.request)
                    self.counters.preemptions += 1
            return emitted_by, recomputing, failed

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
        forks, req.forks = req.forks, []
        for fork in forks:             # ended before its prompt did: the other choices run on their own
            if not fork.status.is_done:
                self.scheduler.add(fork)
        if status is RequestStatus.FINISHED and req.seq is not None:
            self._to_prompt_cache(req)
            if self._keep(req):
                self._release_draft(req)
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

    def _evict_kept(self, seq: SeqHandle | None = None) -> None:
        """Free a kept sequence (the least recently used one by default)."""
        if seq is None:
            seq, _ = self._kept.popitem(last=False)
        else:
            del self._kept[seq]
        self.prefix.drop(seq)
        self.cache.free(seq)
        self.counters.prefix_evictions += 1

    def kept_sequences(self) -> list[SeqHandle]:
        """Sequences held by the prefix cache, least recently used first."""
        return list(self._kept)

    def clear_prefix_cache(self) -> None:
        while self._kept:
            self._evict_kept()

    # ------------------------------------------------------------------ the prompt cache (files)
    def _from_prompt_cache(self, req: Request, hit: PrefixHit | None) -> PrefixHit | None:
        """A new sequence restored from the longest stored prefix of ``req`` that is longer than the
        in-memory ``hit``, or None (no such file; the files that fail their checks are skipped, each
        with one warning; no slot or cells: memory or a fresh prefill serve the request instead).

        The restored sequence is the request's own (as a fork of a kept sequence would be): it uses
        cells of the request's own admission budget and no extra slot, so it takes nothing from
        running work."""
        store = self.prompt_cache
        if req.num_computed:
            return None
        t0 = time.perf_counter()
        try:
            while True:
                entry = self._stored_prefix(req, hit)
                if entry is None:
                    break
                data = store.read(entry)
                if data is None:
                    continue
                try:
                    seq = self.cache.restore(data)
                except CapacityError:
                    break
                except HebrusError as err:    # CorruptStateError, or any other refusal of this file's state
                    store.skip(entry, str(err))
                    continue
                self.counters.prompt_cache_hits += 1
                self.counters.prompt_cache_hit_tokens += len(entry.tokens)
                return PrefixHit(seq, len(entry.tokens))
            self.counters.prompt_cache_misses += 1
            return None
        finally:
            self.counters.prompt_cache_seconds += time.perf_counter() - t0

    def _to_prompt_cache(self, req: Request) -> None:
        """Write a finished request's state to the files (the blob is taken here, the file written on the store's
        writer thread: ``PromptCacheStore.put_later``): at its frontier (``num_computed`` tokens), or,
        with the chunked GDN form and a frontier at or past C, at the last multiple of C within its whole
        prompt chunks that has a snapshot. A request restored from such a frontier would continue with the
        bits of a request whose outputs ran recurrently where its own prompt runs them chunked (the rule
        ``_shareable`` applies to kept sequences); from an aligned position within the writer's whole
        prompt chunks any request that extends the tokens continues with its own bits. A failure is counted in ``prompt_cache_write_errors`` (an
        I/O error is also warned about, once per file); it never reaches the request."""
        n = req.num_computed
        if self.prompt_cache is None or n < 1:
            return
        t0 = time.perf_counter()
        try:
            c = self.chunk_align
            if not c:
                self.prompt_cache.put_later(req.tokens[:n], self.cache.save(req.seq))
                return
            extent = self._extent.get(req.seq, 0)
            if n < c:       # the frontier: requests whose prompts stay below C may continue it (_shareable)
                self.prompt_cache.put_later(req.tokens[:n], self.cache.save(req.seq), extent)
                return
            aligned = min(extent, n // c * c)   # a multiple of C: any request that extends it may continue it
            if aligned == n:
                self.prompt_cache.put_later(req.tokens[:n], self.cache.save(req.seq), extent)
                return
            seq = self.cache.fork(req.seq)
            try:
                for p in range(aligned, 0, -c):
                    try:
                        self.cache.rewind(seq, p)     # refused (nothing changes) without a snapshot at p
                    except HebrusError:
                        continue
                    self.prompt_cache.put_later(req.tokens[:p], self.cache.save(seq), extent)
                    return
            finally:
                self.cache.free(seq)
        except HebrusError:   # (OSError is the store's own: counted and warned there)
            self.prompt_cache.note_write_error()
        finally:
            self.counters.prompt_cache_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Release the prompt cache's directory (another engine may then open it); idempotent. The
        engine still runs, without files."""
        if self.prompt_cache is not None:
            self.prompt_cache.close()
            self.prompt_cache = None

    def _make_room(self) -> None:
        """Evict kept prefixes while the running requests and the next waiting one would lack a slot (the
        scheduler reclaims cells itself, through ``_reclaim``)."""
        sched = self.scheduler
        if sched.waiting:
            while self._kept and len(sched.running) + len(self._kept) >= self.config.max_sequences:
                self._evict_kept()

    def _reclaim(self, req: Request | None, n: int) -> int:
        """Evict kept prefixes, least recently used first, until ``n`` cells are free for ``req`` (a
        running request, None for the decodes, or a waiting one being admitted); returns the cells freed.

        For a waiting request the kept sequence it would start from is spared, and nothing is evicted
        unless the kept state could cover all ``n`` cells (an admission that would fail anyway must not
        empty the prefix cache). For running work every kept sequence goes if need be.
        """
        if not self._kept or n <= 0:
            return 0
        spare = None
        if req is not None and req.status is RequestStatus.WAITING:
            hit = self._prefix_hit(req)
            spare = hit.seq if hit is not None else None
            if sum(c for s, c in self._kept.items() if s != spare) < n:
                return 0
        before = self._free_cells()
        freed = 0
        for seq in [s for s in self._kept if s != spare]:
            if freed >= n:
                break
            self._evict_kept(seq)
            freed = self._free_cells() - before
        return freed

    def _prefix_hit(self, req: Request) -> PrefixHit | None:
        """The kept or running sequence a waiting ``req`` would start from (the longest prefix of its stream, but
        its last token, whose state it may continue: ``_shareable``), or None. The one lookup of admission, its
        cell count and reclaim."""
        if self.prefix is None or req.num_computed:
            return None
        extent = self.scheduler.chunk_extent(req)
        return self.prefix.lookup(req.tokens, req.num_tokens - 1,
                                  accept=lambda seq, n: self._shareable(seq, n, extent))

    def _stored_prefix(self, req: Request, hit: PrefixHit | None):
        """The file (a ``StoredPrefix``, not read) longer than the in-memory ``hit`` that would serve a waiting
        ``req``, or None."""
        if self.prompt_cache is None or req.num_computed:
            return None
        extent = self.scheduler.chunk_extent(req)
        return self.prompt_cache.lookup(req.tokens, req.num_tokens - 1,
                                        min_tokens=(hit.tokens if hit is not None else 0) + 1,
                                        accept=lambda e: self._file_shareable(e, extent))

    def _cells_needed(self, req: Request) -> int:
        """The cells admitting ``req`` takes: its pending stream less the prefix it shares with the sequence it
        forks (a state restored from a file takes cells of its own)."""
        hit = self._prefix_hit(req)
        if hit is None or self._stored_prefix(req, hit) is not None:
            return req.remaining
        return req.remaining - hit.tokens

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
                what = f"{self._cells_needed(req)} cache cell(s) to start"
        err = CapacityError(f"engine: request {req.request_id!r} cannot progress: it needs {what}, and {free} of "
                            f"the {cap} cells are free with {len(sched.running)} request(s) running and "
                            f"{len(self._kept)} prefix(es) kept; the other cells are held by sequences "
                            f"outside the engine's requests")
        return self._fail([req], f"{type(err).__name__}: {err}")

    def _release_draft(self, req: Request) -> None:
        """Free what the drafter holds for ``req`` (a draft model's sequence)."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(req)

    def _release_state(self, req: Request) -> None:
        self._release_draft(req)
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


def _token_ids(value: Any, what: str) -> list[int]:
    """``value`` as a list of Python ints: a sequence (list, tuple, range, a 1-D NumPy array) of integers or
    a 1-D integer tensor. Anything else is refused, never converted (``"123"`` is not ``[1, 2, 3]``, and
    ``5.9`` is not ``5``).

    Raises:
        BadRequestError: naming ``what`` and what was wrong.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise BadRequestError(f"{what} must be a 1-D integer tensor of token ids, got a {value.dim()}-D "
                                  f"{value.dtype} tensor")
        return [int(t) for t in value.tolist()]
    ndim = getattr(value, "ndim", None)
    if isinstance(value, (str, bytes, bytearray)) or not (isinstance(value, collections.abc.Sequence)
                                                         or ndim == 1):
        raise BadRequestError(f"{what} must be a sequence of integer token ids, got {type(value).__name__}")
    out = []
    for i, t in enumerate(value):
        if isinstance(t, bool) or type(t).__name__ == "bool_":
            raise BadRequestError(f"{what}: element {i} is a bool ({t!r}), not a token id")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise BadRequestError(f"{what}: element {i} is {t!r} ({type(t).__name__}), not an integer token id") \
                from None
    return out


def _id_set(value: int | Iterable[int] | None, what: str = "eos_token_id") -> frozenset[int]:
    """Token ids (negative ones dropped: "no EOS"); a single id or a sequence / 1-D tensor of them."""
    if value is None:
        return frozenset()
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.reshape(1)
    if not isinstance(value, (torch.Tensor, collections.abc.Sequence)) or isinstance(value, (str, bytes)):
        value = [value]
    return frozenset(t for t in _token_ids(value, what) if t >= 0)


def _generator_states(requests: Iterable[Request]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The state of each request's generator (a step that fails puts them back: its retry draws the same)."""
    return [(r.generator, r.generator.get_state()) for r in requests if r.generator is not None]


def _restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for gen, state in states:
        gen.set_state(state)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

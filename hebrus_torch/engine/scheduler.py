"""Which requests run in the next step, and how many tokens each: a ``StepPlan``. No tensors here.

Policy (vLLM v1 and transformers' own continuous-batching scheduler order work the same way):

1. every decoding request gets its one token, oldest first;
2. requests part-way through their prompt continue, oldest first, each with as many tokens as the
   budget (``max_batch_tokens``) has left;
3. waiting requests are admitted in arrival order while a sequence slot, the request cap
   (``max_requests_per_batch``), the token budget and the cache's free cells allow, the cells a
   request takes counted beside what the running ones still need;
4. speculating decodes get their drafted tokens (``engine/speculative.py``), oldest first, from what the
   budget leaves and the cells beyond what the running requests keep.

The scheduler owns the engine's ``CacheManager`` (``engine/cache_manager.py``): it admits requests there
(a sequence, maybe forked from a shared prefix), counts the cells an admission takes, and reclaims cells
held by state no running request needs (kept prefixes) first, whenever any of the three lacks cells. When the decodes alone need more cells than are free, or no
running request can go on, the newest running requests are preempted (their state is freed; they go
back to the front of the queue and are recomputed later from prompt plus output). With ``block_size``, a prefill chunk that crosses a block boundary is cut at the last
boundary it crosses, so the state at that boundary exists and can be shared (prefix sharing).

With ``chunk_align`` (C = 64 when the model's GDN layers run the chunked form in prefill), a request's
positions below ``A = C * floor(len(prompt) / C)`` (its whole prompt chunks) are cut only at multiples
of C: a chunk there ends at a multiple of C or at the prompt's end, never past the prompt (after a
preemption, the recomputed outputs ran recurrently the first time and are fed in later steps). A chunk
that cannot reach the next multiple of C within the step's budget or free cells waits (0 tokens), and
holds the rest of the step's budget: no later request prefills and none is admitted in that step; in
the next step it goes first, before the decodes, with the whole budget (>= C), so it advances by a chunk
(docs/engine.md: the alignment rule, and why it always progresses).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from .requests import Request, RequestStatus

if TYPE_CHECKING:
    from .cache_manager import CacheManager

__all__ = ["Scheduler", "StepPlan", "ScheduledChunk"]


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` from its ``num_computed``-th on."""

    request: Request
    num_tokens: int
    drafts: list[int] = field(default_factory=list)
    """Drafted tokens fed after the stream's (a speculative verification row: ``engine/speculative.py``)."""

    @property
    def width(self) -> int:
        """Tokens the step feeds: the stream's and the drafts."""
        return self.num_tokens + len(self.drafts)

    @property
    def start(self) -> int:
        return self.request.num_computed

    @property
    def needs_logits(self) -> bool:
        """True when the chunk reaches the end of the request's stream: a token is sampled after it."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def tokens(self) -> list[int]:
        return self.request.pending_tokens(self.num_tokens) + self.drafts


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.width for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    """Admission, chunking and preemption over plain request objects.

    Args:
        max_batch_tokens: tokens per step (None: unlimited).
        max_requests_per_batch: requests per step (None: as many as there are slots).
        max_sequences: sequence slots of the cache (running requests at once).
        block_size: prefill chunks end on multiples of it when they cross one (None: no alignment).
        chunk_align: prefill chunks below a request's last whole prompt chunk end on multiples of it
            (the chunked form's chunk size; None: no alignment). Needs max_batch_tokens >= chunk_align.
        cache_manager: the cache manager that admits requests, counts their cells and reclaims kept state (None: a
            plain table of requests, every admission granted, as the tests of the policy use it).
    """

    def __init__(self, *, max_batch_tokens: int | None, max_requests_per_batch: int | None,
                 max_sequences: int, block_size: int | None = None, chunk_align: int | None = None,
                 cache_manager: "CacheManager | None" = None):
        if chunk_align and max_batch_tokens is not None and max_batch_tokens < chunk_align:
            raise ValueError(f"Scheduler: chunk_align {chunk_align} needs max_batch_tokens >= it, got {max_batch_tokens}")
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.max_sequences = max_sequences
        self.block_size = block_size
        self.chunk_align = chunk_align
        self.cache_manager = cache_manager
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._arrivals = 0
        self._held: Request | None = None   # the prefill that waited for an aligned cut last step

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drop a request from the queues (finished, failed or cancelled)."""
        if request in self.running:
            self.running.remove(request)
        try:
            self.waiting.remove(request)
        except ValueError:
            pass

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting

    def join(self, request: Request) -> None:
        """Run a request whose sequence the engine made outside ``schedule`` (a fork of another request's
        prompt: it decodes from the next step on)."""
        request.arrival = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.DECODING
        self.running.append(request)

    def preempt(self, request: Request) -> None:
        """Back to the front of the queue, to recompute from scratch (its state must be freed first)."""
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ one step
    def schedule(self, free_cells: int | None = None, drafts: Mapping[Request, Sequence[int]] | None = None, *,
                 admit: Callable[[Request], bool | None] | None = None,
                 release: Callable[[Request], None] | None = None,
                 reclaim: Callable[[Request | None, int], int] | None = None,
                 cells_needed: Callable[[Request], int] | None = None) -> StepPlan:
        """Plan the next step given ``free_cells`` free cache cells (positions the cache can still take;
        default: the cache manager's count). ``drafts``: the tokens drafted for speculating decodes
        (``engine/speculative.py``), fed after their stream's token where the budget and cells allow.

        With a cache manager, each request taken off the queue is admitted there before its chunk is cut
        (a sequence, maybe from a shared prefix, which raises ``num_computed``): not now (None) leaves it
        queued in its place and goes on with the next, no room (False) stops admission. A request about to be
        preempted has its state released there, and kept state is reclaimed there for running work and for an
        admission (it always yields to them); the cells an admission takes are its pending stream less a
        shared prefix. ``admit``, ``release``, ``reclaim(request, n)`` (returns the cells freed) and
        ``cells_needed`` replace the manager's, where given (a table without one grants every admission).

        Progress: when the decodes alone do not fit, or nothing runs a decode and no prefill can get
        a cell, the newest running requests are preempted until the others can go on. A lone running
        request is never preempted (it would come back to the same cells): a plan that leaves work
        undone with no chunk at all is the engine's to report (``CapacityError`` for the request
        that cannot progress).
        """
        cm = self.cache_manager
        if cm is not None:
            cm.make_room(len(self.running), len(self.waiting))
            admit = admit or (lambda r: cm.admit(r, self.running))
            release = release or cm.release
            reclaim = reclaim or cm.reclaim
            cells_needed = cells_needed or cm.cells_needed
            if free_cells is None:
                free_cells = cm.free_cells()
        if free_cells is None:
            raise ValueError("Scheduler.schedule: free_cells is needed without a cache manager")
        drafts = drafts or {}
        plan = StepPlan()
        budget = self.max_batch_tokens if self.max_batch_tokens is not None else float("inf")
        cap = self.max_requests_per_batch if self.max_requests_per_batch is not None else self.max_sequences

        def room_for(req: Request | None, n: int) -> bool:
            """``free_cells >= n``, reclaiming kept state for ``req`` if needed."""
            nonlocal free_cells
            if free_cells < n and reclaim is not None:
                free_cells += reclaim(req, int(n - free_cells))
            return free_cells >= n

        decoding = [r for r in self.running if r.remaining == 1]
        room_for(None, len(decoding) if decoding else min(1, len(self.running)))
        while len(self.running) > 1 and (len(decoding) > free_cells or (not decoding and free_cells < 1)):
            victim = max(self.running, key=lambda r: r.arrival)
            if victim in decoding:
                decoding.remove(victim)
            free_cells += victim.num_computed
            if release is not None:
                release(victim)
            self.preempt(victim)
            plan.preempted.append(victim)

        planned: dict[Request, int] = {}      # request -> tokens this step
        # A prefill that waited for an aligned cut last step goes first: with the decodes first, a budget
        # near C would never leave it the C tokens it needs while any request decodes.
        first, self._held = self._held, None
        if first is not None and first in self.running and first.remaining > 1 and budget >= 1:
            n = self._chunk(first, min(budget, free_cells)) if room_for(first, min(first.remaining, budget)) else 0
            if n > 0:
                plan.chunks.append(ScheduledChunk(first, n))
                planned[first] = n
                budget -= n
                free_cells -= n
        for req in decoding:
            if budget < 1 or len(plan.chunks) >= cap or free_cells < 1:
                break
            plan.chunks.append(ScheduledChunk(req, 1))
            planned[req] = 1
            budget -= 1
            free_cells -= 1

        held = False          # a prefill waits for an aligned cut: it holds the rest of the step's budget
        for req in self.running:
            if req.remaining <= 1 or len(plan.chunks) >= cap or budget < 1 or req in planned:
                continue
            if not room_for(req, min(req.remaining, budget)) and free_cells < 1:
                continue
            n = self._chunk(req, min(budget, free_cells))
            if n == 0:
                held = True
                self._held = req
                break
            plan.chunks.append(ScheduledChunk(req, n))
            planned[req] = n
            budget -= n
            free_cells -= n

        # A request is admitted when the cells it takes fit beside what the running requests still need
        # (the rest of each one's stream after this step, plus one cell for its next decode), or when
        # nothing runs; none is in a step that had to preempt (the freed cells go to the requests already
        # running) or whose budget a prefill waiting for an aligned cut holds.
        reserved = sum(r.remaining - planned.get(r, 0) + 1 for r in self.running)
        for req in list(self.waiting if not plan.preempted and not held else ()):
            if not (len(self.running) < self.max_sequences and len(plan.chunks) < cap and budget >= 1):
                break
            cells = cells_needed(req) if cells_needed is not None else req.remaining
            if not room_for(req, reserved + cells) and not (not self.running and free_cells >= 1):
                break
            verdict = True if admit is None else admit(req)
            if verdict is None:       # deferred (e.g. waiting for a request that prefills its prefix)
                continue
            if not verdict:
                break
            self.waiting.remove(req)
            req.arrival = self._arrivals
            self._arrivals += 1
            req.status = RequestStatus.PREFILLING
            self.running.append(req)
            plan.admitted.append(req)
            n = self._chunk(req, min(budget, free_cells))
            if n > 0:
                plan.chunks.append(ScheduledChunk(req, n))
                budget -= n
                free_cells -= n
            reserved += req.remaining - n + 1
            if n == 0:        # admitted, waits for an aligned cut (or cells): holds the rest of the budget
                self._held = req
                break
        # Drafts last: they take what the budget leaves after every prefill and admission (speculation never
        # delays another request's first token), and only cells beyond what the running requests keep.
        spare = int(min(budget, free_cells - reserved))
        for chunk in plan.chunks:
            if spare < 1:
                break
            draft = drafts.get(chunk.request)
            if draft and chunk.num_tokens == 1 and chunk.request.remaining == 1:
                chunk.drafts = list(draft[:spare])
                spare -= len(chunk.drafts)
        return plan

    def chunk_extent(self, req: Request) -> int:
        """Where ``req``'s positions cut only at multiples of chunk_align end: its last whole prompt chunk
        (0 without chunk alignment). The chunked form runs below it, the recurrent form from it on."""
        return req.chunk_extent(self.chunk_align)

    def _chunk(self, req: Request, limit: float) -> int:
        """A prefill chunk of at most ``limit`` tokens; 0 when it cannot reach an aligned cut (see the module
        docstring). With a block size, one that crosses a block boundary inside the prompt ends on the last
        one it crosses (the state there can then be shared), unless that would cut below the chunk extent
        at a position that is not a multiple of chunk_align."""
        n = int(min(req.remaining, limit))
        start, extent = req.num_computed, self.chunk_extent(req)
        if start < extent:
            end = min(start + n, len(req.prompt))
            if end < extent:
                end -= end % self.chunk_align
            n = end - start
        if self.block_size and n > 0:
            end = min(start + n, len(req.prompt))
            aligned = end - end % self.block_size
            if start < aligned < start + n and (aligned >= extent or aligned % self.chunk_align == 0):
                n = aligned - start
        return n

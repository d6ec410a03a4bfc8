"""The drafts of a step: for every decoding request that speculates, up to its adaptive length of tokens
from prompt lookup over its own stream or from the engine's drafter (``engine/speculative.py``,
``engine/draft_model.py``). They go to the scheduler as an argument (``Scheduler.schedule(drafts=)``).

A drafter's failure stays with its request: a batched call that raises is repeated one request at a time,
and a request whose drafter raises or proposes something other than token ids of the vocabulary stops
speculating (``spec.error`` says why; its tokens are those of plain decoding) while the others go on.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..errors import HebrusError
from .intake import token_ids
from .requests import Request
from .speculative import NgramIndex

__all__ = ["propose_drafts"]


def propose_drafts(running: Sequence[Request], drafter: Any, *, vocab_size: int, capacity_tokens: int,
                   stop_speculating: Callable[[Request, str], None],
                   mtp_drafter: Any = None, counters: Any = None) -> dict[Request, list[int]]:
    """The drafts of the requests of ``running`` that decode and speculate, as many tokens as each one's adaptive
    length, its ``max_new_tokens`` and the cache allow (requests without drafts are left out).
    A request drafts nothing in a step where more requests decode than its ``disable_by_batch_size``.
    ``stop_speculating(request, why)`` is called for a request whose drafter failed. Requests with
    ``method="mtp"`` ask ``mtp_drafter`` (all of them in one batch), the others ``drafter`` (None: prompt lookup);
    ``SpecState.confidence_stops`` counts the MTP drafts that ``confidence_threshold`` ended before their length (and
    ``counters.spec_confidence_stops``, the engine's ``EngineCounters``, where given); an MTP round that proposed
    nothing (``first_token_threshold``) is the request's ``SpecState.unsure_round`` (``spec_unsure_rounds``).
    MTP requests in their back-off pause ride a round that other MTP requests draft in (``SpecState.ride_length``;
    ``counters.spec_rides``)."""
    drafts: dict[Request, list[int]] = {}
    asking: list[tuple[Request, int]] = []
    asking_mtp: list[tuple[Request, int]] = []
    riders: list[tuple[Request, int]] = []
    decoding = sum(1 for req in running if req.remaining == 1)
    for req in running:
        spec, cfg = req.spec, req.speculative
        if not cfg.enabled or req.remaining != 1 or not req.generated or spec.error is not None:
            continue
        if cfg.disable_by_batch_size is not None and decoding > cfg.disable_by_batch_size:
            continue                   # (before next_length: a step without drafting counts for no back-off)
        room = min(req.max_new_tokens - len(req.generated) - 1, capacity_tokens - req.num_tokens - 1)
        k = min(spec.next_length(cfg), room)
        spec.riding = False
        if k <= 0:
            ride = min(spec.ride_length(cfg), room) if cfg.method == "mtp" and mtp_drafter is not None else 0
            if ride > 0:
                riders.append((req, ride))
            continue
        if cfg.method == "mtp" and mtp_drafter is not None:
            asking_mtp.append((req, k))
        elif drafter is None:
            if spec.lookup is None:
                spec.lookup = NgramIndex(cfg.max_ngram, cfg.min_ngram)
            drafts[req] = spec.lookup.propose(req.tokens, k)
        else:
            asking.append((req, k))
    if asking_mtp and riders:
        for req, _ in riders:
            req.spec.riding = True
            req.spec.rides += 1
            if counters is not None:
                counters.spec_rides += 1
        asking_mtp += riders
    stopped = getattr(mtp_drafter, "stopped", None)
    if asking_mtp and stopped is not None:
        stopped.clear()
    for who, group in ((drafter, asking), (mtp_drafter, asking_mtp)):
        if group:
            for (req, _), draft in zip(group, _ask(who, group, vocab_size, stop_speculating)):
                drafts[req] = draft
    for req, k in asking_mtp:
        if stopped is None or req.spec.error is not None:
            continue
        ended = stopped.get(req, k)
        if ended == 0:
            req.spec.unsure_round(req.speculative)
            if counters is not None:
                counters.spec_unsure_rounds += 1
        elif ended < k:
            req.spec.confidence_stops += 1
            if counters is not None:
                counters.spec_confidence_stops += 1
    return {r: d for r, d in drafts.items() if d}


def _ask(drafter: Any, asking: list[tuple[Request, int]], vocab_size: int,
         stop_speculating: Callable[[Request, str], None]) -> list[list[int]]:
    """The drafter's tokens for each ``(request, k)``, at most k each ([] where it failed)."""
    batch = getattr(drafter, "propose_batch", None)
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
            draft = found[i] if found is not None else drafter(req, k)
            draft = token_ids(draft, f"engine: the drafter for {req.request_id!r}")[:k]
            bad = [t for t in draft if not 0 <= t < vocab_size]
            if bad:
                raise HebrusError(f"engine: the drafter proposed token ids {bad[:5]} outside the vocabulary "
                                  f"[0, {vocab_size}) for {req.request_id!r}")
        except Exception as err:  # noqa: BLE001 - only this request stops speculating
            stop_speculating(req, f"{type(err).__name__}: {err}")
            draft = []
        out.append(draft)
    return out

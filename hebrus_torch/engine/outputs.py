"""A step's output applied to its requests: ``apply_step`` is the one place a step moves ``num_computed``, appends
tokens (sampled, or accepted by a verification), cuts a verification row back to what it kept, records
prefixes, and finishes requests (stops, lengths). ``finish`` ends a request in any state (finished, failed,
cancelled) and hands its state to the cache manager.

Everything here runs after the step's transaction committed and reads no device: the tokens were read
inside it (``StepResult``). A failure here stays with its request: it fails alone, its state is released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from ..errors import HebrusError
from ..model_cache import StepRecording
from ..state.handles import SeqHandle
from .requests import FinishReason, Request, RequestStatus
from .sampling import Pick
from .scheduler import ScheduledChunk
from .speculative import Verdict

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["StepOutput", "StepResult", "apply_step", "finish", "fail", "stop_reason"]


@dataclass
class StepOutput:
    """What one step did to one request: the tokens it gained and whether it is done."""

    request: Request
    new_tokens: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class StepResult:
    """What executing a plan produced (the tokens, read inside its transaction).

    Attributes:
        chunks: the plan's chunks, as they ran.
        picks: by ``id(chunk)``, the token a chunk that reached the end of its stream sampled.
        verdicts: by ``id(chunk)``, a verification row's Verdict.
        forks: the other choices of a prompt that ended in the step, each with its sequence (forked after the
            commit) and the token it sampled from its parent's row.
        recording: the step's recording where it had verification rows (``ModelCache.truncate`` cuts them).
    """

    chunks: Sequence[ScheduledChunk]
    picks: dict[int, Pick]
    verdicts: dict[int, Verdict]
    forks: list[tuple[Request, Pick]] = field(default_factory=list)
    recording: StepRecording | None = None


def apply_step(engine: "Engine", result: StepResult) -> list[StepOutput]:
    """Apply an executed step to its requests (see the module docstring); returns what changed for each."""
    emitted, recomputing, failed = _keep_verified(engine, result) if result.verdicts else ({}, set(), {})
    if result.recording is not None:
        result.recording.release()
    outputs: list[StepOutput] = []
    now = time.perf_counter()
    for chunk in result.chunks:
        req = chunk.request
        if req in failed:
            outputs += fail(engine, [req], failed[req])
            continue
        try:
            out = _apply_chunk(engine, chunk, result.picks.get(id(chunk)), emitted.get(id(chunk)),
                               req in recomputing, now)
        except Exception as err:  # noqa: BLE001 - host bookkeeping of one request (a tokenizer, a callback)
            if not req.status.is_done:
                outputs += fail(engine, [req], f"{type(err).__name__}: {err}")
            continue
        if out is not None:
            outputs.append(out)
    outputs += [_append(engine, fork, *_pick_tokens(fork, pick), now) for fork, pick in result.forks]
    return outputs


def _apply_chunk(engine: "Engine", chunk: ScheduledChunk, pick: Pick | None, emitted: tuple | None,
                 recomputing: bool, now: float) -> StepOutput | None:
    """One executed chunk: the tokens now in the cache, then the token it sampled (``pick``) or the tokens its
    verification emitted (``emitted``; ``recomputing``: its state could not be cut back and was freed, so it
    recomputes from scratch). None when it samples nothing."""
    req, counters = chunk.request, engine.counters
    needs_logits = chunk.needs_logits      # (before num_computed moves)
    end = chunk.start + chunk.num_tokens
    if chunk.drafts:
        new_tokens, logprobs, tops = emitted
        # the step's first token and the kept drafts (none if the request must recompute)
        end = 0 if recomputing else chunk.start + len(new_tokens)
        counters.decode_tokens += chunk.width
    elif end <= len(req.prompt):
        counters.prefill_tokens += chunk.num_tokens
    else:
        counters.decode_tokens += chunk.num_tokens
    req.prefilled_tokens += chunk.width
    before, req.num_computed = req.num_computed, end
    engine.cache_manager.record_prefix(req)
    if engine.on_prompt_done is not None and before < len(req.prompt) <= end:
        engine.on_prompt_done(req)
    if not needs_logits:
        return None
    if chunk.drafts:
        return _append(engine, req, new_tokens, logprobs, tops, now, not recomputing)
    return _append(engine, req, *_pick_tokens(req, pick), now)


def _pick_tokens(req: Request, pick: Pick) -> tuple[list[int], list[float] | None, list[tuple] | None]:
    """A sampled token (a ``sampling.Pick``) as (tokens, logprobs, top alternatives)."""
    return ([pick.token], None if pick.logprob is None else [pick.logprob],
            [pick.top] if pick.logprob is not None and req.sampling.top_logprobs else None)


def _append(engine: "Engine", req: Request, tokens: list[int], logprobs: list[float] | None,
            tops: list[tuple] | None, now: float, running: bool = True) -> StepOutput:
    """Append a step's tokens to ``req`` (``running``: False when it must recompute: its status stays);
    finish it if it stops at the last."""
    req.generated.extend(tokens)
    if req.constraint is not None:
        try:
            req.constraint.advance(tokens)
        except HebrusError as err:       # a token its grammar refused: this request fails alone
            if logprobs is not None:
                req.logprobs.extend(logprobs)
            finish(engine, req, RequestStatus.FAILED, f"{type(err).__name__}: {err}")
            return StepOutput(req, list(tokens), True)
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
    reason = stop_reason(engine, req)
    if reason is not None:
        req.finish_reason = reason
        finish(engine, req, RequestStatus.FINISHED)
        out.finished = True
    return out


def _keep_verified(engine: "Engine", result: StepResult
                   ) -> tuple[dict[int, tuple], set[Request], dict[Request, str]]:
    """Turn each verification row's Verdict into the tokens it emits (cut at the first that stops the
    request) and cut the step short for the rows that keep fewer tokens than they fed. Returns, by
    ``id(chunk)``, (tokens, logprobs or None, top alternatives or None); the requests whose state could not
    be cut (freed instead: they recompute, keeping their tokens); and the requests whose tokens could not be
    judged (a stop string's tokenizer raised), with why: they fail, and nothing of theirs is cut."""
    counters = engine.counters
    cut: dict[SeqHandle, int] = {}
    emitted_by: dict[int, tuple] = {}
    failed: dict[Request, str] = {}
    for chunk in result.chunks:
        if not chunk.drafts:
            continue
        req, verdict = chunk.request, result.verdicts[id(chunk)]
        emitted = verdict.emitted(chunk.drafts)
        base, n = len(req.generated), 0
        try:
            for token in emitted:                   # stop where decoding token by token would have stopped
                req.generated.append(token)
                n += 1
                if stop_reason(engine, req) is not None:
                    break
        except Exception as err:  # noqa: BLE001 - this request fails alone
            failed[req] = f"{type(err).__name__}: {err}"
            continue
        finally:
            del req.generated[base:]
        req.spec.update(req.speculative, len(chunk.drafts), verdict.accepted)
        counters.spec_verify_rows += 1
        counters.spec_drafted_tokens += len(chunk.drafts)
        counters.spec_accepted_tokens += verdict.accepted
        emitted_by[id(chunk)] = (emitted[:n], None if verdict.logprobs is None else verdict.logprobs[:n],
                                 None if verdict.tops is None else verdict.tops[:n])
        if n < chunk.width:                     # the cache keeps the step's first token and n - 1 drafts
            cut[req.seq] = n
    counters.spec_steps += 1
    if not cut:
        return emitted_by, set(), failed
    try:
        engine.cache.truncate(result.recording, cut)
        counters.spec_rollbacks += len(cut)
        return emitted_by, set(), failed
    except Exception:  # noqa: BLE001 - never expected; the requests recompute rather than run on a bad state
        recomputing = set()
        for chunk in result.chunks:
            if chunk.request.seq in cut:
                recomputing.add(chunk.request)
                engine.release(chunk.request)
                engine.scheduler.preempt(chunk.request)
                counters.preemptions += 1
        return emitted_by, recomputing, failed


def stop_reason(engine: "Engine", req: Request) -> FinishReason | None:
    """Why ``req`` stops after its last generated token (None: it goes on)."""
    if req.generated[-1] in req.eos_token_ids:
        return FinishReason.EOS
    if req.constraint is not None and (req.constraint.ends_with(req.generated[-1]) or req.constraint.finished):
        return FinishReason.EOS          # the grammar is complete (structured output)
    if req.stop_strings:
        text = engine.tokenizer.decode(req.generated)
        if any(s in text for s in req.stop_strings):
            return FinishReason.STOP_STRING
    if len(req.generated) >= req.max_new_tokens:
        return FinishReason.LENGTH
    if req.num_tokens >= engine.config.capacity_tokens:
        return FinishReason.LENGTH
    return None


def finish(engine: "Engine", req: Request, status: RequestStatus, error: str | None = None) -> None:
    """End ``req`` with ``status``: off the queues, its pending forks run on their own, its state written to the
    files and kept (finished normally, where it fits) or released."""
    req.status = status
    req.error = error
    req.finished_time = time.perf_counter()
    engine.scheduler.remove(req)
    forks, req.forks = req.forks, []
    for fork in forks:             # ended before its prompt did: the other choices run on their own
        if not fork.status.is_done:
            engine.scheduler.add(fork)
    if status is RequestStatus.FINISHED and engine.cache_manager.finished(req):
        engine.release_draft(req)
        return
    engine.release(req)


def fail(engine: "Engine", requests: Iterable[Request], message: str) -> list[StepOutput]:
    """Fail ``requests`` with ``message``; their outputs."""
    outs = []
    for req in requests:
        finish(engine, req, RequestStatus.FAILED, message)
        outs.append(StepOutput(req, [], True))
    return outs

"""A request and its state machine: waiting -> prefilling -> decoding -> finished / failed / cancelled.

A request's token stream is ``prompt + generated``; ``num_computed`` of them are in the cache. What
a step feeds is always ``tokens[num_computed:]`` (cut by the scheduler): a whole or partial prompt
while prefilling, the one token sampled last while decoding, and prompt plus output again after a
preemption freed the request's state (recompute). A step that reaches the end of the stream yields
logits, and the request samples its next token from them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..state.handles import SeqHandle
from .sampling import SamplingParams
from .speculative import SpecState, SpeculativeConfig

if TYPE_CHECKING:
    from .constraints import GrammarState

__all__ = ["Request", "RequestStatus", "FinishReason"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED)


class FinishReason(enum.Enum):
    EOS = "stop"          # OpenAI's name for a natural stop (EOS or a stop string)
    STOP_STRING = "stop_string"
    LENGTH = "length"


@dataclass(eq=False)
class Request:
    """One generation request, owned by the engine's thread.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt token ids.
        max_new_tokens: the most tokens to generate (>= 1).
        sampling: how tokens are picked.
        eos_token_ids: generation stops after any of these (the EOS is kept in the output, as
            transformers does).
        stop_strings: generation stops once the decoded output contains one (needs the engine's tokenizer).
        streaming: deliver an output after every token, not only at the end.
        logprobs, top_logprobs: per generated token, its log-probability and the most likely alternatives
            (when ``sampling.logprobs`` / ``sampling.top_logprobs`` ask for them).
        forks: requests with this one's prompt (other choices of one prompt) that are forked from this
            request's sequence once its prompt is in the cache, and sample their first token from its logits
            there: the prompt is prefilled once. They run on their own if this request ends first.
        speculative: how it speculates (``engine/speculative.py``; off by default).
        constraint: the grammar its output follows (structured output, ``engine/constraints.py``), or None.
    """

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    streaming: bool = False
    record_timestamps: bool = False
    status: RequestStatus = RequestStatus.WAITING
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    forks: list["Request"] = field(default_factory=list, repr=False)
    error: str | None = None
    finish_reason: FinishReason | None = None
    seq: SeqHandle | None = None
    num_computed: int = 0
    arrival: int = 0                    # admission order: preemption takes the newest
    prefix_hit_tokens: int = 0          # prompt tokens taken from a shared prefix instead of prefilled
    prefilled_tokens: int = 0           # tokens this request actually ran through the model
    created_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float = -1.0
    first_token_time: float = -1.0
    finished_time: float = -1.0
    timestamps: list[float] = field(default_factory=list)
    generator: torch.Generator | None = field(default=None, repr=False)
    user_data: Any = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    spec: SpecState = field(default_factory=SpecState)   # drafts, adaptive length and counters
    constraint: "GrammarState | None" = field(default=None, repr=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def remaining(self) -> int:
        """Tokens of the stream not yet in the cache."""
        return self.num_tokens - self.num_computed

    def chunk_extent(self, align: int | None) -> int:
        """Where positions cut only at multiples of ``align`` end: the last whole prompt chunk (0 without
        alignment). The chunked GDN form runs below it, the recurrent form from it on (docs/engine.md)."""
        return len(self.prompt) // align * align if align else 0

    def pending_tokens(self, n: int) -> list[int]:
        start = self.num_computed
        if start < len(self.prompt):
            out = self.prompt[start:start + n]
            if len(out) < n:
                out = out + self.generated[:n - len(out)]
            return out
        g = start - len(self.prompt)
        return self.generated[g:g + n]

"""Per-request sampling, as transformers' ``GenerationConfig`` describes it.

Every request samples from its own logits row with its own ``torch.Generator``, so its tokens never
depend on which other requests share the step or on the order they arrived in. The processors run in
transformers' order: repetition penalty, then (when sampling) temperature, top-k, top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import HebrusError

__all__ = ["SamplingParams", "BadRequestError", "sample_next", "sample_rows"]


class BadRequestError(HebrusError):
    """A request the engine refuses before it enters any step (bad prompt or generation parameters)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens.

    Attributes:
        do_sample: False picks the argmax (greedy), True samples.
        temperature, top_k, top_p: transformers' warpers (applied only when sampling); top_k 0 and
            top_p 1.0 disable them.
        repetition_penalty: transformers' ``RepetitionPenaltyLogitsProcessor`` over prompt and output.
        seed: seeds the request's own generator; None draws one from ``torch.seed()``.
        logprobs: record the log-probability of each chosen token (under the processed distribution).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.do_sample, bool):
            problems.append(f"do_sample must be a bool, got {self.do_sample!r}")
        if not _finite(self.temperature) or self.temperature <= 0:
            problems.append(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            problems.append(f"seed must be an int or None, got {self.seed!r}")
        if problems:
            raise BadRequestError("SamplingParams: " + "; ".join(problems))

    @classmethod
    def from_generation_config(cls, config: Any, **overrides: Any) -> "SamplingParams":
        """The sampling fields of a transformers ``GenerationConfig`` (or any object with those attributes)."""
        def get(name: str, default: Any) -> Any:
            value = getattr(config, name, None) if config is not None else None
            return default if value is None else value

        fields = dict(do_sample=bool(get("do_sample", False)), temperature=float(get("temperature", 1.0)),
                      top_k=int(get("top_k", 0)), top_p=float(get("top_p", 1.0)),
                      repetition_penalty=float(get("repetition_penalty", 1.0)),
                      logprobs=bool(get("output_logits", False) or get("output_scores", False)))
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if not self.do_sample:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _process(logits: torch.Tensor, params: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """logits: Tensor[V] float32 -> processed Tensor[V] float32 (a new tensor)."""
    scores = logits.clone()
    if params.repetition_penalty != 1.0 and history:
        idx = torch.tensor(sorted(set(history)), dtype=torch.int64, device=scores.device)
        seen = scores[idx]
        scores[idx] = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
    if not params.do_sample:
        return scores
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.numel())
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        # transformers' TopPLogitsWarper: drop the low tail whose cumulative probability is <= 1 - top_p,
        # always keeping the most likely token.
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove = cum <= (1 - params.top_p)
        remove[-1] = False
        scores = scores.masked_fill(remove.scatter(0, order, remove), -math.inf)
    return scores


def sample_next(logits: torch.Tensor, params: SamplingParams, history: Sequence[int],
                generator: torch.Generator | None) -> tuple[int, float | None]:
    """Pick one request's next token.

    Args:
        logits: Tensor[V], the model's logits at the request's last position (any float dtype).
        params: the request's sampling parameters.
        history: the request's prompt and generated tokens (for the repetition penalty).
        generator: the request's generator (None when greedy).

    Returns:
        (token id, its log-probability under the processed distribution, or None unless asked).
    """
    return sample_rows(logits[None], [params], [history], [generator])[0]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
                generators: Sequence[torch.Generator | None]) -> list[tuple[int, float | None]]:
    """Pick the next token of every row, each row with its own parameters, history and generator.

    Row i gives what ``sample_next(logits[i], params[i], histories[i], generators[i])`` gives; the
    tokens (and log-probabilities) of all rows reach the host in one read, the step's one wait for
    the device.

    Args:
        logits: Tensor[n, V] (any float dtype).

    Returns:
        n (token id, log-probability or None) pairs, in row order.
    """
    picks: list[torch.Tensor] = []           # per row: [token, logprob] float64 on the logits' device
    for i, p in enumerate(params):
        scores = _process(logits[i].float(), p, histories[i])
        if p.do_sample:
            token = torch.multinomial(scores.softmax(-1), 1, generator=generators[i])[0]
        else:
            token = torch.argmax(scores)
        logprob = scores.log_softmax(-1)[token] if p.logprobs else torch.zeros((), device=scores.device)
        picks.append(torch.stack((token.double(), logprob.double())))    # ids < 2**53, fp32 exact in fp64
    if not picks:
        return []
    values = torch.stack(picks).tolist()
    return [(int(tok), lp if p.logprobs else None) for (tok, lp), p in zip(values, params)]

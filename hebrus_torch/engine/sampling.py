"""Per-request sampling, as transformers' ``GenerationConfig`` and OpenAI's API describe it.

Every request samples from its own logits row with its own ``torch.Generator``, so its tokens never
depend on which other requests share the step or on the order they arrived in. The processors run in
this order: OpenAI's ``logit_bias``, then its presence and frequency penalties (over the generated
tokens), transformers' repetition penalty (over prompt and output), then, when sampling, temperature,
top-k, top-p. Greedy requests take the argmax after the first three.

Log-probabilities (``logprobs``, ``top_logprobs``) are those of the distribution after bias, penalties and
temperature (temperature 1 when greedy), before top-k / top-p truncation: a token top-p removed still has
its finite log-probability there.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from ..errors import HebrusError

__all__ = ["SamplingParams", "BadRequestError", "Pick", "sample_next", "sample_rows", "sample_rows_reading",
           "MAX_TOP_LOGPROBS", "MAX_LOGIT_BIAS"]

MAX_TOP_LOGPROBS = 20      # OpenAI's cap on top_logprobs
MAX_LOGIT_BIAS = 100.0     # OpenAI's range of a logit_bias value: [-100, 100]
MAX_PENALTY = 2.0          # OpenAI's range of presence_penalty / frequency_penalty: [-2, 2]


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
        logprobs: record the log-probability of each chosen token (of the distribution the module doc names).
        top_logprobs: with ``logprobs``, also record the ``top_logprobs`` most likely tokens and their
            log-probabilities at each position (0..``MAX_TOP_LOGPROBS``).
        logit_bias: ``(token id, bias)`` pairs added to the logits before anything else (OpenAI's
            ``logit_bias``; biases in [-100, 100]; ids are checked against the vocabulary by the engine).
        presence_penalty, frequency_penalty: OpenAI's: ``presence * [count > 0] + frequency * count`` is
            subtracted from each token's logit, ``count`` its occurrences among the generated tokens
            (in [-2, 2]).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

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
        if not isinstance(self.logprobs, bool):
            problems.append(f"logprobs must be a bool, got {self.logprobs!r}")
        k = self.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            problems.append(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        elif k and self.logprobs is not True:
            problems.append(f"top_logprobs={k} needs logprobs=True")
        problems += _bias_problems(self.logit_bias)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                problems.append(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
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


def _bias_problems(bias: Any) -> list[str]:
    if not isinstance(bias, tuple) or not all(isinstance(e, tuple) and len(e) == 2 for e in bias):
        return [f"logit_bias must be a tuple of (token id, bias) pairs, got {bias!r:.80}"]
    bad_ids = [t for t, _ in bias if isinstance(t, bool) or not isinstance(t, int) or t < 0]
    bad_values = [v for _, v in bias if not _finite(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS]
    problems = []
    if bad_ids:
        problems.append(f"logit_bias token ids must be ints >= 0, got {bad_ids[:5]}")
    if bad_values:
        problems.append(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got "
                        f"{bad_values[:5]}")
    if len({t for t, _ in bias}) != len(bias):
        problems.append("logit_bias names a token id twice")
    return problems


def _penalised(logits: torch.Tensor, params: SamplingParams, history: Sequence[int],
               generated: Sequence[int]) -> torch.Tensor:
    """logits: Tensor[V] float32 -> a new Tensor[V] float32 after logit_bias, presence/frequency and
    repetition penalties (what greedy requests take the argmax of)."""
    scores = logits.clone()
    device = scores.device
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        scores[torch.tensor(ids, dtype=torch.int64, device=device)] += torch.tensor(values, dtype=scores.dtype,
                                                                                    device=device)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        counts = collections.Counter(generated)
        ids = torch.tensor(list(counts), dtype=torch.int64, device=device)
        n = torch.tensor(list(counts.values()), dtype=scores.dtype, device=device)
        scores[ids] -= params.presence_penalty + params.frequency_penalty * n
    if params.repetition_penalty != 1.0 and history:
        idx = torch.tensor(sorted(set(history)), dtype=torch.int64, device=device)
        seen = scores[idx]
        scores[idx] = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
    return scores


def _truncated(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tempered scores: Tensor[V] -> Tensor[V] with what top-k and top-p remove at -inf."""
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


class Pick(NamedTuple):
    """One row's pick: the token, its log-probability (None unless ``logprobs``) and the
    ``top_logprobs`` most likely ``(token, log-probability)`` pairs, most likely first (empty unless asked)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def sample_next(logits: torch.Tensor, params: SamplingParams, history: Sequence[int],
                generator: torch.Generator | None, generated: Sequence[int] = ()) -> Pick:
    """Pick one request's next token.

    Args:
        logits: Tensor[V], the model's logits at the request's last position (any float dtype).
        params: the request's sampling parameters.
        history: the request's prompt and generated tokens (for the repetition penalty).
        generator: the request's generator (None when greedy).
        generated: the request's generated tokens (for the presence and frequency penalties).

    Returns:
        the token, its log-probability and the top alternatives (see :class:`Pick`).
    """
    return sample_rows(logits[None], [params], [history], [generator], generated=[generated])[0]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
                generators: Sequence[torch.Generator | None], *, rows: Sequence[int] | None = None,
                generated: Sequence[Sequence[int]] | None = None) -> list[Pick]:
    """Pick the next token of every request, each with its own parameters, history and generator.

    Request i gives what ``sample_next(logits[rows[i]], params[i], histories[i], generators[i],
    generated[i])`` gives; the tokens, log-probabilities and top alternatives of all requests reach the
    host in one read, the step's one wait for the device.

    Args:
        logits: Tensor[m, V] (any float dtype).
        rows: the logits row of each request (default: request i reads row i); several requests may
            read one row (the choices of one prompt sample their first tokens from its last position).
        generated: each request's generated tokens (presence/frequency penalties; default: none).

    Returns:
        one :class:`Pick` per request, in order.
    """
    return sample_rows_reading(logits, params, histories, generators, rows=rows, generated=generated)[0]


def sample_rows_reading(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
                        generators: Sequence[torch.Generator | None], *, rows: Sequence[int] | None = None,
                        generated: Sequence[Sequence[int]] | None = None,
                        also: torch.Tensor | None = None) -> tuple[list[Pick], list[float]]:
    """``sample_rows``, with the values of ``also`` (a 1-D float64 tensor on the logits' device: another
    reader's results, e.g. speculative verification) brought to the host in the same one read.

    Returns:
        (the picks, ``also``'s values as floats; [] without it).
    """
    if rows is None:
        rows = range(len(params))
    width = max((p.top_logprobs for p in params), default=0)
    picks: list[torch.Tensor] = []   # per request: [token, logprob, top ids..., top logprobs...] fp64 on the device
    for i, p in enumerate(params):
        scores = _penalised(logits[rows[i]].float(), p, histories[i], generated[i] if generated is not None else ())
        if p.do_sample:
            if p.temperature != 1.0:
                scores = scores / p.temperature
            token = torch.multinomial(_truncated(scores, p).softmax(-1), 1, generator=generators[i])[0]
        else:
            token = torch.argmax(scores)
        parts = [token.double()[None]]
        if p.logprobs:
            lp = scores.log_softmax(-1)
            parts.append(lp.gather(0, token.view(1)).double())     # (lp[token] reads the index on the host)
            if width:
                top = torch.topk(lp, min(p.top_logprobs, lp.numel()))
                pad = width - top.values.numel()
                parts += [top.indices.double(), scores.new_zeros(pad, dtype=torch.float64),
                          top.values.double(), scores.new_zeros(pad, dtype=torch.float64)]
        picks.append(torch.cat(parts) if len(parts) > 1 else parts[0])   # ids < 2**53, fp32 exact in fp64
    size = 2 + 2 * width
    picks = [torch.nn.functional.pad(x, (0, size - x.numel())) if x.numel() < size else x for x in picks]
    parts = ([torch.stack(picks).flatten()] if picks else []) + ([also] if also is not None else [])
    if not parts:
        return [], []
    flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()   # the step's one read of the device
    values = [flat[i * size:(i + 1) * size] for i in range(len(picks))]
    extra = flat[len(picks) * size:]
    out = []
    for row, p in zip(values, params):
        if not p.logprobs:
            out.append(Pick(int(row[0])))
            continue
        k = p.top_logprobs
        top = tuple((int(t), v) for t, v in zip(row[2:2 + k], row[2 + width:2 + width + k])
                    if v != -math.inf)          # (a grammar's mask leaves fewer than k possible tokens)
        out.append(Pick(int(row[0]), row[1], top))
    return out, extra

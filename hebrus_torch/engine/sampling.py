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

import numpy as np
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
    return _penalise_rows(logits.float().clone()[None], [params], [history], [generated])[0]


def _penalise_rows(scores: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
                   generated: Sequence[Sequence[int]]) -> torch.Tensor:
    """scores: Tensor[n, V] float32, row i request i's logits, changed in place (and returned): logit_bias,
    presence/frequency penalties, repetition penalty, in that order, each for all rows at once (the repetition
    penalty once per distinct value: it divides by it as a scalar, as one row alone would). Each element gets
    the operations, in the order and dtype, that one row alone gives it."""
    device = scores.device
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(i)
            cols.append(token)
            values.append(bias)
    if rows:
        at = torch.tensor([rows, cols], dtype=torch.int64).to(device)
        at = (at[0], at[1])
        scores[at] += torch.tensor(values, dtype=scores.dtype).to(device)
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        if (p.presence_penalty or p.frequency_penalty) and generated[i]:
            counts = collections.Counter(generated[i])
            rows += [i] * len(counts)
            cols += list(counts)
            # presence + frequency * count in float32, as the tensor ops on one row computed it
            n = np.asarray(list(counts.values()), dtype=np.float32)
            values.append(np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * n)
    if rows:
        at = torch.tensor([rows, cols], dtype=torch.int64).to(device)
        at = (at[0], at[1])
        scores[at] -= torch.from_numpy(np.concatenate(values)).to(device=device, dtype=scores.dtype)
    by_penalty: dict[float, tuple[list[int], list[int]]] = {}
    for i, p in enumerate(params):
        if reads_history(p) and histories[i]:
            seen_tokens = sorted(set(histories[i]))
            rows, cols = by_penalty.setdefault(p.repetition_penalty, ([], []))
            rows += [i] * len(seen_tokens)
            cols += seen_tokens
    for penalty, (rows, cols) in by_penalty.items():
        at = torch.tensor([rows, cols], dtype=torch.int64).to(device)
        at = (at[0], at[1])
        seen = scores[at]
        scores[at] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores


def _truncated(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tempered scores: Tensor[..., V] (rows that share ``params``' top-k and top-p) -> Tensor[..., V] with what
    top-k and top-p remove at -inf, row by row."""
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        # transformers' TopPLogitsWarper: drop the low tail whose cumulative probability is <= 1 - top_p,
        # always keeping the most likely token.
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove = cum <= (1 - params.top_p)
        remove[..., -1] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -math.inf)
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
    n = len(params)
    if also is None and n and logits.dtype == torch.float32 and logits.device.type == "cpu" \
            and n * logits.shape[-1] * 4 <= _CPU_BLOCK_BYTES and not any(map(_reads_more_than_argmax, params)):
        # Plain greedy rows of float32 logits on the CPU (a decode step of greedy requests): the general path's one
        # argmax over the same rows, read as ints (no float64 table to build for one read).
        picked = logits if rows is None else _rows_of(logits, list(rows))[0]
        return [Pick(t) for t in torch.argmax(picked, -1).tolist()], []
    width = max((p.top_logprobs for p in params), default=0)
    size = 2 + 2 * width if any(p.logprobs for p in params) else 1   # per request: token[, logprob, tops...]
    table = _picks_table(logits, params, histories, generators, list(range(n) if rows is None else rows),
                         generated if generated is not None else [()] * n, size, width) if n else None
    parts = [t for t in (table, also) if t is not None]
    if not parts:
        return [], []
    flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()   # the step's one read of the device
    values = [flat[i * size:(i + 1) * size] for i in range(n)]
    extra = flat[n * size:]
    picks = []
    for row, p in zip(values, params):
        if not p.logprobs:
            picks.append(Pick(int(row[0])))
            continue
        k = p.top_logprobs
        top = tuple((int(t), v) for t, v in zip(row[2:2 + k], row[2 + width:2 + width + k])
                    if v != -math.inf)          # (a grammar's mask leaves fewer than k possible tokens)
        picks.append(Pick(int(row[0]), row[1], top))
    return picks, extra


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def reads_history(p: SamplingParams) -> bool:
    """Whether sampling with ``p`` reads the request's token history (the repetition penalty does): the caller
    may pass an empty history otherwise (a request's prompt + generated tokens is a list as long as its context,
    built anew at every step)."""
    return p.repetition_penalty != 1.0


def _reads_more_than_argmax(p: SamplingParams) -> bool:
    """Whether sampling with ``p`` is anything but the argmax of the row (sampling, log-probabilities, penalties)."""
    return bool(p.do_sample or p.logprobs or _penalises(p))


def _penalises(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


# On the CPU the plain greedy rows are cast and reduced in blocks of about this many bytes of float32 (temporaries
# the allocator reuses, in cache) and the other rows one at a time (each row's float32 copies as small as one row
# alone makes them: per-op overhead is microseconds there); on a device every row of a group goes at once.
_CPU_BLOCK_BYTES = 2 << 20


def _every_row(rows: Sequence[int], n: int) -> bool:
    """Whether ``rows`` are 0 .. n - 1 in order (a decode step's: the table itself serves)."""
    return len(rows) == n and all(r == i for i, r in enumerate(rows))


def _rows_of(table: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, bool]:
    """(table[rows], whether it is a view of ``table``): ``table`` itself where ``rows`` are all of it in order (no
    slice op), a view where they are consecutive, else a gather (one upload of the indices)."""
    if _every_row(rows, table.shape[0]):
        return table, True
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return table[rows[0]:rows[0] + len(rows)], True
    return table.index_select(0, _upload(rows, table.device)), False


def _picks_table(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
                 generators: Sequence[torch.Generator | None], rows: list[int], generated: Sequence[Sequence[int]],
                 size: int, width: int) -> torch.Tensor:
    """Every request's pick on the device, flat float64 [n * size]: per request its token, then (``size`` > 1)
    its log-probability, ``width`` top ids and ``width`` top log-probabilities (zeros past its own
    ``top_logprobs``). Batched: plain greedy rows (no penalty, no log-probabilities) take one argmax together; the
    others go in groups of
    equal (temperature, top-k, top-p) when sampling, one group when greedy, each row drawing from its own
    generator. On a device the dispatches do not depend on the number of requests (the draws aside); each row's
    values are those it alone would get."""
    n = len(params)
    device = logits.device
    picked = logits if _every_row(rows, logits.shape[0]) else logits.index_select(0, _upload(rows, device))
    on_cpu = device.type == "cpu"
    block = max(1, _CPU_BLOCK_BYTES // (4 * picked.shape[-1])) if on_cpu else n
    out = torch.zeros(n, size, dtype=torch.float64, device=device) if size > 1 else None
    plain: list[int] = []                              # greedy rows without penalties or log-probabilities
    groups: dict[tuple | None, list[int]] = {}         # the others: (temperature, top-k, top-p) if sampled, else None
    for i, p in enumerate(params):
        if _reads_more_than_argmax(p):
            groups.setdefault((p.temperature, p.top_k, p.top_p) if p.do_sample else None, []).append(i)
        else:
            plain.append(i)
    chosen_at: list[int] = []                          # rows, in the order of the tokens in ``chosen``
    chosen: list[torch.Tensor] = []
    if plain:
        chosen += [torch.argmax(_rows_of(picked, plain[b:b + block])[0].float(), -1)
                   for b in range(0, len(plain), block)]
        chosen_at += plain
    for key, members in groups.items():
        step = 1 if on_cpu else len(members)
        for b in range(0, len(members), step):
            part = members[b:b + step]
            view, is_view = _rows_of(picked, part)
            scores = view.float()
            if any(_penalises(params[i]) for i in part):
                shared = scores is view and is_view and picked is logits        # (the caller's logits: not in place)
                scores = _penalise_rows(scores.clone() if shared else scores, [params[i] for i in part],
                                        [histories[i] for i in part], [generated[i] for i in part])
            if key is None:
                tokens_of_part = torch.argmax(scores, -1)
            else:
                if key[0] != 1.0:
                    scores = scores / key[0]
                probs = _truncated(scores, params[part[0]]).softmax(-1)
                draws = [torch.multinomial(probs[j], 1, generator=generators[i]) for j, i in enumerate(part)]
                tokens_of_part = torch.cat(draws) if len(draws) > 1 else draws[0]   # (each its own generator)
            chosen_at += part
            chosen.append(tokens_of_part)
            if out is not None and any(params[i].logprobs for i in part):
                _logprob_columns(out, scores, part, params, tokens_of_part, width)
    tokens = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
    if chosen_at != list(range(n)):                    # into request order
        tokens = torch.empty_like(tokens).index_copy_(0, _upload(chosen_at, device), tokens)
    if out is None:
        return tokens.double()                         # ids < 2**53: exact in fp64
    out[:, 0] = tokens.double()
    return out.flatten()


def _logprob_columns(out: torch.Tensor, scores: torch.Tensor, part: list[int], params: Sequence[SamplingParams],
                     tokens: torch.Tensor, width: int) -> None:
    """Into ``out`` [n, 2 + 2 width], for the rows of ``part`` that ask for log-probabilities: column 1 the chosen
    token's (``tokens`` [p]: the part's tokens), then the top ids and their log-probabilities (one topk per
    distinct ``top_logprobs``). ``scores`` [p, V]: the part's scores after penalties and temperature, before
    top-k / top-p."""
    device = out.device
    asking = [j for j, i in enumerate(part) if params[i].logprobs]
    if len(asking) < len(part):
        local = _upload(asking, device)
        scores, tokens = scores.index_select(0, local), tokens.index_select(0, local)      # [a, V], [a]
    lp = scores.log_softmax(-1)
    where = [part[j] for j in asking]
    at = _upload(where, device)
    out[at, 1] = lp.gather(1, tokens[:, None])[:, 0].double()
    by_k: dict[int, list[int]] = {}
    for a, i in enumerate(where):
        if params[i].top_logprobs:
            by_k.setdefault(params[i].top_logprobs, []).append(a)
    for k, which in by_k.items():
        sub, rows_out = lp, at
        if len(which) < len(where):
            pick = _upload(which, device)
            sub, rows_out = lp.index_select(0, pick), at.index_select(0, pick)
        top = torch.topk(sub, min(k, sub.shape[-1]))
        k = top.values.shape[-1]
        out[rows_out, 2:2 + k] = top.indices.double()
        out[rows_out, 2 + width:2 + width + k] = top.values.double()

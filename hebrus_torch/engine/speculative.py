"""Speculative decoding: drafting, the adaptive draft length, and verification of a packed step's rows.

A speculating request's decode chunk is its last token plus k drafted tokens; the step returns the
logits at all k + 1 positions. Verification keeps the longest accepted prefix of the drafts and one
more token from the target model, so every verification step yields 1 to k + 1 tokens:

- greedy requests accept a draft while it equals the argmax of the (processed) target distribution at
  its position, and then take that argmax: exactly the tokens of decoding without speculation;
- sampled requests use speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft
  ``d`` proposed with probability ``q(d)`` is accepted with probability ``min(1, p(d) / q(d))``; at the
  first rejection the token is drawn from ``max(p - q, 0)`` normalised; after k acceptances from ``p``
  at the last position. Every emitted token is distributed as ``p``, the target's processed
  distribution (logit bias and penalties, temperature, top-k, top-p: ``target_scores``). Prompt lookup
  proposes deterministically (``q`` is one-hot at the draft).

The engine then cuts the step short for the rows that did not keep all their tokens
(``ModelCache.truncate``: every holder exactly as if only the kept tokens had been fed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .sampling import BadRequestError, SamplingParams, _penalised, _penalises, _truncated

__all__ = ["SpeculativeConfig", "SpecState", "NgramIndex", "prompt_lookup", "Verdict", "verification", "verify_rows",
           "target_scores"]

MAX_DRAFT_TOKENS = 32
SPECULATIVE_METHODS = ("ngram", "mtp")
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
"""``SpeculativeConfig.disable_by_batch_size``'s default (measured: benchmarks/RESULTS.md, "MTP speculation made
cheaper")."""
DEFAULT_CONFIDENCE_THRESHOLD = 0.1
"""``SpeculativeConfig.confidence_threshold``'s default (measured: benchmarks/RESULTS.md, "MTP speculation: the block
trained unrolled and the confidence rule, what the sections show"; transformers' ``assistant_confidence_threshold``
is 0.4, which here ended drafts that would have been accepted)."""
DEFAULT_FIRST_TOKEN_THRESHOLD = 0.02
"""``SpeculativeConfig.first_token_threshold``'s default (measured: benchmarks/RESULTS.md, "MTP: unsure first
tokens propose nothing"): on the trained 12-layer benchmark block no round whose first token was accepted had it below
0.02, 9 of its 20 rounds that accepted nothing did, and a random block's first tokens all do."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How one request speculates.

    Attributes:
        num_draft_tokens: the most tokens drafted per verification step (transformers'
            ``prompt_lookup_num_tokens`` / ``num_assistant_tokens``); 0 turns speculation off.
        max_ngram: prompt lookup matches the stream's last n tokens, n from ``max_ngram`` down to
            ``min_ngram`` (transformers' ``max_matching_ngram_size``), at their latest earlier occurrence.
        min_ngram: the shortest suffix matched.
        adaptive: the draft length follows the request's recent acceptance (see ``SpecState``); False
            drafts ``num_draft_tokens`` whenever a draft is found.
        method: who drafts: ``"ngram"`` (prompt lookup over the request's own stream, or the engine's
            ``drafter`` / ``draft_model`` where it has one) or ``"mtp"`` (the checkpoint's own MTP block,
            ``engine/mtp.py``: the engine must be built with ``EngineConfig(speculative=SpeculativeConfig(...,
            method="mtp"))``).
        disable_by_batch_size: the request drafts nothing in a step where more than this many requests are
            decoding (vLLM's ``disable_by_batch_size``); its back-off does not count such steps. None: no limit.
            A verification costs more than the plain decode step it replaces wherever a step's cost grows with
            its tokens, and a large batch's step is bound by its arithmetic rather than by reading the weights:
            there a verification is never paid back (benchmarks/RESULTS.md, "MTP speculation made cheaper").
        confidence_threshold: ``method="mtp"`` only: a request's draft ends at the first position where the
            MTP block's distribution (processed as the request's sampling processes the target's:
            ``target_scores``; for a sampled request the one its draft is drawn from) has its largest
            probability below this: that position's token is still proposed (and verified), the later ones
            are not drafted, so they cost neither a drafting pass nor a verification row, and a drafting round
            stops when every request in it has ended (transformers' ``assistant_confidence_threshold``; its
            default, 0.4, measured worse here than 0.1). Whether to go on is decided from the block's own distribution and the tokens drafted
            before, never from the target: greedy tokens stay those of plain decoding and sampled ones keep
            the target's distribution (each drafted token is still drawn from the q the verifier is given).
            In [0, 1); 0 turns the rule off. (Dropping the unsure position too, and counting a first
            position dropped as a miss for the back-off, measured worse: benchmarks/RESULTS.md.)
        first_token_threshold: ``method="mtp"`` only: a drafting round proposes nothing for a request whose
            first drafted token has its largest probability (as for ``confidence_threshold``) below this: an
            *unsure round*, no verification row, a miss for the back-off (``SpecState``). Unlike
            ``confidence_threshold``'s later positions, a first token that unsure is almost never accepted (RESULTS,
            "MTP: unsure first tokens propose nothing"): proposing it pays a verification for nothing. Decided from the
            block's own distribution, so exactness is untouched. In [0, 1); 0 turns it off.
    """

    num_draft_tokens: int = 0
    max_ngram: int = 3
    min_ngram: int = 1
    adaptive: bool = True
    method: str = "ngram"
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD
    first_token_threshold: float = DEFAULT_FIRST_TOKEN_THRESHOLD

    def __post_init__(self) -> None:
        def bad_int(v, lo, hi):
            return isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi

        if bad_int(self.num_draft_tokens, 0, MAX_DRAFT_TOKENS):
            raise BadRequestError(f"SpeculativeConfig: num_draft_tokens must be an int in [0, {MAX_DRAFT_TOKENS}], "
                                  f"got {self.num_draft_tokens!r}")
        if bad_int(self.min_ngram, 1, 64) or bad_int(self.max_ngram, self.min_ngram if isinstance(self.min_ngram, int)
                                                     else 1, 64):
            raise BadRequestError(f"SpeculativeConfig: need 1 <= min_ngram <= max_ngram <= 64, got "
                                  f"{self.min_ngram!r}, {self.max_ngram!r}")
        if not isinstance(self.adaptive, bool):
            raise BadRequestError(f"SpeculativeConfig: adaptive must be a bool, got {self.adaptive!r}")
        if self.disable_by_batch_size is not None and bad_int(self.disable_by_batch_size, 1, 1 << 30):
            raise BadRequestError(f"SpeculativeConfig: disable_by_batch_size must be None or an int >= 1, got "
                                  f"{self.disable_by_batch_size!r}")
        for name in ("confidence_threshold", "first_token_threshold"):
            c = getattr(self, name)
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < 1.0:   # (NaN fails too)
                raise BadRequestError(f"SpeculativeConfig: {name} must be a number in [0, 1), got {c!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise BadRequestError(f"SpeculativeConfig: method must be one of {SPECULATIVE_METHODS}, got "
                                  f"{self.method!r}")

    @property
    def enabled(self) -> bool:
        return self.num_draft_tokens > 0

    @property
    def drafts_with_mtp(self) -> bool:
        """Whether the request drafts with the checkpoint's MTP block (enabled, ``method="mtp"``)."""
        return self.enabled and self.method == "mtp"


@dataclass
class SpecState:
    """A request's speculation bookkeeping and counters.

    The adaptive draft length: a request's first draft has ``min(K, 2)`` tokens; after a verification
    that accepted a of k drafts, the next has ``min(K, 2 k)`` when all were accepted, else
    ``max(1, a + 1)``; after n verifications in a row that accepted nothing, the request drafts nothing
    for ``4**n - 1`` decode steps (at most 63): a request whose drafts are never accepted verifies at its
    decode steps 0, 4, 20, 84, 148, ... (3 times in its first 64 tokens, then once in 64), 2 drafts the
    first time and 1 after. (A verification whose drafts are all rejected costs more than the plain
    decode step it replaces wherever a step's cost grows with its tokens, as on a CPU: back-off by 4
    rather than 2 halves what such a request pays in its first 64 tokens; measured in RESULTS.)
    An unsure MTP round (``SpeculativeConfig.first_token_threshold``: nothing proposed) counts as a miss: it
    almost always is one (RESULTS, "MTP: unsure first tokens propose nothing"), and it costs its drafting pass but no
    verification.

    A paused MTP request *rides* (``riding``): in a step where other MTP requests draft, it joins their round
    (``ride_length``): a row more in passes that run anyway, and its verification rows, cost a small part of what a
    pass or a verification of its own would (RESULTS, "MTP at 8 requests: paused requests ride, rounds end with
    their majority"). A ride that accepts something ends the pause (the request drafts again as after any accepted
    draft); one that accepts nothing, or is unsure, counts for nothing: the pause goes on counting down.
    """

    length: int = 0                 # tokens to draft next time (0: not yet set)
    misses: int = 0                 # verifications in a row that accepted nothing
    pause: int = 0                  # decode steps left without drafting
    lookup: NgramIndex | None = None                     # prompt lookup over the request's stream
    error: str | None = None        # why the drafter failed for this request (it then speculates no more)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    confidence_stops: int = 0       # MTP drafts ended before their length by ``SpeculativeConfig.confidence_threshold``
    unsure_rounds: int = 0          # MTP rounds that proposed nothing (``SpeculativeConfig.first_token_threshold``)
    rides: int = 0                  # MTP rounds joined while paused
    riding: bool = False            # this step's draft is a ride (set by the step's drafting)

    def next_length(self, config: SpeculativeConfig) -> int:
        if not config.adaptive:
            return config.num_draft_tokens
        if self.length == 0:
            self.length = min(config.num_draft_tokens, 2)
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.length

    def update(self, config: SpeculativeConfig, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_steps += 1
        riding, self.riding = self.riding, False
        if not config.adaptive:
            return
        if riding:
            if accepted == 0:
                self.length = 1
                return                  # a missed ride: the pause goes on
            self.pause = 0
        if accepted == drafted:
            self.length = min(config.num_draft_tokens, 2 * drafted)
        else:
            self.length = max(1, accepted + 1)
        if accepted == 0:
            self._missed()
        else:
            self.misses = 0

    def unsure_round(self, config: SpeculativeConfig) -> None:
        """An MTP round proposed nothing for this request (its first token below ``first_token_threshold``): a
        miss for the back-off, with no verification."""
        self.unsure_rounds += 1
        riding, self.riding = self.riding, False
        if config.adaptive and not riding:
            self._missed()

    def ride_length(self, config: SpeculativeConfig) -> int:
        """Tokens to draft when joining another request's MTP round during a pause (asked where ``next_length``
        gave 0; 0 if not adaptive): the adaptive length, and at least a first draft's (``min(K, 2)``; a pause
        follows a miss, after which the length is 1 or 2, and a ride of 1 would only ever win one token)."""
        if not config.adaptive or self.length == 0:
            return 0
        return max(self.length, min(config.num_draft_tokens, 2))

    def _missed(self) -> None:
        self.misses += 1
        self.pause = 4 ** min(self.misses, 3) - 1


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the stream's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``; the first n that occurs wins); [] when none occurs. (What
    :class:`NgramIndex` gives incrementally; this is its plain definition.)

    transformers' ``PromptLookupCandidateGenerator`` takes the earliest occurrence instead; the latest one
    follows the text the model is copying now when a passage occurs more than once."""
    n_tok = len(tokens)
    if k <= 0 or n_tok < 2:
        return []
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tok - n:])
        for i in range(n_tok - n - 1, -1, -1):
            if list(tokens[i:i + n]) == suffix:
                return list(tokens[i + n:i + n + k])
    return []


class NgramIndex:
    """Prompt lookup over a growing token stream in time proportional to the tokens added: for each n in
    [min_ngram, max_ngram], the n-gram ending at each position e (exclusive) maps to the latest such e
    with a token after it. ``propose(tokens, k)`` equals ``prompt_lookup(tokens, k, ...)`` for any stream
    that only grows (tested)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0            # n-grams ending before this position are in the index
        self._tokens: list[int] = []

    def _extend(self, tokens: Sequence[int]) -> None:
        if len(tokens) < len(self._tokens) or list(tokens[:len(self._tokens)]) != self._tokens:
            self._latest, self._indexed, self._tokens = {}, 0, []      # not an extension: start over
        self._tokens.extend(tokens[len(self._tokens):])
        toks = self._tokens
        for e in range(max(self._indexed, 1), len(toks)):    # n-grams ending at e with a token at e
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                self._latest[tuple(toks[e - n:e])] = e
        self._indexed = max(self._indexed, len(toks))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        self._extend(tokens)
        toks, n_tok = self._tokens, len(self._tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            e = self._latest.get(tuple(toks[n_tok - n:]))
            if e is not None:
                return toks[e:e + k]
        return []


@dataclass
class Verdict:
    """One row's verification: the first ``accepted`` drafts are kept, then ``token``.

    Attributes:
        accepted: drafts kept (0..k).
        token: the token after them (the target's correction, or its next token after all k).
        logprobs: per emitted token (accepted drafts then ``token``), the log-probability under the processed
            distribution, when the request asked for them; else None.
        tops: per emitted token, the ``top_logprobs`` most likely ``(token, log-probability)`` pairs at its
            position, most likely first (``sampling.Pick.top``), when the request asked for them; else None.
    """

    accepted: int
    token: int
    logprobs: list[float] | None = None
    tops: list[tuple[tuple[int, float], ...]] | None = None

    def emitted(self, drafts: Sequence[int]) -> list[int]:
        return list(drafts[:self.accepted]) + [self.token]


def target_scores(logits: torch.Tensor, params: SamplingParams, history: Sequence[int],
                  generated: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``sample_rows`` does to one row of logits: Tensor[V] -> (the scores greedy takes the argmax of and
    log-probabilities are read from: bias and penalties, divided by the temperature when sampling; the
    scores sampling draws from: those with top-k / top-p applied)."""
    scores = _penalised(logits.float(), params, history, generated)
    if not params.do_sample:
        return scores, scores
    if params.temperature != 1.0:
        scores = scores / params.temperature
    return scores, _truncated(scores, params)


def verification(logits: torch.Tensor, offsets: Sequence[int], drafts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
                 generated: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None],
                 draft_probs: Sequence[torch.Tensor | None] | None = None
                 ) -> tuple[torch.Tensor | None, Callable[[list[float]], list[Verdict]]]:
    """Verify every speculating row of a step, on the device: (a float64 tensor of the results, and the function
    that turns its values, read on the host, into one Verdict per row). ``verify_rows`` does both; the engine
    reads the tensor with the step's sampled tokens (``sampling.sample_rows_reading``): one read per step.

    Args:
        logits: Tensor[N, V], the step's logits rows; row r's k_r + 1 positions start at ``offsets[r]``
            (position j predicts the token after the last token and drafts[:j]).
        drafts: per row, its k_r drafted tokens.
        params, histories, generated, generators: per row, the request's sampling parameters, its tokens
            (prompt and generated, the step's first token included) and its generated tokens (the
            penalties' histories), its generator.
        draft_probs: per row, Tensor[k_r, V] the draft distributions q (a draft model), or None for
            deterministic drafts (prompt lookup: q one-hot).
    """
    packed: list[torch.Tensor] = []
    vocab = logits.shape[-1]
    # Greedy rows without logit processors or top log-probabilities verify together: their scores are their
    # logits as they are (target_scores changes nothing there), so one argmax / log_softmax over all their
    # positions gives each position what its own row's would (the rows of a reduction are independent).
    together = [r for r, p in enumerate(params)
                if not p.do_sample and not _penalises(p) and not (p.logprobs and p.top_logprobs)]
    if len(together) < 2:
        together = []
    block_at: dict[int, int] = {}          # row -> its first position in the block
    index: list[int] = []                  # the block's positions (rows of logits)
    if together:
        dvec = []
        for r in together:
            block_at[r] = len(index)
            k = len(drafts[r])
            index.extend(range(offsets[r], offsets[r] + k + 1))
            dvec.extend(list(drafts[r]) + [0])
        dev = logits.device
        rows = logits.index_select(0, torch.tensor(index, dtype=torch.int64).to(dev)).float()
        d_all = torch.tensor(dvec, dtype=torch.int64).to(dev)
        picks = rows.argmax(-1)
        logp = rows.log_softmax(-1)
        packed.append(torch.stack([picks.double(), (picks == d_all).double(),
                                   logp.gather(1, picks[:, None])[:, 0].double(),
                                   logp.gather(1, d_all[:, None])[:, 0].double()]).flatten())
    size = len(index)
    for r, (off, d, p) in enumerate(zip(offsets, drafts, params)):
        if r in block_at:
            continue
        k = len(d)
        dev = logits.device
        d_t = torch.tensor(list(d), dtype=torch.int64).to(dev) if k else torch.zeros(0, dtype=torch.int64, device=dev)
        both = [target_scores(logits[off + j], p, list(histories[r]) + list(d[:j]), list(generated[r]) + list(d[:j]))
                for j in range(k + 1)]
        scores = torch.stack([b[0] for b in both])                                     # [k+1, V]
        logp = scores.log_softmax(-1)
        if not p.do_sample:
            picks = scores.argmax(-1)                                                   # [k+1]
            accept = (picks[:k] == d_t).double() if k else torch.zeros(0, dtype=torch.float64, device=dev)
            cand = picks
        else:
            gen = generators[r]
            probs = torch.stack([b[1] for b in both]).softmax(-1)
            q = draft_probs[r] if draft_probs is not None and draft_probs[r] is not None else None
            if k:
                p_d = probs[:k].gather(1, d_t[:, None])[:, 0]
                q_full = (torch.zeros_like(probs[:k]).scatter_(1, d_t[:, None], 1.0) if q is None
                          else q.float())
                q_d = q_full.gather(1, d_t[:, None])[:, 0]
                u = torch.rand(k, generator=gen, device=dev, dtype=torch.float32)
                accept = (u * q_d < p_d).double()        # u < p/q without dividing (q_d > 0 for a proposed d)
                residual = (probs[:k] - q_full).clamp_min(0)
                total = residual.sum(-1, keepdim=True)
                residual = torch.where(total > 0, residual, probs[:k])   # p == q: never rejected, any row works
                fixes = torch.multinomial(residual, 1, generator=gen)[:, 0]
            else:
                accept = torch.zeros(0, dtype=torch.float64, device=dev)
                fixes = torch.zeros(0, dtype=torch.int64, device=dev)
            last = torch.multinomial(probs[k], 1, generator=gen)
            cand = torch.cat((fixes, last))
        lp_cand = logp.gather(1, cand[:, None])[:, 0]
        lp_draft = logp[:k].gather(1, d_t[:, None])[:, 0] if k else lp_cand[:0]
        parts = [cand.double(), accept, lp_cand.double(), lp_draft.double()]
        if p.logprobs and p.top_logprobs:      # every position's alternatives ([k+1, t] ids, then log-probabilities)
            top = logp.topk(min(p.top_logprobs, vocab), dim=-1)
            parts += [top.indices.double().flatten(), top.values.double().flatten()]
        packed.append(torch.cat(parts))

    def finish(values: list[float]) -> list[Verdict]:
        out: list[Verdict] = []
        at = 4 * size                       # (the block of the rows verified together comes first)
        for r, (d, p) in enumerate(zip(drafts, params)):
            k = len(d)
            if r in block_at:               # the block: [picks, accepts, their log-probs, the drafts'] of `size` each
                s0 = block_at[r]
                cand = values[s0:s0 + k + 1]
                accept = values[size + s0:size + s0 + k]
                lp_cand = values[2 * size + s0:2 * size + s0 + k + 1]
                lp_draft = values[3 * size + s0:3 * size + s0 + k]
            else:
                cand = values[at:at + k + 1]
                accept = values[at + k + 1:at + 2 * k + 1]
                lp_cand = values[at + 2 * k + 1:at + 3 * k + 2]
                lp_draft = values[at + 3 * k + 2:at + 4 * k + 2]
                at += 4 * k + 2
            m = next((j for j in range(k) if accept[j] < 0.5), k)
            lps = (lp_draft[:m] + [lp_cand[m]]) if p.logprobs else None
            tops = None
            if p.logprobs and p.top_logprobs:
                t = min(p.top_logprobs, vocab)
                ids, lp_top = values[at:at + (k + 1) * t], values[at + (k + 1) * t:at + 2 * (k + 1) * t]
                at += 2 * (k + 1) * t
                tops = [tuple((int(i), v) for i, v in zip(ids[j * t:(j + 1) * t], lp_top[j * t:(j + 1) * t])
                              if v != -math.inf) for j in range(m + 1)]     # (-inf: masked by a grammar)
            out.append(Verdict(m, int(cand[m]), lps, tops))
        return out

    return (torch.cat(packed) if packed else None), finish


def verify_rows(logits: torch.Tensor, offsets: Sequence[int], drafts: Sequence[Sequence[int]],
                params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
                generators: Sequence[torch.Generator | None],
                draft_probs: Sequence[torch.Tensor | None] | None = None,
                generated: Sequence[Sequence[int]] | None = None) -> list[Verdict]:
    """``verification`` and its one read: one Verdict per row (``generated`` defaults to none)."""
    generated = generated if generated is not None else [()] * len(drafts)
    values, finish = verification(logits, offsets, drafts, params, histories, generated, generators, draft_probs)
    return finish(values.tolist() if values is not None else [])

"""A draft model for speculative decoding: a smaller Qwen4Exp run by the engine's own runner over its own cache.

``DraftModelDrafter(draft)`` is an engine ``drafter`` (``Engine(model, drafter=...)``, or transformers'
``assistant_model`` through the manager). Each request that speculates gets a sequence of the draft's
``ModelCache``; every round, for all such requests at once, one packed step brings each draft sequence
up to the request's stream (the tokens the target accepted since) and k - 1 more steps feed the drafts
one token per request. Greedy requests draft the draft model's argmax; sampled ones sample from the
draft's distribution processed with the request's own parameters (``speculative.target_scores``), which
``draft_probs`` gives the verification (speculative rejection sampling needs q).

What the target rejected is dropped from the draft's cache by ``ModelCache.rewind`` to the last accepted
position: the draft cache keeps a snapshot at the start of every step (``keep_snapshots``), so every
position a round can fall back to has one. Each drafted token costs one host read (the next step feeds
it); the draft model's numbers never change the target's tokens, only how many are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import HebrusError
from ..model_cache import ModelCache
from ..state.handles import SeqHandle
from .requests import Request
from .runner import ModelRunner, find_text_model
from .speculative import MAX_DRAFT_TOKENS, target_scores

__all__ = ["DraftModelDrafter", "CausalLMDrafter", "drafter_for"]


def drafter_for(model: torch.nn.Module, *, vocab_size: int, capacity_tokens: int, max_sequences: int):
    """The drafter of a draft model: ``DraftModelDrafter`` for a Qwen4Exp (batched, the engine's own
    cache), ``CausalLMDrafter`` for any other transformers causal LM with the same tokenizer."""
    try:
        qwen4exp = str(getattr(find_text_model(model).config, "model_type", "")).startswith("qwen4_exp")
    except HebrusError:
        qwen4exp = False
    if not qwen4exp:
        return CausalLMDrafter(model, vocab_size=vocab_size)
    return DraftModelDrafter(model, vocab_size=vocab_size, capacity_tokens=capacity_tokens,
                             max_sequences=max_sequences)


@dataclass
class _Draft:
    seq: SeqHandle | None
    tokens: list[int] = field(default_factory=list)      # what the draft cache holds, in order
    generator: torch.Generator | None = None
    probs: torch.Tensor | None = None                    # [k, V] q of the last round's drafts (sampled requests)


def _draft_generator(request: Request, device: torch.device) -> torch.Generator | None:
    """A sampled request's draft generator: seeded from its seed + 1 (reproducible), else at random."""
    if not request.sampling.do_sample:
        return None
    gen = torch.Generator(device=device)
    seed = request.sampling.seed
    gen.manual_seed(seed + 1 if seed is not None else torch.seed())
    return gen


def _held_prefix(held: Sequence[int], tokens: Sequence[int]) -> int:
    """How much of what a draft cache holds is still the request's stream (never its last token, which the
    next round feeds)."""
    common, limit = 0, min(len(held), len(tokens) - 1)
    while common < limit and held[common] == tokens[common]:
        common += 1
    return common


class DraftModelDrafter:
    """Drafts tokens for the engine's speculating requests with a small Qwen4Exp model.

    Args:
        model: the draft model (a transformers Qwen4Exp causal LM with the target's tokenizer: its vocabulary
            must cover the target's; ids past the target's are never drafted).
        vocab_size: the target's vocabulary size.
        capacity_tokens, max_sequences: the draft cache's size (the engine's are a good choice).
    """

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, capacity_tokens: int = 16384,
                 max_sequences: int = 32):
        self.model = model.eval()
        text = find_text_model(model)
        if int(text.config.vocab_size) < vocab_size:
            raise HebrusError(f"DraftModelDrafter: the draft model's vocabulary ({text.config.vocab_size}) does not "
                              f"cover the target's ({vocab_size}); it must use the same tokenizer")
        self.vocab_size = vocab_size
        self.cache = ModelCache.from_transformers(model, capacity_tokens=capacity_tokens, max_sequences=max_sequences,
                                                  with_kv=True, keep_snapshots=MAX_DRAFT_TOKENS + 1)
        self.runner = ModelRunner(model, self.cache)
        self._drafts: dict[Request, _Draft] = {}            # request -> its draft sequence (the dict holds the
        # request itself: a key no other request can take, as an id() of a collected one could)
        self.steps = 0                                       # draft-model steps run

    # ------------------------------------------------------------------ the engine's drafter interface
    def __call__(self, request: Request, k: int) -> list[int]:
        return self.propose_batch([request], [k])[0]

    def propose_batch(self, requests: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        """Up to ``lengths[i]`` drafted tokens to follow each request's stream (``request.tokens``)."""
        live = [(r, k) for r, k in zip(requests, lengths) if k > 0]
        out: dict[Request, list[int]] = {r: [] for r in requests}
        if not live:
            return [out[r] for r in requests]
        rows = [self._catch_up(r) for r, _ in live]
        drafts = [self._draft_of(r) for r, _ in live]
        probs: list[list[torch.Tensor]] = [[] for _ in live]
        for j in range(max(k for _, k in live)):
            active = [i for i, (_, k) in enumerate(live) if k > j]
            feed = [rows[i] if j == 0 else [out[live[i][0]][-1]] for i in active]
            try:
                logits = self.runner.execute([drafts[i].seq for i in active], feed, [True] * len(active),
                                             [len(drafts[i].tokens) for i in active])
            except Exception:  # noqa: BLE001 - a draft that cannot run (cache full, ...) only drafts less
                break
            self.steps += 1
            picks = []
            for row, i in enumerate(active):
                drafts[i].tokens.extend(feed[row])
                req = live[i][0]
                drafted = out[req]
                scores, sampled = target_scores(logits[row, :self.vocab_size], req.sampling, req.tokens + drafted,
                                                req.generated + drafted)
                if req.sampling.do_sample:
                    q = sampled.softmax(-1)
                    probs[i].append(q)
                    picks.append(torch.multinomial(q, 1, generator=drafts[i].generator)[0])
                else:
                    picks.append(scores.argmax())
            for i, t in zip(active, torch.stack(picks).tolist()):      # the next step feeds them: one read
                out[live[i][0]].append(int(t))
        for i, (req, _) in enumerate(live):
            drafts[i].probs = torch.stack(probs[i]) if probs[i] else None
        return [out[r] for r in requests]

    def draft_probs(self, request: Request, n: int) -> torch.Tensor | None:
        """Tensor[n, V] float32: the distributions the last ``n`` drafted tokens of ``request`` were sampled
        from (None for a greedy request)."""
        d = self._drafts.get(request)
        if d is None or d.probs is None:
            return None
        return d.probs[:n]

    def release(self, request: Request) -> None:
        """Free the request's draft sequence (it finished, failed, was cancelled or preempted)."""
        d = self._drafts.pop(request, None)
        if d is not None:
            self.cache.free(d.seq)

    # ------------------------------------------------------------------ internals
    def _draft_of(self, request: Request) -> _Draft:
        d = self._drafts.get(request)
        if d is None:
            d = self._drafts[request] = _Draft(self.cache.new_sequence(), [],
                                                   _draft_generator(request, self.runner.device))
        return d

    def _catch_up(self, request: Request) -> list[int]:
        """Drop what the draft cache holds past its common prefix with the request's stream (rewinding to a
        snapshot; a fresh sequence if there is none) and return the tokens it still has to be fed."""
        tokens = request.tokens
        d = self._draft_of(request)
        common = _held_prefix(d.tokens, tokens)
        if common < len(d.tokens):
            try:
                self.cache.rewind(d.seq, common)
            except HebrusError:
                self.cache.free(d.seq)
                del self._drafts[request]
                d = self._draft_of(request)
                common = 0
            d.tokens = d.tokens[:common]
        return tokens[common:]


class CausalLMDrafter:
    """Drafts with any transformers causal LM of the target's tokenizer (a Llama, a Qwen, ...): one
    ``DynamicCache`` per request, cropped to the stream's accepted part before each round, one forward
    per drafted token and request (not batched across requests: the generic path; a Qwen4Exp draft
    model gets ``DraftModelDrafter``). Greedy requests draft its argmax; sampled ones sample from its
    distribution processed with their own parameters (``draft_probs`` gives it to verification).

    Args:
        model: the draft model (its vocabulary must cover the target's).
        vocab_size: the target's vocabulary size.
    """

    def __init__(self, model: torch.nn.Module, *, vocab_size: int):
        from transformers import DynamicCache

        self.model = model.eval()
        have = getattr(getattr(model, "config", None), "vocab_size", None)
        if have is None or int(have) < vocab_size:
            raise HebrusError(f"CausalLMDrafter: the draft model's vocabulary ({have}) does not cover the target's "
                              f"({vocab_size}); it must use the same tokenizer")
        self.vocab_size = vocab_size
        self._new_cache = lambda: DynamicCache(config=model.config)
        self._drafts: dict[Request, _Draft] = {}        # by the request itself (see DraftModelDrafter)
        self._caches: dict[Request, object] = {}
        self.steps = 0

    def __call__(self, request: Request, k: int) -> list[int]:
        return self.propose_batch([request], [k])[0]

    @torch.no_grad()
    def propose_batch(self, requests: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        out = []
        for req, k in zip(requests, lengths):
            out.append(self._propose(req, k) if k > 0 else [])
        return out

    def _propose(self, req: Request, k: int) -> list[int]:
        key = req
        d, cache = self._drafts.get(key), self._caches.get(key)
        if d is None:
            d, cache = _Draft(None, [], _draft_generator(req, self.model.device)), self._new_cache()
            self._drafts[key], self._caches[key] = d, cache
        tokens = req.tokens
        common = _held_prefix(d.tokens, tokens)
        if common < len(d.tokens):
            if getattr(cache, "is_croppable", True):
                cache.crop(common - len(d.tokens))     # (transformers 5: a negative count of tokens to drop)
            else:                       # (a recurrent draft model's cache cannot be cut: start it over)
                cache = self._caches[key] = self._new_cache()
                common = 0
            d.tokens = d.tokens[:common]
        feed = tokens[common:]
        drafted: list[int] = []
        probs = []
        for _ in range(k):
            ids = torch.tensor([feed], dtype=torch.int64, device=self.model.device)
            logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            self.steps += 1
            d.tokens.extend(feed)
            scores, sampled = target_scores(logits[:self.vocab_size], req.sampling, tokens + drafted,
                                            req.generated + drafted)
            if req.sampling.do_sample:
                q = sampled.softmax(-1)
                probs.append(q)
                token = int(torch.multinomial(q, 1, generator=d.generator)[0])
            else:
                token = int(scores.argmax())
            drafted.append(token)
            feed = [token]
        d.probs = torch.stack(probs) if probs else None
        return drafted

    def draft_probs(self, request: Request, n: int) -> torch.Tensor | None:
        d = self._drafts.get(request)
        return None if d is None or d.probs is None else d.probs[:n]

    def release(self, request: Request) -> None:
        self._drafts.pop(request, None)
        self._caches.pop(request, None)

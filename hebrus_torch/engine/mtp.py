"""Speculation from the checkpoint's own MTP block (``SpeculativeConfig(method="mtp")``).

The block (:mod:`hebrus_torch.models.qwen4_exp.mtp`) keeps its attention state as **one more indexed-attention
layer** of the engine's ``ModelCache`` (decoder layer ``num_hidden_layers`` of its QSA cache, beside the trunk's):
so every lifecycle operation of a sequence (truncation after verification, rewind, fork, free, save/restore)
covers it with the rest, exactly.

Alignment. The block's entry at position ``p`` is built from the trunk's pre-mixer streams at ``p - 1`` and the
token at ``p`` (peers store the same pair at ``p - 1``: rotary attention depends on position differences only,
so the attention is the same; the entry at a sequence's first position has no stream before it and is built
from zero streams). Every trunk step writes the block's entries at the step's own positions, inside its
transaction (``mtp_write``: the block's K/V and indexer keys only), from the streams the same step computed
and, for each row's first position, the streams its sequence's previous step left (kept here per sequence,
for the last positions of each step's rows and at every ``block_size`` boundary, so that a prefix forked at a
block boundary finds them; a state restored from a prompt-cache file has none: zero streams, which changes
drafts, never tokens). Except (``MTPDrafter.defer_writes``) the decode rows of requests that speculate and drafted
nothing in the step: their entries wait (the streams before and the token kept per position; zeros in the cache)
and are written in one packed write (``catch_up``) before the request drafts again, before its state is saved
(``save`` / ``save_unpacked``, or the cache's ``state_dict``), or every ``MAX_PENDING`` positions; a fork copies
them. Once caught up the cache is what writing them in every step leaves.

Drafting (``propose_batch``, before the step is planned; one packed MTP pass per draft position for all
speculating requests): at a request's frontier ``P`` (its last token ``t`` not yet fed) the block is fed
(streams at ``P - 1``, ``t``) at position ``P``; its output streams go through its mixer and the trunk's
``lm_head`` to draft ``d1``; then (its own output streams, ``d1``) at ``P + 1``, and so on. These passes run in a
``ModelCache`` transaction that is always rolled back: drafting leaves the cache bitwise as it was. A request's
draft ends after the first position whose distribution's largest probability is below its
``SpeculativeConfig.confidence_threshold`` (that token still proposed); the round stops once every request's has.

QSA selection inside the block: every draft position runs the block's own indexer over its layer's pooled keys
and selects for itself (the same selection rule as the trunk's layers and transformers' module, position by
position); vLLM instead reuses the first draft step's selection for the later steps. Tested against
:func:`~hebrus_torch.models.qwen4_exp.mtp.reference_mtp`.

Greedy requests draft the argmax of the block's processed distribution (``speculative.target_scores``);
sampled ones sample from it (their own generator, seeded from the request's seed + 2) and give it to the
verifier (``draft_probs``): rejection sampling keeps every emitted token distributed as the target's.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..errors import HebrusError
from ..hc.premix import hyper_premix
from ..model_cache import Batch, ChunkStep, ModelCache
from ..models.qwen4_exp import find_text_model
from ..models.qwen4_exp.mtp import Qwen4ExpMTP, mtp_logits, mtp_write, packed_mtp
from ..qsa.cache import QSACache
from ..state.handles import SeqHandle
from .requests import Request
from .runner import ModelRunner
from .speculative import MAX_DRAFT_TOKENS, target_scores

__all__ = ["MTPDrafter", "mtp_module", "mtp_model_cache"]


def mtp_module(model: torch.nn.Module) -> Qwen4ExpMTP:
    """The model's MTP block: ``model.mtp`` when set, else loaded now from the checkpoint ``from_pretrained`` read
    (``hebrus_torch.loading.mtp.load_mtp``; set on the model then).

    Raises:
        HebrusError: the model has no MTP block (a checkpoint without ``mtp.*``, or an incomplete one).
    """
    mtp = getattr(model, "mtp", None)
    if isinstance(mtp, Qwen4ExpMTP):
        return mtp
    from ..loading.mtp import load_mtp

    mtp = load_mtp(model)
    if mtp is None:
        raise HebrusError("engine: speculative method 'mtp' needs the checkpoint's MTP block, and this model has "
                          "none (no mtp.* weights in its checkpoint, and no model.mtp)")
    model.mtp = mtp
    return mtp


def mtp_model_cache(model: torch.nn.Module, mtp: Qwen4ExpMTP, *, capacity_tokens: int, max_sequences: int,
                    keep_snapshots: int = 0) -> ModelCache:
    """What ``ModelCache.from_transformers(model, with_kv=True)`` builds, its QSA cache holding one more layer:
    the MTP block's (decoder layer ``mtp.layer_idx``; its indexer's ``k_layernorm``). Each holder is allocated
    once (a QSA cache of one cell gives the trunk's layers' settings)."""
    from ..gdn.state import GDNState
    from ..ple.state import PLEState

    config = find_text_model(model).config
    q = QSACache.from_transformers(model, capacity_tokens=1, max_sequences=1, with_kv=True)
    norms = list(q.norm_weight.cpu()) + [mtp.block.self_attn.indexer.k_layernorm.weight.detach().float().cpu()]
    qsa = QSACache(capacity_tokens, num_layers=q.num_layers + 1, head_dim=q.head_dim, norm_weight=norms, eps=q.eps,
                   inv_freq=q.inv_freq, compress_ratio=q.compress_ratio, max_sequences=max_sequences,
                   dtype=q.dtype, device=q.device, kv_heads=q.kv_heads, kv_head_dim=q.kv_head_dim,
                   v_head_dim=q.v_head_dim)
    qsa.layer_ids = list(q.layer_ids) + [mtp.layer_idx]
    qsa.top_k = q.top_k
    ple = PLEState.from_transformers(model, max_sequences=max_sequences) if config.ple_layer_ids else None
    gdn = (GDNState.from_transformers(model, max_sequences=max_sequences)
           if "linear_attention" in config.layer_types else None)
    return ModelCache(qsa=qsa, ple=ple, gdn=gdn, top_k=q.top_k, keep_snapshots=keep_snapshots)


MAX_PENDING = 64
"""Block entries deferred per sequence before they are written (a back-off pauses a request for at most 63 decode
steps; one that never drafts again writes them every ``MAX_PENDING`` steps, in one packed write)."""


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """Row indices as an int64 Tensor on ``like``'s device."""
    return torch.tensor(rows, dtype=torch.int64, device=like.device)


def _place_known(previous: torch.Tensor, at: Sequence[int], streams: Sequence[torch.Tensor | None]) -> None:
    """previous[at[i]] = streams[i] for each stream that is known (not None), in one copy: the rows of the other
    entries keep their zeros (an entry at a sequence's first position has no stream before it)."""
    known = [i for i, s in enumerate(streams) if s is not None]
    if known:
        previous.index_copy_(0, _index([at[i] for i in known], previous), torch.stack([streams[i] for i in known]))


class _Discard(Exception):
    """Raised at the end of drafting: the drafting transaction publishes nothing."""


class MTPDrafter:
    """Drafts with the MTP block for the engine's requests that speculate with ``method="mtp"``; also the
    engine runner's ``mtp`` hook (its trunk steps write the block's attention state).

    Args:
        model: the trunk (a transformers Qwen4Exp causal LM).
        mtp: its MTP block.
        runner: the engine's runner, over a cache from :func:`mtp_model_cache`.
        vocab_size: the target's vocabulary size.
        block_size: the prefix-sharing block (streams are kept at its boundaries).
    """

    min_pass_share: float = 0.75
    """A drafting round's next pass runs only while the requests still drafting are at least this share of those
    the round started with; the drafts of the others end where the round does. A pass costs about the same for one
    row as for eight (a layer's fixed cost per call), so the last passes of a round, for the one or two longest
    drafts, cost the whole batch a pass for a token or less each (benchmarks/RESULTS.md, "MTP at 8 requests: paused
    requests ride, rounds end with their majority"). A request drafting alone is never cut. 0 turns it off."""

    defer_writes: bool = True
    """Defer the block's K/V write of the decode rows of requests that drafted nothing in the step (backed off)
    until they draft again (:meth:`catch_up`); False: every trunk step writes every row's entries."""

    def __init__(self, model: torch.nn.Module, mtp: Qwen4ExpMTP, runner: ModelRunner, *, vocab_size: int,
                 block_size: int = 64):
        cache = runner.cache
        if cache.qsa is None or mtp.layer_idx not in cache.qsa.layer_ids:
            raise HebrusError(f"engine: the ModelCache has no layer for the MTP block (decoder layer "
                              f"{mtp.layer_idx}); build it with engine.mtp.mtp_model_cache")
        self.model, self.mtp, self.runner, self.cache = model, mtp.eval(), runner, cache
        self.trunk = runner.forward
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.width = mtp.hc_count * mtp.hidden_size
        self._streams: dict[SeqHandle, dict[int, torch.Tensor]] = {}    # seq -> position -> Tensor[hc * hidden]
        self._staged: list[tuple[SeqHandle, int, dict[int, torch.Tensor]]] | None = None
        self._probs: dict[Request, torch.Tensor] = {}
        self._generators: dict[Request, torch.Generator] = {}
        self.passes = 0                                   # packed MTP passes run for drafting
        self.stopped: dict[Request, int] = {}     # requests whose draft a threshold ended -> tokens (0: unsure round)
        #                                           drafted (propose_drafts empties it before asking)
        self._deferring: set[SeqHandle] = set()
        # seq -> position q -> (the trunk's streams Tensor[hc * hidden] at q - 1 or None, the token Tensor[1] at q):
        # the block's entries a trunk step did not write (zero in the cache until caught up)
        self._pending: dict[SeqHandle, dict[int, tuple[torch.Tensor | None, torch.Tensor]]] = {}
        self.caught_up = 0                                # entries written late by catch_up
        runner.mtp = self
        copy, save_unpacked = cache.copy, cache.save_unpacked

        def copy_with_streams(src: SeqHandle, dst: SeqHandle, _copy: Callable = copy) -> None:
            _copy(src, dst)
            self._streams[dst] = dict(self._streams.get(src, {}))
            self._pending[dst] = dict(self._pending.get(src, {}))
        cache.copy = copy_with_streams                    # (ModelCache.fork copies through it)

        def save_caught_up(seq: SeqHandle, _save: Callable = save_unpacked) -> Any:
            self.catch_up([seq])
            return _save(seq)
        cache.save_unpacked = save_caught_up              # (a saved state has the block's entries; save too)

        def state_dict_caught_up(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
            self.catch_up(list(self._pending))
        cache.register_state_dict_pre_hook(state_dict_caught_up)   # (and so has a state_dict)

    # ------------------------------------------------------------------ the runner's hook
    def forward(self, step: ChunkStep, positions: torch.Tensor, last: int, starts: Sequence[int],
                counts: Sequence[int], timed: Callable) -> torch.Tensor:
        """The trunk's packed forward, plus the MTP block's entries at the step's positions (written in the same
        transaction); returns the mixer's output Tensor[T, hidden] as ``PackedQwen4Exp`` does."""
        self._staged = None
        h, (cos, sin) = self.trunk.streams(step, positions, last, timed)
        seqs = step.batch.seqs
        if self._deferring and self._deferring.issuperset(seqs) and all(n == 1 for n in counts):
            self._staged = self._defer_all(seqs, starts, h, step.batch.tokens)
            return hyper_premix(self.trunk.text.hyper_connection_mixer, h)
        # Entry q of the block takes the streams at q - 1: the row's own h one token back, and for a row's first
        # token what its sequence's previous step left (zeros where none is kept); one copy each for all rows.
        firsts, first_at, shifted, kept_at, staged = [], [], [], [], []
        at = 0
        for seq, p, n in zip(step.batch.seqs, starts, counts):
            if n == 0:
                continue
            firsts.append(self._streams.get(seq, {}).get(p - 1))
            first_at.append(at)
            shifted.extend(range(at, at + n - 1))
            keep = [q for q in range(p, p + n)
                    if q >= p + n - (MAX_DRAFT_TOKENS + 1) or (q + 1) % self.block_size == 0]
            kept_at.extend(at + q - p for q in keep)
            staged.append((seq, p, keep))
            at += n
        kept = h.index_select(0, _index(kept_at, h))        # (a copy: the rows outlive the step's h)
        at = 0
        for i, (seq, p, keep) in enumerate(staged):
            staged[i] = (seq, p, dict(zip(keep, kept[at:at + len(keep)])))
            at += len(keep)
        deferred = self._defer(step, starts, counts, firsts, first_at, staged)
        if deferred != ():
            previous = h.new_zeros(h.shape)
            _place_known(previous, first_at, firsts)
            if shifted:
                previous.index_copy_(0, _index([i + 1 for i in shifted], h), h.index_select(0, _index(shifted, h)))
            with timed("mtp"):
                if deferred is None:
                    mtp_write(step, self.trunk, self.mtp, previous, step.batch.tokens, cos, sin)
                else:
                    seqs, spans, at = deferred
                    written = _index(at, h)
                    mtp_write(ChunkStep.held(self.cache, seqs, spans), self.trunk, self.mtp,
                              previous.index_select(0, written), step.batch.tokens.index_select(0, written),
                              cos.index_select(0, written), sin.index_select(0, written))
        self._staged = staged
        return hyper_premix(self.trunk.text.hyper_connection_mixer, h)     # (as PackedQwen4Exp's own)

    def _defer_all(self, seqs: Sequence[SeqHandle], starts: Sequence[int], h: torch.Tensor,
                   tokens: torch.Tensor) -> list[tuple]:
        """The staged rows of a step whose rows are all deferred decode rows (every speculating request backed
        off): nothing is written; row i keeps its streams h[i] (one copy of h: the rows outlive the step's h) and
        defers {p: (the streams before it, its token Tensor[1], a view of the step's own tokens)}: what the general
        path stages for such rows, without its index lists."""
        rows = h.clone().unbind(0)
        firsts = tokens.view(-1, 1).unbind(0)
        return [(seq, p, {p: row}, {p: (self._streams.get(seq, {}).get(p - 1), token)})
                for seq, p, row, token in zip(seqs, starts, rows, firsts)]

    def _defer(self, step: ChunkStep, starts: Sequence[int], counts: Sequence[int], firsts: list,
               first_at: list[int], staged: list) -> tuple | None:
        """Which of the step's rows write the block's entries now: None where all do, () where none does, else
        (their seqs, their positions, their token indices); each staged row that defers gets the entry it defers
        (a decode row of a request in ``_deferring``: {position: (the streams before it, its token)})."""
        if not self._deferring:
            return None
        rows = [(seq, p, n) for seq, p, n in zip(step.batch.seqs, starts, counts) if n]
        later = [n == 1 and seq in self._deferring for seq, p, n in rows]
        if not any(later):
            return None
        # the deferred rows' tokens, copied out of the step's batch in one gather
        tokens = step.batch.tokens.index_select(0, _index([first_at[r] for r, d in enumerate(later) if d],
                                                          step.batch.tokens))
        seqs, spans, at, i, j = [], [], [], 0, 0
        for row, ((seq, p, n), defer) in enumerate(zip(rows, later)):
            if defer:
                staged[row] = staged[row] + ({p: (firsts[row], tokens[j:j + 1])},)
                j += 1
            else:
                seqs.append(seq)
                spans.append(range(p, p + n))
                at.extend(range(i, i + n))
            i += n
        return (seqs, spans, at) if seqs else ()

    def published(self) -> None:
        """The step committed: its streams become the sequences' (positions from each row's first on replace
        what an abandoned stream left there). Of the earlier positions a sequence keeps the last
        ``MAX_DRAFT_TOKENS + 1`` and the block boundaries only (until December 2026 every position stayed: a row of
        hc * hidden values per token, copied on every fork)."""
        staged, self._staged = self._staged, None
        recent = MAX_DRAFT_TOKENS + 1
        for seq, p, rows, *deferred in staged or ():
            kept = self._streams.get(seq)
            if kept and next(reversed(kept)) == p - 1:    # the row goes on from the last position kept (positions
                stale = p - recent                        # are kept in increasing order): drop what fell behind
                for q in [q for q in kept if q < stale and (q + 1) % self.block_size]:
                    del kept[q]
            else:                                         # (a first row, or one after a rewind or a fork)
                kept = {q: r for q, r in (kept or {}).items()
                        if p - recent <= q < p or (q < p and (q + 1) % self.block_size == 0)}
                self._streams[seq] = kept
            kept.update(rows)
            pending = self._pending.get(seq)
            if pending is not None or deferred:       # (positions from the row's first on are this step's)
                if pending is None:
                    pending = self._pending[seq] = {}
                elif next(reversed(pending), -1) >= p:
                    pending = self._pending[seq] = {q: e for q, e in pending.items() if q < p}
                if deferred:
                    pending.update(deferred[0])
                if not pending:
                    del self._pending[seq]
        if len(self._streams) > 2 * self.cache.slots.capacity:
            self._streams = {s: v for s, v in self._streams.items() if self._live(s)}
        if len(self._pending) > 2 * self.cache.slots.capacity:
            self._pending = {s: v for s, v in self._pending.items() if self._live(s)}

    def defer(self, requests: Sequence[Request]) -> None:
        """The next trunk step defers the block's K/V write of these requests' decode rows (the engine passes the
        requests that speculate with the block and drafted nothing this step) while :attr:`defer_writes` is on;
        those with ``MAX_PENDING`` entries deferred are caught up first (what is kept stays bounded)."""
        if not self.defer_writes:
            self._deferring = set()
            return
        self._deferring = {r.seq for r in requests if r.seq is not None}
        full = [s for s in self._deferring if len(self._pending.get(s, ())) >= MAX_PENDING]
        if full:
            self.catch_up(full)

    @torch.no_grad()
    def catch_up(self, seqs: Sequence[SeqHandle]) -> int:
        """Write the block's entries the trunk steps deferred for these sequences (those at positions they still
        hold), in one packed write inside an atomic cache operation: the cache then holds what writing them in
        every step would have left (tested bitwise with row-invariant layers). Returns the entries written."""
        rows, seqs_w, spans = [], [], []
        for seq in dict.fromkeys(seqs):
            pending = self._pending.get(seq)
            if not pending or not self._live(seq):
                continue
            p0, n = self.cache.qsa.run(seq)
            held = sorted(q for q in pending if p0 <= q < p0 + n)
            if held:
                seqs_w.append(seq)
                spans.append(held)
                rows.extend(pending[q] for q in held)
        if rows:
            device = self.runner.device
            tokens = torch.cat([t for _, t in rows])
            like = self.trunk.text.embed_tokens.weight
            previous = torch.zeros((len(rows), self.width), dtype=like.dtype, device=device)
            _place_known(previous, range(len(rows)), [before for before, _ in rows])
            flat = [q for span in spans for q in span]
            positions = torch.tensor(flat, dtype=torch.int64, device=device)
            cos, sin = self.trunk.rope_rows(positions, max(flat), previous)
            with self.cache._atomic():
                mtp_write(ChunkStep.held(self.cache, seqs_w, spans), self.trunk, self.mtp, previous, tokens, cos, sin)
            self.caught_up += len(rows)
        for seq in seqs:
            self._pending.pop(seq, None)
        return len(rows)

    def pending_positions(self, seq: SeqHandle) -> list[int]:
        """The positions whose block entries are deferred for ``seq`` (zero in the cache until :meth:`catch_up`)."""
        return sorted(self._pending.get(seq, ()))

    def _live(self, seq: SeqHandle) -> bool:
        try:
            self.cache.slots.check(seq)
        except HebrusError:
            return False
        return True

    # ------------------------------------------------------------------ the engine's drafter interface
    def __call__(self, request: Request, k: int) -> list[int]:
        return self.propose_batch([request], [k])[0]

    @torch.no_grad()
    def propose_batch(self, requests: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        """Up to ``lengths[i]`` drafted tokens to follow each request's stream: requests decoding with their last
        token not yet in the cache (``num_computed == len(tokens) - 1``)."""
        out: dict[Request, list[int]] = {r: [] for r in requests}
        live = [(r, k) for r, k in zip(requests, lengths)
                if k > 0 and r.seq is not None and r.num_computed == len(r.tokens) - 1]
        if not live:
            return [out[r] for r in requests]
        self.catch_up([req.seq for req, _ in live])
        device = self.runner.device
        dtype = self.trunk.text.embed_tokens.weight.dtype
        streams = torch.zeros((len(live), self.width), dtype=dtype, device=device)
        for i, (req, _) in enumerate(live):
            before = self._streams.get(req.seq, {}).get(req.num_computed - 1)
            if before is not None:
                streams[i] = before
        feed = [req.tokens[-1] for req, _ in live]
        probs: list[list[torch.Tensor]] = [[] for _ in live]
        active = list(range(len(live)))
        try:
            with self.cache.transaction():
                for j in range(max(k for _, k in live)):
                    active = [i for i in active if live[i][1] > j]
                    if not active:
                        break
                    try:
                        step = ChunkStep(self.cache, Batch.from_rows([live[i][0].seq for i in active],
                                                                     [[feed[i]] for i in active], device=device))
                    except HebrusError:          # (no cells left: draft less)
                        break
                    pos = step.positions
                    last = max(live[i][0].num_computed + j for i in active)
                    cos, sin = self.trunk.rope_rows(pos, last, streams)
                    streams = packed_mtp(step, self.trunk, self.mtp, streams, step.batch.tokens, cos, sin)
                    logits = mtp_logits(self.mtp, self.runner.lm_head, streams)
                    self.passes += 1
                    picks, confidences, dists = [], [], []
                    for row, i in enumerate(active):
                        req = live[i][0]
                        drafted = out[req]
                        scores, sampled = target_scores(logits[row, :self.vocab_size], req.sampling,
                                                        req.tokens + drafted, req.generated + drafted)
                        if req.sampling.do_sample:
                            q = sampled.softmax(-1)
                            dists.append(q)
                            picks.append(torch.multinomial(q, 1, generator=self._generator(req))[0])
                            confidences.append(q.max())
                        else:
                            dists.append(None)
                            picks.append(scores.argmax())
                            confidences.append(scores.softmax(-1).max())
                    # the next pass feeds the picks: one read (token ids are exact in float64)
                    read = torch.stack([torch.stack(picks).double(), torch.stack(confidences).double()]).tolist()
                    going = []
                    for row, (i, t, c) in enumerate(zip(active, read[0], read[1])):
                        req, k = live[i]
                        threshold = req.speculative.confidence_threshold
                        if j == 0 and c < req.speculative.first_token_threshold:
                            self.stopped[req] = 0           # an unsure round: nothing proposed
                            continue
                        out[req].append(int(t))
                        feed[i] = int(t)
                        if dists[row] is not None:
                            probs[i].append(dists[row])
                        if c < threshold:       # the last position drafted for it (the token is still proposed)
                            self.stopped[req] = j + 1
                        elif k > j + 1:
                            going.append(row)
                    if len(going) < self.min_pass_share * len(live):
                        going = []              # too few rows left for another pass: the round ends here
                    streams = streams[going]
                    active = [active[row] for row in going]
                raise _Discard
        except _Discard:
            pass
        for i, (req, _) in enumerate(live):
            if probs[i]:
                self._probs[req] = torch.stack(probs[i])
            else:
                self._probs.pop(req, None)
        return [out[r] for r in requests]

    def _generator(self, req: Request) -> torch.Generator:
        gen = self._generators.get(req)
        if gen is None:
            gen = self._generators[req] = torch.Generator(device=self.runner.device)
            seed = req.sampling.seed
            gen.manual_seed(seed + 2 if seed is not None else torch.seed())
        return gen

    def draft_probs(self, request: Request, n: int) -> torch.Tensor | None:
        """Tensor[n, V] float32: the distributions the last ``n`` drafted tokens of ``request`` were sampled from
        (None for a greedy request)."""
        q = self._probs.get(request)
        return None if q is None else q[:n]

    def release(self, request: Request) -> None:
        """Forget the request's drafting state (its streams go with its sequence)."""
        self._probs.pop(request, None)
        self._generators.pop(request, None)

    def streams_at(self, seq: SeqHandle, position: int) -> torch.Tensor | None:
        """The trunk's pre-mixer streams Tensor[hc * hidden] of ``seq`` at ``position`` as kept here, or None."""
        return self._streams.get(seq, {}).get(position)


"""Executes one packed step of a transformers Qwen4Exp model inside one ModelCache transaction.

The runner never decides who runs (that is the scheduler's); it takes rows of tokens, one per
sequence, packs them (``Batch.from_rows``: a sequence given two rows is refused), opens the cache's
transaction, calls the model's packed forward (:class:`hebrus_torch.models.qwen4_exp.PackedQwen4Exp`:
every layer's math, on the model's own modules, the state through the transaction's ``ChunkStep``)
and returns the logits of the rows that asked for them (``lm_head`` on those rows only).

Leaving the transaction publishes every layer's new state at once; an exception publishes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

from ..errors import HebrusError
from ..model_cache import Batch, ModelCache
from ..models.qwen4_exp import PackedQwen4Exp, find_text_model
from ..models.qwen4_exp.forward import _NO_PART
from ..state.handles import SeqHandle
from .logits_layout import LogitsLayout

__all__ = ["ModelRunner", "find_text_model"]


class ModelRunner:
    """Runs packed steps of a transformers Qwen4Exp model over one ``ModelCache``.

    Args:
        model: ``Qwen4ExpForCausalLM`` (or a model holding one text model and an ``lm_head``).
        cache: the ``ModelCache`` holding every sequence's state (built with ``with_kv=True`` when the
            model has indexed-attention layers, and with a GDN holder when it has linear-attention ones).
        ple_prefetch: with a PLE table on disk, gather each step's rows on a worker thread as the step starts
            (True, False, or ``"auto"``: on CUDA / MPS, not on the CPU; ``PackedQwen4Exp``'s ``ple_prefetch``;
            docs/ple.md).
        native_layers: run stock decoder layers as native calls on the CPU (``PackedQwen4Exp``'s).
    """

    def __init__(self, model: torch.nn.Module, cache: ModelCache, *, ple_prefetch: bool | str = "auto",
                 native_layers: bool = True):
        self.model = model
        self.text = find_text_model(model)
        self.lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
        if self.lm_head is None:
            raise HebrusError(f"engine: {type(model).__name__} has no lm_head")
        self.config = self.text.config
        self.cache = cache
        self.forward = PackedQwen4Exp(self.text, cache, ple_prefetch=ple_prefetch, native_layers=native_layers)
        """The model's packed forward (every layer's math)."""
        self.timings: collections.Counter | None = None
        """Set to a Counter to accumulate seconds per part of the step (ple, gdn, attention, moe, other):
        host wall time, so only meaningful where the ops run synchronously (CPU)."""
        self.parts: list[str] | None = None
        """Set to a list to have the part of the step now running pushed on it (``engine.step_counts``)."""
        self.mtp: Any = None
        """The MTP drafter (``engine/mtp.py``) when the engine speculates with the checkpoint's MTP block: its
        ``forward(step, positions, last, starts, counts, timed)`` replaces the packed forward (it also writes the
        block's attention state) and its ``published()`` runs once the step's transaction committed."""

    def _timed(self, part: str) -> ContextManager:
        """A context around one part of the step: timed into ``timings`` and named on ``parts`` where those
        are set, else a shared no-op context (the decode hot path creates no context manager per part)."""
        if self.timings is None:
            return self._part(part)
        return self._timed_part(part)

    @contextlib.contextmanager
    def _timed_part(self, part: str) -> Iterator[None]:
        with self._part(part):
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.timings[part] += time.perf_counter() - t0

    def _part(self, part: str) -> ContextManager:
        """Names a part of the step for ``parts`` only (not timed); a shared no-op context when unset."""
        return _NO_PART if self.parts is None else self._pushed(part)

    @contextlib.contextmanager
    def _pushed(self, part: str) -> Iterator[None]:
        self.parts.append(part)
        try:
            yield
        finally:
            self.parts.pop()

    def close(self) -> None:
        """Stop the threads the runner started (the PLE prefetch worker); a later step starts them again."""
        self.forward.close()

    @property
    def device(self) -> torch.device:
        return self.text.embed_tokens.weight.device

    @torch.no_grad()
    def execute(self, seqs: Sequence[SeqHandle], rows: Sequence[Sequence[int]],
                logit_rows: LogitsLayout | Sequence[bool | int],
                positions: Sequence[int], chunked: Sequence[bool] | None = None,
                consume: Callable[[torch.Tensor], Any] | None = None) -> Any:
        """One step: row i feeds ``rows[i]`` to sequence ``seqs[i]`` starting at position ``positions[i]``;
        the GDN layers run row i in the chunked form where ``chunked[i]`` (its whole chunks of 64 aligned
        positions; the caller cuts rows at aligned positions), else in the recurrent form.

        ``logit_rows``: where each row's logits go (a ``LogitsLayout``), or per row how many of its last tokens
        want logits (True: 1, False: 0; a speculative verification row wants all of its tokens').

        ``consume(logits)`` runs inside the transaction (what the caller reads from the logits: an exception
        there publishes nothing, as one in the model does).

        Returns:
            Tensor[n, vocab] float32: the logits at those tokens, row after row, in token order; with
            ``consume``, what it returned.
        """
        device = self.device
        batch = Batch.from_rows(seqs, [list(r) for r in rows], positions, device=device)
        counts = [len(r) for r in rows]
        layout = logit_rows if isinstance(logit_rows, LogitsLayout) else LogitsLayout.of(logit_rows)
        picked = layout.token_indices(counts)
        # (every token's logits, in order: a decode step's rows; the hidden states are then read as they are)
        ends = None if picked == list(range(sum(counts))) else torch.tensor(picked, dtype=torch.int64, device=device)
        with self._part("transaction"), self.cache.transaction(batch) as step:
            if chunked is not None and any(chunked):
                step.gdn_start_positions = [int(p) if c else None for p, c in zip(positions, chunked)]
            pos = step.positions
            if pos is None:
                pos = torch.cat([torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(positions, counts)]
                                ).to(device) if counts else torch.empty(0, dtype=torch.int64, device=device)
            last = max((p + n - 1 for p, n in zip(positions, counts) if n), default=0)
            with self._part("other"):
                if self.mtp is None:
                    hidden = self.forward(step, pos, last, timed=self._timed)
                else:
                    hidden = self.mtp.forward(step, pos, last, list(positions), counts, self._timed)
                logits = self.forward.native.project(self.lm_head, hidden if ends is None else
                                                     hidden.index_select(0, ends))
                if logits.dtype != torch.float32:
                    logits = logits.float()
            result = logits
            if consume is not None:
                with self._part("engine"):
                    result = consume(logits)
        if self.mtp is not None:
            self.mtp.published()
        return result

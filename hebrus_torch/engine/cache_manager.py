"""Who holds which cells of the ModelCache: admission, prefix sharing and its alignment rules, the prefix LRU,
reclaim, and the prompt cache's files. The scheduler owns one (``Scheduler(cache_manager=)``) and asks it, while
planning, to admit a request, count the cells an admission takes and reclaim kept state; the engine asks it
to record prefixes, fork a prompt's other choices and release or keep a request's state when it ends.

Sharing a prefix: a waiting request starts from the longest prefix of its stream (but its last token) whose
state a kept or running sequence holds and that it may continue (``shareable``: with the chunked GDN
prefill, the state must have run the request's own whole chunks chunked: docs/engine.md, the alignment rule),
or from a prompt-cache file that is longer (``engine/prompt_cache.py``). One lookup (``prefix_hit`` /
``stored_prefix``) serves admission, its cell count and reclaim. A fork shares the prefix's cells; a state
restored from a file takes cells of its own.

Kept state (finished requests' sequences, for requests that extend their tokens) always yields to running
work: it is evicted, least recently used first, whenever a running request or an admission needs its cells
or a slot, before any request is preempted.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import torch

from ..errors import CapacityError, HebrusError
from ..gdn.chunked import CHUNK
from ..model_cache import ModelCache
from ..state.handles import SeqHandle
from .config import EngineConfig, EngineCounters
from .prefix import PrefixHit, PrefixIndex
from .prompt_cache import PromptCacheStore, StoredPrefix
from .requests import Request, RequestStatus

__all__ = ["CacheManager"]


class CacheManager:
    """The engine's sequences of one ``ModelCache`` (see the module docstring).

    Args:
        cache: the ModelCache.
        config: the engine's config (capacity, slots, block sharing, the prefix cache's budget).
        counters: the engine's counters (prefix hits and evictions, the prompt cache's).
        chunk_align: C when the GDN layers run the chunked form in prefill (the alignment rule), else None.
        device: where the requests' sampling generators live.
        prompt_cache: the files (None: none).
    """

    def __init__(self, cache: ModelCache, config: EngineConfig, counters: EngineCounters, *,
                 chunk_align: int | None, device: torch.device, prompt_cache: PromptCacheStore | None = None):
        self.cache, self.config, self.counters = cache, config, counters
        self.chunk_align = chunk_align      # (the alignment rule's C, None without it)
        self.device = device                # (the requests' generators are made there on admission)
        self.prompt_cache = prompt_cache
        self.prefix = PrefixIndex(config.block_size) if config.allow_block_sharing else None
        budget = config.prefix_cache_tokens
        # `is not None`: an empty PrefixIndex is falsy (len 0), which turned the prefix cache off
        self.prefix_cache_tokens = ((config.capacity_tokens // 2 if budget is None else budget)
                                    if self.prefix is not None else 0)
        self.kept: collections.OrderedDict[SeqHandle, int] = collections.OrderedDict()   # LRU: seq -> cells
        self.extent: dict[SeqHandle, int] = {}   # seq -> the chunk extent of the request whose state it holds

    # ------------------------------------------------------------------ cells
    def free_cells(self) -> int:
        qsa = self.cache.qsa
        if qsa is None:
            return self.config.capacity_tokens
        return qsa.free_cells()          # host bookkeeping: no wait for the device

    def chunk_extent(self, req: Request) -> int:
        return req.chunk_extent(self.chunk_align)

    # ------------------------------------------------------------------ admission
    def admit(self, req: Request, running: Sequence[Request]) -> bool | None:
        """Give a waiting ``req`` a sequence, forked from a shared prefix or restored from a file when one serves
        (``num_computed`` then rises to the prefix's end). None: not now (a running request prefills the blocks
        it shares; it stays queued in its place); False: no slot or cells."""
        if self.prefix is not None and req.num_computed == 0 and self._leader_prefilling(req, running):
            return None
        extent = self.chunk_extent(req)
        hit = self.prefix_hit(req)
        stored = self._from_prompt_cache(req, hit) if self.prompt_cache is not None else None
        try:
            if stored is not None:     # restored from a file: the request continues from its frontier
                seq, hit = stored.seq, stored
            elif hit is not None:
                if hit.seq in self.kept:
                    self.kept.move_to_end(hit.seq)
                seq = self.cache.fork(hit.seq)
                if self.prefix.frontier(hit.seq) != hit.tokens:
                    try:
                        self.cache.rewind(seq, hit.tokens)
                    except HebrusError:
                        self.cache.free(seq)
                        raise
            else:
                seq = self.cache.new_sequence()
        except CapacityError:
            return False
        req.seq = seq
        self.extent[seq] = extent
        if len(self.extent) > 2 * self.config.max_sequences:     # forget the freed sequences
            live = {r.seq for r in running} | set(self.kept) | {seq}
            self.extent = {s: e for s, e in self.extent.items() if s in live}
        if hit is not None:
            req.num_computed = hit.tokens
            req.prefix_hit_tokens += hit.tokens
            self.counters.prefix_hit_tokens += hit.tokens
        if req.generator is None:
            req.generator = req.sampling.generator(self.device)
        if req.first_scheduled_time < 0:
            req.first_scheduled_time = time.perf_counter()
        return True

    def prefix_hit(self, req: Request) -> PrefixHit | None:
        """The kept or running sequence a waiting ``req`` would start from (the longest prefix of its stream, but
        its last token, whose state it may continue: ``shareable``), or None. The one lookup of admission, its
        cell count and reclaim."""
        if self.prefix is None or req.num_computed:
            return None
        extent = self.chunk_extent(req)
        return self.prefix.lookup(req.tokens, req.num_tokens - 1,
                                  accept=lambda seq, n: self.shareable(seq, n, extent))

    def stored_prefix(self, req: Request, hit: PrefixHit | None) -> StoredPrefix | None:
        """The file (not read) longer than the in-memory ``hit`` that would serve a waiting ``req``, or None."""
        if self.prompt_cache is None or req.num_computed:
            return None
        extent = self.chunk_extent(req)
        return self.prompt_cache.lookup(req.tokens, req.num_tokens - 1,
                                        min_tokens=(hit.tokens if hit is not None else 0) + 1,
                                        accept=lambda e: self._file_shareable(e, extent))

    def expect(self, req: Request) -> None:
        """A request was queued: the file that would serve it now, if any, is read ahead on the store's thread
        (admission then restores it without reading the disk)."""
        if self.prompt_cache is not None:
            entry = self.stored_prefix(req, self.prefix_hit(req))
            if entry is not None:
                self.prompt_cache.prefetch(entry)

    def cells_needed(self, req: Request) -> int:
        """The cells admitting ``req`` takes: its pending stream less the prefix it shares with the sequence it
        forks (a state restored from a file takes cells of its own)."""
        hit = self.prefix_hit(req)
        if hit is None or self.stored_prefix(req, hit) is not None:
            return req.remaining
        return req.remaining - hit.tokens

    def shareable(self, seq: SeqHandle | None, n: int, extent: int, theirs: int | None = None) -> bool:
        """Whether a request of chunk extent ``extent`` may start from ``seq``'s state after ``n`` tokens with
        the bits of its own unshared path (docs/engine.md): the state must have run the same whole chunks
        chunked (those below min(C floor(n / C), extent)), and the request must be able to continue from n
        (n a multiple of C, or at or past its extent, where everything runs recurrently). ``theirs``: the
        chunk extent of the request that computed the state (default: ``seq``'s)."""
        c = self.chunk_align
        if not c:
            return True
        if theirs is None:
            theirs = self.extent.get(seq)
        whole = n // c * c
        return theirs is not None and (n % c == 0 or n >= extent) and min(whole, theirs) == min(whole, extent)

    def _file_shareable(self, entry: StoredPrefix, extent: int) -> bool:
        """``shareable`` for a file, whose writer (this engine or another, with the chunked form on or off)
        ran its positions below ``entry.chunk_extent`` chunked: with the chunked form off here, only a state
        that ran no whole chunk chunked continues with this engine's bits."""
        n = len(entry.tokens)
        if not self.chunk_align:
            return min(n // CHUNK * CHUNK, entry.chunk_extent) == 0
        return self.shareable(None, n, extent, entry.chunk_extent)

    def _leader_prefilling(self, req: Request, running: Sequence[Request]) -> bool:
        """Another running request is prefilling a prompt that shares at least one whole block with
        ``req`` and has not reached the end of that shared part: wait for it rather than prefill twice."""
        b = self.config.block_size
        for other in running:
            if other.num_computed >= len(other.prompt):
                continue
            shared = _common_prefix(other.prompt, req.prompt)
            shared = min(shared, req.num_tokens - 1) // b * b
            if shared >= b and other.num_computed < shared:
                return True
        return False

    # ------------------------------------------------------------------ reclaim
    def make_room(self, running: int, waiting: int) -> None:
        """Evict kept prefixes while the running requests and the next waiting one would lack a slot (cells are
        reclaimed while planning, through :meth:`reclaim`)."""
        if waiting:
            while self.kept and running + len(self.kept) >= self.config.max_sequences:
                self.evict_kept()

    def reclaim(self, req: Request | None, n: int) -> int:
        """Evict kept prefixes, least recently used first, until ``n`` cells are free for ``req`` (a
        running request, None for the decodes, or a waiting one being admitted); returns the cells freed.

        For a waiting request the kept sequence it would start from is spared, and nothing is evicted
        unless the kept state could cover all ``n`` cells (an admission that would fail anyway must not
        empty the prefix cache). For running work every kept sequence goes if need be.
        """
        if not self.kept or n <= 0:
            return 0
        spare = None
        if req is not None and req.status is RequestStatus.WAITING:
            hit = self.prefix_hit(req)
            spare = hit.seq if hit is not None else None
            if sum(c for s, c in self.kept.items() if s != spare) < n:
                return 0
        before = self.free_cells()
        freed = 0
        for seq in [s for s in self.kept if s != spare]:
            if freed >= n:
                break
            self.evict_kept(seq)
            freed = self.free_cells() - before
        return freed

    def free_a_slot(self) -> None:
        """Evict kept prefixes while every sequence slot is live (a fork needs one)."""
        while self.kept and len(self.cache.slots.live_handles()) >= self.config.max_sequences:
            self.evict_kept()

    # ------------------------------------------------------------------ requests' state
    def record_prefix(self, req: Request) -> None:
        """At a block boundary inside the prompt: snapshot the recurrent state and index the prefix."""
        if self.prefix is None:
            return
        n, b = req.num_computed, self.config.block_size
        if n % b or n > len(req.prompt) or n == 0:
            return
        self.cache.checkpoint(req.seq)
        self.prefix.record(req.seq, req.prompt[:n])

    def fork(self, parent: Request, child: Request) -> bool:
        """``child`` (another choice of ``parent``'s prompt) gets a fork of ``parent``'s sequence, which holds the
        state after the prompt; False when there is no slot even after evicting kept prefixes."""
        self.free_a_slot()
        try:
            seq = self.cache.fork(parent.seq)
        except CapacityError:
            return False
        child.seq, child.num_computed = seq, len(parent.prompt)
        self.extent[seq] = self.extent.get(parent.seq, self.chunk_extent(child))
        return True

    def release(self, req: Request) -> None:
        """Free ``req``'s sequence (it failed, was cancelled or preempted, or is not kept)."""
        if req.seq is None:
            return
        if self.prefix is not None:
            self.prefix.drop(req.seq)
        try:
            self.cache.free(req.seq)
        finally:
            req.seq = None

    def finished(self, req: Request) -> bool:
        """A request that finished normally: its state is written to the files, and kept for requests that
        extend its tokens where it fits (True: kept; its sequence is no longer the request's)."""
        if req.seq is None:
            return False
        self._to_prompt_cache(req)
        return self._keep(req)

    # ------------------------------------------------------------------ the prefix cache
    def _keep(self, req: Request) -> bool:
        """Keep a finished request's state for requests that extend its tokens; False if it does not fit."""
        if self.prefix_cache_tokens <= 0 or req.num_computed > self.prefix_cache_tokens:
            return False
        seq, req.seq = req.seq, None
        self.prefix.record_frontier(seq, req.tokens[:req.num_computed])
        self.kept[seq] = req.num_computed
        while sum(self.kept.values()) > self.prefix_cache_tokens:
            self.evict_kept()
        return True

    def evict_kept(self, seq: SeqHandle | None = None) -> None:
        """Free a kept sequence (the least recently used one by default)."""
        if seq is None:
            seq, _ = self.kept.popitem(last=False)
        else:
            del self.kept[seq]
        self.prefix.drop(seq)
        self.cache.free(seq)
        self.counters.prefix_evictions += 1

    def clear(self) -> None:
        while self.kept:
            self.evict_kept()

    # ------------------------------------------------------------------ the prompt cache (files)
    def _from_prompt_cache(self, req: Request, hit: PrefixHit | None) -> PrefixHit | None:
        """A new sequence restored from the longest stored prefix of ``req`` that is longer than the
        in-memory ``hit``, or None (no such file; the files that fail their checks are skipped, each
        with one warning; no slot or cells: memory or a fresh prefill serve the request instead).

        The restored sequence is the request's own (as a fork of a kept sequence would be): it uses
        cells of the request's own admission budget and no extra slot, so it takes nothing from
        running work."""
        store = self.prompt_cache
        if req.num_computed:
            return None
        t0 = time.perf_counter()
        try:
            while True:
                entry = self.stored_prefix(req, hit)
                if entry is None:
                    break
                data = store.read(entry)
                if data is None:
                    continue
                try:
                    seq = self.cache.restore(data)
                except CapacityError:
                    break
                except HebrusError as err:    # CorruptStateError, or any other refusal of this file's state
                    store.skip(entry, str(err))
                    continue
                self.counters.prompt_cache_hits += 1
                self.counters.prompt_cache_hit_tokens += len(entry.tokens)
                return PrefixHit(seq, len(entry.tokens))
            self.counters.prompt_cache_misses += 1
            return None
        finally:
            self.counters.prompt_cache_seconds += time.perf_counter() - t0

    def _to_prompt_cache(self, req: Request) -> None:
        """Write a finished request's state to the files (its tensors are copied out here, serialised, checksummed
        and written on the store's thread: ``ModelCache.save_unpacked``, ``PromptCacheStore.put_later``): at its frontier (``num_computed`` tokens), or,
        with the chunked GDN form and a frontier at or past C, at the last multiple of C within its whole
        prompt chunks that has a snapshot. A request restored from such a frontier would continue with the
        bits of a request whose outputs ran recurrently where its own prompt runs them chunked (the rule
        ``shareable`` applies to kept sequences); from an aligned position within the writer's whole
        prompt chunks any request that extends the tokens continues with its own bits. A failure is counted
        in ``prompt_cache_write_errors`` (an I/O error is also warned about, once per file); it never reaches
        the request."""
        n = req.num_computed
        if self.prompt_cache is None or n < 1:
            return
        t0 = time.perf_counter()
        try:
            c = self.chunk_align
            if not c:
                self.prompt_cache.put_later(req.tokens[:n], self.cache.save_unpacked(req.seq))
                return
            extent = self.extent.get(req.seq, 0)
            if n < c:       # the frontier: requests whose prompts stay below C may continue it (shareable)
                self.prompt_cache.put_later(req.tokens[:n], self.cache.save_unpacked(req.seq), extent)
                return
            aligned = min(extent, n // c * c)   # a multiple of C: any request that extends it may continue it
            if aligned == n:
                self.prompt_cache.put_later(req.tokens[:n], self.cache.save_unpacked(req.seq), extent)
                return
            seq = self.cache.fork(req.seq)
            try:
                for p in range(aligned, 0, -c):
                    try:
                        self.cache.rewind(seq, p)     # refused (nothing changes) without a snapshot at p
                    except HebrusError:
                        continue
                    self.prompt_cache.put_later(req.tokens[:p], self.cache.save_unpacked(seq), extent)
                    return
            finally:
                self.cache.free(seq)
        except HebrusError:   # (OSError is the store's own: counted and warned there)
            self.prompt_cache.note_write_error()
        finally:
            self.counters.prompt_cache_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the pending writes and release the files' directory (idempotent)."""
        if self.prompt_cache is not None:
            self.prompt_cache.close()
            self.prompt_cache = None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

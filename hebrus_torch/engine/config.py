"""An engine's sizes and policies (``EngineConfig``) and what it counts (``EngineCounters``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import HebrusError
from .speculative import SpeculativeConfig

__all__ = ["EngineConfig", "EngineCounters"]


@dataclass
class EngineConfig:
    """Sizes and policies of one engine.

    Attributes:
        capacity_tokens: cache cells (token positions) shared by all sequences.
        max_sequences: sequence slots (requests in flight at once).
        max_batch_tokens: tokens per step (None: unlimited).
        max_requests_per_batch: requests per step (None: max_sequences).
        allow_block_sharing: requests whose prompts share whole blocks start from the state at the
            end of the shared part (prefix sharing).
        block_size: the prefix-sharing block (prefill chunks that cross a boundary end on one).
        step_retries: how often a failed step is retried before its requests fail.
        prefix_cache_tokens: with block sharing, finished requests' state is kept for later
            requests that extend their tokens (a second chat turn), least recently used first out,
            while the kept sequences hold at most this many cache cells (None: half the capacity;
            0: keep nothing). Kept state always yields to running work: it is evicted whenever a
            running request or an admission needs its cells, before any request is preempted.
        chunked_prefill: the GDN layers run a prompt's whole chunks of 64 positions (aligned to absolute
            positions) in the chunked (WY) form, ``hebrus::gdn_chunk_delta_rule_slots``, and the scheduler
            cuts prefill chunks at multiples of 64 below a prompt's last whole chunk (docs/engine.md: the
            alignment rule). It needs ``max_batch_tokens`` None or >= 64 (a smaller budget never feeds a
            whole chunk in one step): below that, and with False, the recurrent form runs throughout.
        prompt_cache_dir: a directory where every finished request's state is also written (one file
            per request, at finish), so that a later request, in this process or the next one, whose
            prompt extends a stored request's tokens is restored from it and prefills only the rest
            (``engine/prompt_cache.py``; one engine process per directory). None: no files.
        prompt_cache_max_bytes: the files of ``prompt_cache_dir`` stay within this many bytes (least
            recently used deleted first).
        speculative: how requests speculate unless they say otherwise (``add_request(speculative=)``):
            prompt lookup drafts (``engine/speculative.py``); None: from the generation config's
            ``prompt_lookup_num_tokens`` (off when it is unset). With ``method="mtp"`` the engine is built to draft
            with the model's own MTP block (``engine/mtp.py``: its cache holds the block's layer; a model without
            the block is refused here).
        ple_prefetch: with the PLE n-gram table on disk (``from_pretrained(ple_table="disk")``), True: each
            step's rows are gathered on a worker thread from the moment the step's tokens are known, while the
            layers before the PLE layer run (docs/ple.md, "Prefetch"); False: in the PLE layer's own call;
            ``"auto"`` (default): True where the model is on a device (CUDA, MPS), False on the CPU (there the
            worker competes with torch's own threads for the cores). No effect with the table in memory.
        native_layers: on the CPU, run each stock decoder layer's ops as one to three native calls
            (``hebrus::decode_gdn_layer`` for a gated-delta-net layer, ``decode_attention_head`` / ``_tail`` around an
            indexed-attention layer's QSA cache, ``decode_ple_gate``, ``decode_moe_tail``; ``models/qwen4_exp/
            native.py``, docs/engine.md "Native decoder layers"): the same ops in the same order, so the same bits,
            without the Python between them; a module hooked, replaced or cast between steps is seen and takes its
            module path from the next step. False: every layer through the Python path.
    """

    capacity_tokens: int = 16384
    max_sequences: int = 32
    max_batch_tokens: int | None = 512
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True
    block_size: int = 64
    step_retries: int = 1
    prefix_cache_tokens: int | None = None
    chunked_prefill: bool = True
    prompt_cache_dir: str | os.PathLike | None = None
    prompt_cache_max_bytes: int = 4 << 30
    speculative: SpeculativeConfig | None = None
    ple_prefetch: bool | str = "auto"
    native_layers: bool = True

    def __post_init__(self) -> None:
        for name in ("capacity_tokens", "max_sequences", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HebrusError(f"EngineConfig: {name} must be an int >= 1, got {value!r}")
        for name in ("max_batch_tokens", "max_requests_per_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise HebrusError(f"EngineConfig: {name} must be None or an int >= 1, got {value!r}")
        for name in ("chunked_prefill", "native_layers"):
            if not isinstance(getattr(self, name), bool):
                raise HebrusError(f"EngineConfig: {name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.ple_prefetch, bool) and self.ple_prefetch != "auto":
            raise HebrusError(f"EngineConfig: ple_prefetch must be a bool or 'auto', got {self.ple_prefetch!r}")
        if self.prompt_cache_dir is not None and not isinstance(self.prompt_cache_dir, (str, os.PathLike)):
            raise HebrusError(f"EngineConfig: prompt_cache_dir must be None or a path, got {self.prompt_cache_dir!r}")
        value = self.prompt_cache_max_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HebrusError(f"EngineConfig: prompt_cache_max_bytes must be an int >= 1, got {value!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise HebrusError(f"EngineConfig: speculative must be None or a SpeculativeConfig, got "
                              f"{self.speculative!r}")


@dataclass
class EngineCounters:
    steps: int = 0
    failed_steps: int = 0
    retried_steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0        # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0
    prefix_hit_tokens: int = 0     # prompt tokens taken from a shared prefix instead
    prefix_evictions: int = 0      # kept sequences evicted from the prefix cache
    forked_choices: int = 0        # choices forked from another request's prompt (Request.forks): not prefilled
    step_seconds: float = 0.0
    model_seconds: float = 0.0
    # the prompt cache's files (EngineConfig.prompt_cache_dir; engine/prompt_cache.py)
    prompt_cache_hits: int = 0          # requests restored from a file
    prompt_cache_misses: int = 0        # admitted requests that no file served (memory may have)
    prompt_cache_hit_tokens: int = 0    # prompt tokens restored from files (also in prefix_hit_tokens)
    prompt_cache_writes: int = 0        # files written
    prompt_cache_evictions: int = 0     # files deleted for the size cap
    prompt_cache_skipped_files: int = 0  # files skipped as corrupt, truncated, foreign or of another version
    prompt_cache_write_errors: int = 0
    prompt_cache_seconds: float = 0.0   # on the engine's thread: saving states, reading and restoring files
    prompt_cache_write_seconds: float = 0.0  # on the store's thread: writing files
    # speculative decoding (engine/speculative.py)
    spec_drafted_tokens: int = 0        # drafted tokens fed for verification
    spec_accepted_tokens: int = 0       # of them, accepted
    spec_verify_rows: int = 0           # verification rows (one per speculating request and step)
    spec_steps: int = 0                 # steps with at least one verification row
    spec_rollbacks: int = 0             # rows cut short after verification (ModelCache.truncate)
    spec_drafter_errors: int = 0        # requests that stopped speculating: their drafter raised or proposed junk
    spec_confidence_stops: int = 0      # MTP drafts SpeculativeConfig.confidence_threshold ended before their length
    spec_unsure_rounds: int = 0         # MTP rounds that proposed nothing (SpeculativeConfig.first_token_threshold)
    spec_rides: int = 0                 # MTP rounds joined by a paused request (SpecState.ride_length)

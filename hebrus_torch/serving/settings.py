"""What the hebrus options of ``python -m hebrus_torch.serve`` set, and the settings this process serves with."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HebrusServeSettings", "current", "install", "API_KEY_ENV", "SHUTDOWN_GRACE_S", "QWEN4_MODEL_TYPES"]

API_KEY_ENV = "HEBRUS_API_KEY"
SHUTDOWN_GRACE_S = 5.0     # uvicorn's wait for open connections after SIGTERM, once every request was ended
QWEN4_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")


@dataclass
class HebrusServeSettings:
    """What the hebrus options set (``None``: derived from transformers' ``--cb-*`` options).

    Attributes:
        capacity_tokens: cache cells shared by every request (prompt + output positions).
        max_sequences: requests in flight at once.
        prefix_cache_tokens: cells kept for finished requests (second chat turns); 0 disables the prefix cache.
        block_sharing: False turns prefix sharing off altogether (no shared blocks, no prefix cache).
        debug: mount ``POST /hebrus/debug/kill_engine``.
        api_key: when set, every ``/v1/*``, ``/hebrus/*`` and ``/metrics`` request must carry ``Authorization:
            Bearer <api_key>`` (else 401 with an OpenAI-style error body); ``/health`` stays open.
        prompt_cache_dir: finished requests' states are also written there and read back by the next
            server (``EngineConfig.prompt_cache_dir``); one server per directory.
        prompt_cache_max_bytes: the size cap of ``prompt_cache_dir`` (None: the engine's default, 4 GiB).
        speculative_tokens: every request speculates with prompt lookup drafting up to this many tokens per
            step (``EngineConfig.speculative``), or with ``draft_model`` when one is given; None/0: off.
        draft_model: a directory with a small Qwen4Exp checkpoint of the same tokenizer: the drafts come
            from it (``engine/draft_model.py``).
        speculative_method: ``"ngram"`` (the above) or ``"mtp"``: every request drafts with the checkpoint's own
            MTP block (``engine/mtp.py``), ``speculative_tokens`` tokens per step (3 when unset).
        speculative_disable_by_batch_size: ``SpeculativeConfig.disable_by_batch_size`` (None: its default; 0:
            no limit).
        speculative_confidence_threshold: ``SpeculativeConfig.confidence_threshold`` of MTP drafting (None: its
            default).
        speculative_first_token_threshold: ``SpeculativeConfig.first_token_threshold`` of MTP drafting (None: its
            default).
    """

    capacity_tokens: int | None = None
    max_sequences: int | None = None
    prefix_cache_tokens: int | None = None
    block_sharing: bool = True
    debug: bool = False
    api_key: str | None = None
    prompt_cache_dir: str | None = None
    prompt_cache_max_bytes: int | None = None
    speculative_tokens: int | None = None
    draft_model: str | None = None
    speculative_method: str = "ngram"
    speculative_disable_by_batch_size: int | None = None
    speculative_confidence_threshold: float | None = None
    speculative_first_token_threshold: float | None = None


_current = HebrusServeSettings()


def current() -> HebrusServeSettings:
    """The settings of this process's server (set by :func:`install`, i.e. ``patch_transformers_serve``)."""
    return _current


def install(settings: HebrusServeSettings) -> None:
    global _current
    _current = settings

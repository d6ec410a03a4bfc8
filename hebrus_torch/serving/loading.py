"""Loading the served model: a Qwen4Exp checkpoint becomes a patched text-only LLM whose continuous-batching
manager is hebrus' (:class:`HebrusModelManager`, :func:`prepare_model`). A local checkpoint is loaded in place by
:func:`hebrus_torch.from_pretrained` (weights copied from memory maps, the PLE n-gram table in memory or read from
the files: ``--ple-table``, :func:`set_ple_options`; docs/ple.md)."""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

from transformers.cli.serving import model_manager as tf_model_manager
from transformers.cli.serving import utils as tf_utils

from . import settings as serve_settings
from .settings import QWEN4_MODEL_TYPES, HebrusServeSettings
from .shutdown import register_manager

__all__ = ["prepare_model", "HebrusModelManager", "PLEOptions", "set_ple_options", "ple_options"]

logger = logging.getLogger("hebrus_torch.serve")


@dataclass(frozen=True)
class PLEOptions:
    """``--ple-table`` (auto, disk, memory), ``--ple-cache-bytes`` (None: an eighth of physical memory) and
    ``--ple-prefetch`` (auto, on, off: ``EngineConfig.ple_prefetch`` "auto", True, False)."""
    table: str = "auto"
    cache_bytes: int | None = None
    prefetch: str = "auto"

    @property
    def engine_prefetch(self) -> bool | str:
        """``EngineConfig.ple_prefetch`` for ``prefetch``."""
        return {"on": True, "off": False}.get(self.prefetch, "auto")


_ple_options = PLEOptions()


def set_ple_options(options: PLEOptions) -> None:
    """What ``python -m hebrus_torch.serve`` read from ``--ple-table`` / ``--ple-cache-bytes`` / ``--ple-prefetch``."""
    global _ple_options
    _ple_options = options


def ple_options() -> PLEOptions:
    return _ple_options


def prepare_model(model: Any, tokenizer: Any = None) -> Any:
    """``apply`` the drop-in and make ``model.init_continuous_batching`` build a hebrus manager sized by the
    serve settings (idempotent)."""
    import hebrus_torch.integrations.transformers as hx
    from hebrus_torch.engine import manager as mgr

    if not hx.is_applied(model):
        hx.apply(model)
    mgr.install(model)   # apply() does it too once it is wired there; install is idempotent

    ref = weakref.ref(model)     # (no self-reference: a dropped model must not outlive its last reference)

    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None):
        self = ref()
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, mgr.HebrusBatchingManager):
            return cached
        settings = serve_settings.current()
        gen = generation_config if generation_config is not None else self.generation_config
        overrides = {k: v for k, v in dict(capacity_tokens=settings.capacity_tokens,
                                           max_sequences=settings.max_sequences,
                                           prefix_cache_tokens=settings.prefix_cache_tokens,
                                           prompt_cache_dir=settings.prompt_cache_dir,
                                           prompt_cache_max_bytes=settings.prompt_cache_max_bytes).items()
                     if v is not None}
        if not settings.block_sharing:
            overrides["allow_block_sharing"] = False
        overrides["ple_prefetch"] = ple_options().engine_prefetch
        draft = None
        speculative = speculative_config(settings)
        if speculative is not None:
            overrides["speculative"] = speculative
        if settings.draft_model:
            draft = _load_draft(settings.draft_model, self)
        engine_config = mgr.engine_config_from(self, continuous_batching_config, workload_hints, **overrides)
        manager = mgr.HebrusBatchingManager(self, gen, continuous_batching_config, workload_hints,
                                            engine_config=engine_config, tokenizer=tokenizer, draft_model=draft)
        register_manager(manager)
        return manager

    model.__dict__["init_continuous_batching"] = init_continuous_batching
    return model


def _model_type(model_id: str, revision: str, trust_remote_code: bool) -> str | None:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code).model_type
    except Exception:  # noqa: BLE001 - let transformers' own loader report it
        return None


# transformers' own class (module attributes are replaced by patch_transformers_serve; this module is imported
# before that, by the patching itself)
_BaseModelManager = tf_model_manager.ModelManager


class HebrusModelManager(_BaseModelManager):
    """transformers' ModelManager; a Qwen4Exp checkpoint is served as a patched text-only LLM."""

    def _is_qwen4(self, model_id_and_revision: str, gguf_file: str | None) -> bool:
        if gguf_file is not None:
            return False
        model_id, revision = model_id_and_revision.split("@", 1)
        return _model_type(model_id, revision, self.trust_remote_code) in QWEN4_MODEL_TYPES

    def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
        if not self._is_qwen4(model_id_and_revision, gguf_file):
            return super()._load_processor(model_id_and_revision, gguf_file=gguf_file)
        from transformers import AutoTokenizer

        model_id, revision = model_id_and_revision.split("@", 1)
        return AutoTokenizer.from_pretrained(model_id, revision=revision, trust_remote_code=self.trust_remote_code)

    def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None,
                    gguf_file: str | None = None):
        if not self._is_qwen4(model_id_and_revision, gguf_file):
            return super()._load_model(model_id_and_revision, tqdm_class=tqdm_class,
                                       progress_callback=progress_callback, gguf_file=gguf_file)
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

        model_id, revision = model_id_and_revision.split("@", 1)
        quantization_config = self.get_quantization_config()
        if progress_callback is not None:
            progress_callback({"status": "loading", "model": model_id_and_revision, "stage": "config"})
        if os.path.isdir(model_id) and quantization_config is None:
            return _load_in_place(model_id, self.device, self.dtype, self.attn_implementation)
        # a hub id or a quantized load: transformers' own loader (the PLE table in memory)
        kwargs = {"revision": revision, "attn_implementation": self.attn_implementation, "dtype": self.dtype,
                  "device_map": self.device, "trust_remote_code": self.trust_remote_code,
                  "tqdm_class": tqdm_class}
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        return Qwen4ExpForCausalLM.from_pretrained(model_id, **kwargs)

    def load_model_and_processor(self, model_id_and_revision: str, progress_callback=None, tqdm_class=None,
                                 gguf_file: str | None = None):
        model, processor = super().load_model_and_processor(
            model_id_and_revision, progress_callback=progress_callback, tqdm_class=tqdm_class,
            gguf_file=gguf_file)
        if type(model).__name__ == "Qwen4ExpForCausalLM" and not getattr(model, "_hebrus_served", False):
            prepare_model(model, tokenizer=getattr(processor, "tokenizer", processor))
            model._hebrus_served = True
        return model, processor

    @staticmethod
    def get_model_modality(model, processor=None):
        if type(model).__name__ == "Qwen4ExpForCausalLM":
            return tf_utils.Modality.LLM
        return _BaseModelManager.get_model_modality(model, processor=processor)

    def get_gen_models(self, cache_dir: str | None = None) -> list[dict]:
        try:
            listed = list(_BaseModelManager.get_gen_models(cache_dir))
        except Exception:  # noqa: BLE001 - no hub cache here: list the served model alone
            listed = []
        if self.force_model is not None and not any(m.get("id") == self.force_model for m in listed):
            listed.insert(0, {"id": self.force_model, "object": "model", "created": 0, "owned_by": "local"})
        return listed


def _serving_device(device: Any) -> str:
    """transformers serve's ``--device`` (auto, cpu, mps, cuda, cuda:N or N) as one torch device."""
    import torch

    if isinstance(device, int):
        return f"cuda:{device}"
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    return str(device)


def _load_draft(path: str, target: Any) -> Any:
    """``--draft-model``, on the served model's device and in its dtype: a local Qwen4Exp checkpoint loaded in
    place like the served one (:func:`_load_in_place`: the same ``--ple-table`` / ``--ple-cache-bytes`` choice),
    any other causal LM by transformers' ``AutoModelForCausalLM``."""
    if os.path.isdir(path) and _model_type(path, "main", False) in QWEN4_MODEL_TYPES:
        return _load_in_place(path, target.device, target.dtype, None, role="draft model")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device)


def _load_in_place(model_dir: str, device: Any, dtype: Any, attn_implementation: str | None,
                   role: str = "") -> Any:
    """:func:`hebrus_torch.from_pretrained` with the ``--ple-table`` / ``--ple-cache-bytes`` options; says which
    table ran (stderr, and ``model.hebrus_checkpoint``); ``role``: what the log calls it ("": the served model)."""
    from hebrus_torch.loading import from_pretrained
    from hebrus_torch.loading.model import physical_memory_bytes

    options = ple_options()
    cache_bytes = options.cache_bytes if options.cache_bytes is not None else physical_memory_bytes() // 8
    model = from_pretrained(model_dir, device=_serving_device(device), dtype=None if dtype == "auto" else dtype,
                            ple_table=options.table, ple_cache_bytes=cache_bytes,
                            attn_implementation=attn_implementation)
    loaded = model.hebrus_checkpoint
    where = ("read from the checkpoint's files (memory-mapped, pages released past "
             f"{cache_bytes / 2**30:.2f} GiB)" if loaded.ple_table == "disk" else "in memory")
    logger.warning("hebrus: %s%s loaded in place; PLE n-gram table (%.2f GiB) %s [--ple-table %s]",
                   f"{role} " if role else "", model_dir, loaded.ple_table_bytes / 2**30, where, options.table)
    return model


def speculative_config(settings: HebrusServeSettings):
    """The engine's ``SpeculativeConfig`` for the server's flags, or None where it does not speculate."""
    from hebrus_torch.engine.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig

    limit = settings.speculative_disable_by_batch_size
    limit = DEFAULT_DISABLE_BY_BATCH_SIZE if limit is None else (limit or None)
    if settings.speculative_method == "mtp":
        tokens = settings.speculative_tokens if settings.speculative_tokens is not None else 3
        extra = {name: value for name, value in (("confidence_threshold", settings.speculative_confidence_threshold),
                                                 ("first_token_threshold", settings.speculative_first_token_threshold))
                 if value is not None}
        return SpeculativeConfig(tokens, method="mtp", disable_by_batch_size=limit, **extra)
    if settings.speculative_tokens:
        return SpeculativeConfig(settings.speculative_tokens, disable_by_batch_size=limit)
    return None

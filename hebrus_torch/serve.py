"""``python -m hebrus_torch.serve MODEL_DIR [transformers serve options] [--hebrus-* options]``.

Serves a local Qwen4Exp checkpoint through transformers' own OpenAI-compatible server with continuous batching
on the hebrus engine. The code lives in :mod:`hebrus_torch.serving` (one module per concern; docs/serving.md);
this module keeps the entry point and re-exports the names it used to define.
"""

from __future__ import annotations

from hebrus_torch.serving.app import (_clear_prefix_cache, build_server, patch_transformers_serve,  # noqa: F401
                                      unpatch_transformers_serve)
from hebrus_torch.serving.bridge import HebrusCBGenerateManager, HebrusGenerationState  # noqa: F401
from hebrus_torch.serving.bridge import engine_kwargs as _request_kwargs  # noqa: F401
from hebrus_torch.serving.cli import USAGE, _hebrus_parser, _run_serve, main  # noqa: F401
from hebrus_torch.serving.handlers import (HebrusChatCompletionHandler, HebrusCompletionHandler,  # noqa: F401
                                           HebrusResponseHandler)
from hebrus_torch.serving.loading import HebrusModelManager, prepare_model  # noqa: F401
from hebrus_torch.serving.middleware import RequestEnd as _RequestEnd  # noqa: F401
from hebrus_torch.serving.middleware import require_api_key as _require_api_key  # noqa: F401
from hebrus_torch.serving.settings import (API_KEY_ENV, QWEN4_MODEL_TYPES, SHUTDOWN_GRACE_S,  # noqa: F401
                                           HebrusServeSettings)
from hebrus_torch.serving.shutdown import _MANAGERS, stop_all_managers  # noqa: F401
from hebrus_torch.serving.validation import (MAX_CHOICES, MAX_LEGACY_LOGPROBS, TEXT_PART_TYPES,  # noqa: F401
                                             _UNSUPPORTED)
from hebrus_torch.serving.validation import check_body as _check_body  # noqa: F401
from hebrus_torch.serving.validation import check_content_part as _check_content_part  # noqa: F401
from hebrus_torch.serving.validation import request_options as _options  # noqa: F401

__all__ = ["HebrusServeSettings", "patch_transformers_serve", "main"]


def _model_manager_class() -> type:
    """(the former factory) :class:`~hebrus_torch.serving.loading.HebrusModelManager`."""
    return HebrusModelManager


def _generation_state_class() -> type:
    """(the former factory) :class:`~hebrus_torch.serving.bridge.HebrusGenerationState`."""
    return HebrusGenerationState


def _cb_manager_class() -> type:
    """(the former factory) :class:`~hebrus_torch.serving.bridge.HebrusCBGenerateManager`."""
    return HebrusCBGenerateManager


if __name__ == "__main__":
    main()

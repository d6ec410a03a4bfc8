"""Serving Qwen4Exp through transformers' own OpenAI-compatible server on the hebrus engine
(``python -m hebrus_torch.serve``; docs/serving.md).

Modules, one concern each:

- :mod:`.settings`: what the hebrus options set (:class:`HebrusServeSettings`).
- :mod:`.loading`: a Qwen4Exp checkpoint served as a patched text-only LLM (``HebrusModelManager``,
  ``prepare_model``).
- :mod:`.bridge`: the manager bridge, transformers' continuous-batching manager on a
  ``HebrusBatchingManager`` whose queue is the only way to the engine; one result channel per request.
- :mod:`.validation`: request bodies checked before the model is touched (400s naming the parameter).
- :mod:`.options`: the OpenAI parameters transformers does not carry, travelling on the request's
  ``GenerationConfig``.
- :mod:`.openai_format` and :mod:`.handlers`: the OpenAI responses (``n`` choices, log-probabilities, stop
  strings) and transformers' endpoint handlers checked and answered with them.
- :mod:`.middleware`: request-end and disconnect hooks, the API key.
- :mod:`.app`: transformers' app plus the ``/hebrus/*`` routes, and :func:`patch_transformers_serve`.
- :mod:`.shutdown`: SIGTERM stops every manager at once; uvicorn's bounded wait.
- :mod:`.cli`: the command line.
"""

from .app import build_server, patch_transformers_serve, unpatch_transformers_serve
from .cli import USAGE, main
from .loading import prepare_model
from .settings import API_KEY_ENV, SHUTDOWN_GRACE_S, HebrusServeSettings
from .shutdown import stop_all_managers

__all__ = ["HebrusServeSettings", "patch_transformers_serve", "unpatch_transformers_serve", "build_server", "main",
           "prepare_model", "stop_all_managers", "USAGE", "API_KEY_ENV", "SHUTDOWN_GRACE_S"]

"""The app and the patching: transformers serve's own FastAPI app plus hebrus' routes and middleware
(:func:`build_server`), and :func:`patch_transformers_serve`, which makes transformers serve (in this process)
build it with hebrus' model manager, generation state and handlers."""

from __future__ import annotations

import contextlib
from typing import Any

from transformers.cli.serving import chat_completion as tf_chat_completion
from transformers.cli.serving import completion as tf_completion
from transformers.cli.serving import model_manager as tf_model_manager
from transformers.cli.serving import response as tf_response
from transformers.cli.serving import server as tf_server
from transformers.cli.serving import utils as tf_utils

from . import metrics as serve_metrics
from . import settings as serve_settings
from .bridge import HebrusGenerationState
from .handlers import HebrusChatCompletionHandler, HebrusCompletionHandler, HebrusResponseHandler
from .loading import HebrusModelManager
from .middleware import RequestEnd, require_api_key
from .settings import HebrusServeSettings
from .shutdown import uvicorn_server_class

__all__ = ["build_server", "patch_transformers_serve", "unpatch_transformers_serve"]

# transformers' own names, before patch_transformers_serve replaced them: (module, attribute) -> value
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _clear_prefix_cache(engine) -> int:
    n = len(engine.kept_sequences())
    engine.clear_prefix_cache()
    return n


def build_server(model_manager, chat_handler, *args, **kwargs):
    """transformers' app, plus the ``_RequestEnd`` middleware, the API key when one is set, ``GET /metrics``, ``GET
    /hebrus/stats``, ``POST /hebrus/prefix_cache/clear`` and, with ``--hebrus-debug``, ``POST
    /hebrus/debug/kill_engine``."""
    from fastapi.responses import JSONResponse

    original = _ORIGINALS.get((tf_server, "build_server"), tf_server.build_server)
    app = original(model_manager, chat_handler, *args, **kwargs)
    app.add_middleware(RequestEnd)
    state = kwargs.get("generation_state", chat_handler.generation_state)
    settings = serve_settings.current()
    if settings.api_key:
        require_api_key(app, settings.api_key)

    def manager():
        return state.hebrus_manager() if isinstance(state, HebrusGenerationState) else None

    _mount_metrics(app, manager)

    @app.get("/hebrus/stats")
    def hebrus_stats():
        m = manager()
        if m is None:
            return JSONResponse({"engine": None, "continuous_batching": state._continuous_batching})
        try:
            return JSONResponse(m.stats(timeout=10.0))
        except Exception as err:  # noqa: BLE001 - a dead or stuck engine says so
            return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=503)

    @app.post("/hebrus/prefix_cache/clear")
    def hebrus_clear_prefix_cache():
        m = manager()
        if m is None:
            return JSONResponse({"status": "ok", "evicted": 0})
        try:
            evicted = m.call_in_engine_thread(_clear_prefix_cache, timeout=10.0)
        except Exception as err:  # noqa: BLE001
            return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=503)
        return JSONResponse({"status": "ok", "evicted": evicted})

    if settings.debug:
        @app.post("/hebrus/debug/kill_engine")
        def hebrus_kill_engine():
            m = manager()
            if m is None or m.engine is None:
                return JSONResponse({"error": "no engine yet"}, status_code=409)

            def dead_step(*_a, **_k):
                raise RuntimeError("engine killed through /hebrus/debug/kill_engine")

            try:    # the manager's thread dies at its next step
                m.call_in_engine_thread(lambda engine: setattr(engine, "step", dead_step), timeout=10.0)
            except Exception as err:  # noqa: BLE001
                return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=409)
            return JSONResponse({"status": "ok"})

    return app


def _mount_metrics(app, manager) -> None:
    """``GET /metrics`` (:mod:`.metrics`) and the middleware counting the responses of ``/v1/*``; without
    prometheus_client, ``/metrics`` is a 501 saying so."""
    from fastapi.responses import JSONResponse, Response

    try:
        metrics = serve_metrics.ServerMetrics(manager)
    except ImportError:
        metrics = None
    serve_metrics.install(metrics)

    @app.get("/metrics")
    def hebrus_metrics():
        if metrics is None:
            return JSONResponse({"error": "/metrics needs prometheus-client (pip install 'hebrus_torch[serve]')"},
                                status_code=501)
        return Response(metrics.render(), media_type=serve_metrics.CONTENT_TYPE)

    if metrics is not None:
        app.add_middleware(serve_metrics.CountResponses, metrics=metrics)


def _replacements() -> dict[tuple[Any, str], Any]:
    replaced = {(tf_model_manager, "ModelManager"): HebrusModelManager,
                (tf_utils, "GenerationState"): HebrusGenerationState,
                (tf_server, "build_server"): build_server,
                (tf_chat_completion, "ChatCompletionHandler"): HebrusChatCompletionHandler,
                (tf_completion, "CompletionHandler"): HebrusCompletionHandler,
                (tf_response, "ResponseHandler"): HebrusResponseHandler}
    with contextlib.suppress(ImportError):
        import uvicorn

        base = _ORIGINALS.get((uvicorn, "Server"), uvicorn.Server)
        replaced[(uvicorn, "Server")] = uvicorn_server_class(base)
    return replaced


def patch_transformers_serve(settings: HebrusServeSettings | None = None) -> None:
    """Make transformers serve (in this process) serve Qwen4Exp on the hebrus engine: the names that
    transformers' ``Serve.__init__`` imports when it runs are replaced by hebrus' subclasses or wrappers
    (docs/serving.md)."""
    if settings is not None:
        serve_settings.install(settings)
    for (module, name), value in _replacements().items():
        _ORIGINALS.setdefault((module, name), getattr(module, name))
        setattr(module, name, value)


def unpatch_transformers_serve() -> None:
    for (module, name), value in _ORIGINALS.items():
        setattr(module, name, value)

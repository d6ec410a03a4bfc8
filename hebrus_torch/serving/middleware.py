"""The app's middleware: what runs when an HTTP request ends or its client disconnects (:class:`RequestEnd`,
:func:`on_request_end`, :func:`on_disconnect`), and the API key (:func:`require_api_key`)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Callable

__all__ = ["RequestEnd", "on_request_end", "on_disconnect", "require_api_key"]

# What runs when an HTTP request's ASGI call ends, however it ends (set per request by RequestEnd).
_ON_REQUEST_END: contextvars.ContextVar[list | None] = contextvars.ContextVar("hebrus_on_request_end", default=None)
# Callbacks run when the client of the current HTTP request disconnects before its response is complete.
_ON_DISCONNECT: contextvars.ContextVar[list | None] = contextvars.ContextVar("hebrus_on_disconnect", default=None)


def on_request_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current HTTP request's ASGI call ends (response complete, client gone, or error);
    nothing outside a request."""
    hooks = _ON_REQUEST_END.get()
    if hooks is not None:
        hooks.append(fn)


def on_disconnect(fn: Callable[[], None]) -> None:
    """Run ``fn`` if the current HTTP request's client disconnects before its response is complete."""
    hooks = _ON_DISCONNECT.get()
    if hooks is not None:
        hooks.append(fn)


def _run_callbacks(callbacks: list, what: str) -> None:
    for fn in callbacks:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a cleanup must not mask the request's own outcome
            logging.getLogger(__name__).exception("hebrus serve: a %s callback failed", what)


class RequestEnd:
    """ASGI middleware: the callbacks a request registers in ``_ON_REQUEST_END`` run when its ASGI call ends
    (response complete, client gone, or error), those in ``_ON_DISCONNECT`` as soon as its client
    disconnects before that.

    The client's messages are read by one pump task and handed to the app in order (``receive`` has one
    reader): after the body, the pump waits for ``http.disconnect``, which the server sends when the
    connection closes; the app reads it too (a streaming response listens for it) and, once it came, every
    later read returns it again."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        callbacks: list = []
        on_disconnect: list = []
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()

        async def pump() -> None:
            while True:
                message = await receive()
                messages.put_nowait(message)
                if message.get("type") == "http.disconnect":
                    gone.set()
                    _run_callbacks(on_disconnect, "disconnect")
                    return

        async def app_receive():
            if gone.is_set() and messages.empty():
                return {"type": "http.disconnect"}
            return await messages.get()

        token = _ON_REQUEST_END.set(callbacks)
        token_disconnect = _ON_DISCONNECT.set(on_disconnect)
        pump_task = asyncio.create_task(pump())
        try:
            return await self.app(scope, app_receive, send)
        finally:
            on_disconnect.clear()          # a disconnect after the response is no one's concern
            pump_task.cancel()
            _ON_REQUEST_END.reset(token)
            _ON_DISCONNECT.reset(token_disconnect)
            _run_callbacks(callbacks, "request-end")


_PROTECTED_PREFIXES = ("/v1/", "/hebrus/", "/metrics")


def require_api_key(app: Any, key: str) -> None:
    """Refuse every request under ``/v1/`` and ``/hebrus/``, and to ``/metrics``, whose ``Authorization`` header is
    not ``Bearer <key>`` with 401 and the error body OpenAI's API sends (``invalid_api_key``). The comparison takes
    the same time wherever the two first differ (``hmac.compare_digest``), so response times do not reveal the
    key."""
    import hmac

    from fastapi.responses import JSONResponse

    want = ("Bearer " + key).encode()

    @app.middleware("http")
    async def check_api_key(request, call_next):
        if request.url.path.startswith(_PROTECTED_PREFIXES):
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):
                message = ("Incorrect API key provided." if got else
                           "Missing API key: send it as 'Authorization: Bearer <key>'.")
                return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                               "code": "invalid_api_key"}}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

"""Stopping promptly: the managers this process built, stopped at once on SIGTERM/SIGINT, and uvicorn's
server with a bounded wait for open connections."""

from __future__ import annotations

import weakref
from typing import Any

from .settings import SHUTDOWN_GRACE_S

__all__ = ["register_manager", "stop_all_managers", "uvicorn_server_class"]

_MANAGERS: "weakref.WeakSet[Any]" = weakref.WeakSet()   # the hebrus managers this process built


def register_manager(manager: Any) -> None:
    """Count ``manager`` among those :func:`stop_all_managers` stops."""
    _MANAGERS.add(manager)


def stop_all_managers(reason: str = "the server is shutting down") -> int:
    """Stop every running hebrus manager of this process at once, failing its queued and running requests
    with ``reason`` (their streams end, so their connections close); returns how many were stopped. Safe in a
    signal handler: it only sets each manager's stop flag. From then on the managers refuse new requests
    (``ManagerStoppedError``; the server answers 503 at once)."""
    n = 0
    for manager in list(_MANAGERS):
        if manager.is_running():
            manager.stop(block=False, hard_stop=True, reason=reason)
            n += 1
    return n


def uvicorn_server_class(base: type) -> type:
    """uvicorn's server (``base``) that honours SIGTERM/SIGINT promptly under load."""

    class HebrusUvicornServer(base):
        """uvicorn's server that honours SIGTERM/SIGINT promptly under load.

        uvicorn's graceful shutdown waits, without limit by default, for every open connection to close,
        that is for every request in flight (a long stream, a queue of them) to finish. Here the first
        signal also stops the engine hard (every request ends at once with an error saying the server is
        shutting down), and the wait for connections is bounded (``SHUTDOWN_GRACE_S`` unless
        ``timeout_graceful_shutdown`` is set)."""

        def __init__(self, config):
            if getattr(config, "timeout_graceful_shutdown", None) is None:
                config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S
            super().__init__(config)

        def handle_exit(self, sig, frame) -> None:
            stop_all_managers()
            super().handle_exit(sig, frame)

    return HebrusUvicornServer

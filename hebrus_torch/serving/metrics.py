"""``GET /metrics``: the server's metrics in Prometheus' text format (``prometheus_client``), one registry per app.

Three sources:

- the HTTP layer (:meth:`ServerMetrics.count_response`, a middleware): responses by endpoint and status code;
- the engine thread (:meth:`ServerMetrics.observe`, called by the manager after every step with its outputs):
  requests finished by outcome, prompt and generated tokens, time to first token, inter-token latency and
  step time histograms;
- the engine's own state and counters, read on its thread when scraped (:class:`_EngineCollector`, through
  ``HebrusBatchingManager.stats``): queue depth, running requests, cache cells used / free and kept, preemptions,
  prefix-reused tokens, speculation drafted / accepted tokens, prompt-cache file hits, steps.

docs/serving.md lists every name.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["ServerMetrics", "CountResponses", "install", "current", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_SCRAPE_TIMEOUT_S = 5.0


class ServerMetrics:
    """The app's registry and metrics. ``manager()`` gives the running ``HebrusBatchingManager`` (None before the
    first request)."""

    def __init__(self, manager: Callable[[], Any]):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http = Counter("hebrus_http_requests", "HTTP responses by endpoint and status code",
                            ["endpoint", "status"], registry=r)
        self.finished = Counter("hebrus_requests_finished", "Engine requests (choices) ended, by outcome",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter("hebrus_prompt_tokens", "Prompt tokens of the requests ended", registry=r)
        self.generated_tokens = Counter("hebrus_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("hebrus_time_to_first_token_seconds",
                              "From the engine taking a request to its first token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("hebrus_inter_token_latency_seconds",
                             "Between two tokens of a request (a step's tokens share its time)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step = Histogram("hebrus_step_seconds", "One engine step (schedule, model, sampling, update)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(manager))
        self._last_token: dict[str, float] = {}      # request id -> when its last token came (engine thread)
        self._step_seconds = 0.0

    def count_response(self, path: str, status: int) -> None:
        self.http.labels(endpoint=path, status=str(status)).inc()

    def observe(self, engine: Any, outputs: list) -> None:
        """After each engine step, on the engine's thread: its duration and what its outputs did."""
        seconds = engine.counters.step_seconds
        if seconds > self._step_seconds:
            self.step.observe(seconds - self._step_seconds)
        self._step_seconds = seconds
        now = time.perf_counter()
        for out in outputs:
            req = out.request
            rid = req.request_id
            if out.new_tokens:
                self.generated_tokens.inc(len(out.new_tokens))
                last = self._last_token.get(rid)
                if last is None:
                    if req.first_token_time >= 0:
                        self.ttft.observe(max(0.0, req.first_token_time - req.created_time))
                    for _ in range(len(out.new_tokens) - 1):
                        self.itl.observe(0.0)
                else:
                    gap = (now - last) / len(out.new_tokens)
                    for _ in out.new_tokens:
                        self.itl.observe(gap)
                self._last_token[rid] = now
            if out.finished:
                self._last_token.pop(rid, None)
                self.finished.labels(outcome=_outcome(req)).inc()
                self.prompt_tokens.inc(len(req.prompt))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _outcome(req: Any) -> str:
    status = req.status.value
    if status == "finished":
        return req.finish_reason.value if req.finish_reason is not None else "stop"
    return status          # failed, cancelled


class _EngineCollector:
    """The engine's state and counters, read on its thread at scrape time."""

    _COUNTERS = (("hebrus_prefix_reused_tokens", "prefix_hit_tokens",
                  "Prompt tokens taken from a shared prefix or a prompt-cache file instead of prefilled"),
                 ("hebrus_prefill_tokens", "prefill_tokens", "Prompt (and recomputed) tokens run through the model"),
                 ("hebrus_preemptions", "preemptions", "Requests preempted (their state freed, recomputed later)"),
                 ("hebrus_spec_drafted_tokens", "spec_drafted_tokens", "Drafted tokens fed for verification"),
                 ("hebrus_spec_accepted_tokens", "spec_accepted_tokens", "Drafted tokens accepted"),
                 ("hebrus_spec_confidence_stops", "spec_confidence_stops",
                  "MTP drafts the confidence threshold ended before their length"),
                 ("hebrus_spec_unsure_rounds", "spec_unsure_rounds",
                  "MTP drafting rounds that proposed nothing (first token below the first-token threshold)"),
                 ("hebrus_spec_rides", "spec_rides", "MTP drafting rounds joined by a request in its back-off pause"),
                 ("hebrus_prompt_cache_file_hits", "prompt_cache_hits", "Requests restored from a prompt-cache file"),
                 ("hebrus_engine_steps", "steps", "Engine steps run"),
                 ("hebrus_engine_failed_steps", "failed_steps", "Engine steps that raised (retried or failed)"))

    def __init__(self, manager: Callable[[], Any]):
        self._manager = manager

    def describe(self) -> list:
        return []        # (collected at scrape time only)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self._manager()
        stats = None
        if m is not None and getattr(m, "engine", None) is not None:
            try:
                stats = m.stats(timeout=_SCRAPE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead or stuck engine: hebrus_engine_up 0
                stats = None
        up = GaugeMetricFamily("hebrus_engine_up", "1 when the engine answered this scrape")
        up.add_metric([], 1.0 if stats is not None and stats.get("fatal_error") is None else 0.0)
        yield up
        stats = stats or {}
        counters = stats.get("counters", {})
        for name, key, doc in self._COUNTERS:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], float(counters.get(key, 0)))
            yield family
        waiting = GaugeMetricFamily("hebrus_requests_waiting", "Requests queued, not yet admitted")
        waiting.add_metric([], float(stats.get("waiting_requests", 0)))
        yield waiting
        running = GaugeMetricFamily("hebrus_requests_running", "Requests admitted (prefilling or decoding)")
        running.add_metric([], float(stats.get("running_requests", 0)))
        yield running
        capacity, free, kept = (int(stats.get(k, 0)) for k in ("capacity_tokens", "free_cells", "kept_tokens"))
        cells = GaugeMetricFamily("hebrus_cache_cells", "Cache cells (token positions): used (held by running "
                                  "requests or kept prefixes) and free", labels=["state"])
        cells.add_metric(["used"], float(max(0, capacity - free)))
        cells.add_metric(["free"], float(free))
        yield cells
        kept_cells = GaugeMetricFamily("hebrus_cache_kept_cells", "Cells of the prefixes kept for reuse (part of the "
                                       "used cells; a block two prefixes share counts in each)")
        kept_cells.add_metric([], float(kept))
        yield kept_cells


class CountResponses:
    """ASGI middleware: counts the responses of ``/v1/*`` by path and status (when they start: a stream counts
    once, with its 200)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope.get("type") != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message.get("type") == "http.response.start":
                self.metrics.count_response(path, int(message.get("status", 0)))
            await send(message)
        return await self.app(scope, receive, counting_send)


_current: ServerMetrics | None = None


def install(metrics: ServerMetrics | None) -> None:
    """The metrics the managers this process builds report to (``HebrusCBGenerateManager.init_cb``)."""
    global _current
    _current = metrics


def current() -> ServerMetrics | None:
    return _current

"""What an operator sees of ``kvstate serve``: Prometheus metrics and one log line
per request.

``Metrics(scheduler)`` owns one ``prometheus_client.CollectorRegistry`` (one
per app: several apps in a process never share a series) and is wired in by
``http.make_app``::

    middleware ── each request: route, status, seconds ──▶ kvstate_requests_total,
       │                                                   the log line (kvstate.serve)
       └─ watch(job) ── wraps job.emit: in the scheduler's thread, each token
                        is timed (TTFT, inter-token latency) and counted
    scrape ── GET /metrics: the scheduler's state read then (queue depth, active
              rows, KV bytes, rounds, draft tokens), nothing measured per round

Names, labels and decisions are in ``notes/serving.md``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import attrs
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["Metrics", "kv_bytes"]

# Seconds. TTFT and a request's whole time: a CPU prefill of a long prompt takes
# seconds; inter-token latency: tens of milliseconds a round at small batches.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@attrs.define(eq=False)
class _Trace:
    """One HTTP request as the metrics see it (filled by the middleware and, for a
    completion, by the scheduler's thread through the job's ``emit``)."""

    route: str
    start: float
    job: Any = None
    prompt_tokens: Optional[int] = None
    first: Optional[float] = None  # when the first token came
    tokens: int = 0
    last: dict = attrs.Factory(dict)  # choice -> (time, round) of its latest round's tokens
    finish: dict = attrs.Factory(dict)  # choice -> finish reason the scheduler gave


class Metrics:
    """Prometheus metrics of one app over its ``Scheduler``, and the request log.

    Args:
        scheduler: the app's ``Scheduler`` (read at scrape time).
        log: the logger of the per-request lines (``kvstate.serve``).
    """

    def __init__(self, scheduler: Scheduler, log: Optional[logging.Logger] = None) -> None:
        self.scheduler = scheduler
        self.log = log or logging.getLogger("kvstate.serve")
        self.registry = r = CollectorRegistry()
        self.traces: dict = {}  # the handler's asyncio task -> its _Trace
        self.requests = Counter(
            "kvstate_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvstate_prompt_tokens", "prompt tokens of admitted requests", registry=r
        )
        self.completion_tokens = Counter(
            "kvstate_completion_tokens", "tokens generated (every choice)", registry=r
        )
        self.lookups = Counter(
            "kvstate_prefix_cache_lookups",
            "admitted requests looked up in the prefix cache",
            registry=r,
        )
        self.hits = Counter(
            "kvstate_prefix_cache_hits", "lookups that found a cached prefix", registry=r
        )
        self.cached_tokens = Counter(
            "kvstate_prefix_cache_cached_tokens",
            "prompt tokens read from the prefix cache instead of prefilled",
            registry=r,
        )
        self.ttft = Histogram(
            "kvstate_time_to_first_token_seconds",
            "from the request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvstate_inter_token_latency_seconds",
            "between a choice's rounds that gave it tokens (one sample a round)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "kvstate_request_duration_seconds",
            "a completion request, arrival to its last byte",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        r.register(_SchedulerCollector(scheduler))

    # --- GET /metrics -------------------------------------------------------------------

    async def scrape(self, request):
        """``GET /metrics``: the registry in Prometheus' text format."""
        from aiohttp import web

        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    # --- per request ----------------------------------------------------------------------

    @property
    def middleware(self):
        """aiohttp middleware: each request counted by route and status, and logged."""
        from aiohttp import web

        @web.middleware
        async def observe(request, handler):
            trace = _Trace(route=_route(request), start=time.perf_counter())
            task = asyncio.current_task()
            self.traces[task] = trace
            status = 500  # an exception the handler did not turn into a response
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as e:
                status = e.status
                raise
            except asyncio.CancelledError:
                status = 499  # the client went away (nginx's code for it)
                raise
            finally:
                del self.traces[task]
                self._finished(trace, status)

        return observe

    def watch(self, job, params) -> None:
        """Before ``job`` is queued (in its handler's task): its tokens are timed from
        here on, in the scheduler's thread."""
        trace = self.traces.get(asyncio.current_task())
        if trace is None:  # (a handler called outside the middleware)
            return
        trace.job, trace.prompt_tokens = job, len(params.prompt)
        emit = job.emit

        def timed(kind, choice, value):
            self._event(trace, kind, choice, value)
            emit(kind, choice, value)

        job.emit = timed

    def _event(self, trace: _Trace, kind: str, choice: int, value) -> None:
        """One scheduler event (its thread): TTFT, inter-token latency, tokens."""
        if kind == "done":
            trace.finish[choice] = value
            return
        if kind != "token":
            return
        now, round_ = time.perf_counter(), self.scheduler.stats["rounds"]
        if trace.first is None:
            trace.first = now
            self._admitted(trace, now - trace.start)
        last = trace.last.get(choice)
        if last is None or last[1] != round_:  # a round's tokens arrive together: one sample
            if last is not None:
                self.itl.observe(now - last[0])
            trace.last[choice] = (now, round_)
        trace.tokens += 1
        self.completion_tokens.inc()

    def _admitted(self, trace: _Trace, ttft: float) -> None:
        """At the first token: TTFT, the prompt, and what the prefix cache gave."""
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(trace.prompt_tokens or 0)
        cached = trace.job.cached
        if self.scheduler.prefix_cache is not None and cached is not None:
            self.lookups.inc()
            if cached:
                self.hits.inc()
                self.cached_tokens.inc(cached)

    def _finished(self, trace: _Trace, status: int) -> None:
        """The request is answered: counted, timed, and logged in one line."""
        seconds = time.perf_counter() - trace.start
        self.requests.labels(trace.route, str(status)).inc()
        job = trace.job
        if job is not None:
            self.duration.observe(seconds)
        level = logging.INFO if trace.route.startswith("/v1") else logging.DEBUG
        if self.log.isEnabledFor(level):
            self.log.log(level, request_line(trace, status, seconds))


def request_line(trace: _Trace, status: int, seconds: float) -> str:
    """The log line: ``key=value`` pairs (``-`` where not known)."""
    job = trace.job
    ttft = "-" if trace.first is None else f"{trace.first - trace.start:.3f}"
    fields = {
        "id": "-" if job is None else job.id,
        "route": trace.route,
        "status": status,
        "prompt_tokens": _or_dash(trace.prompt_tokens),
        "completion_tokens": trace.tokens if job is not None else "-",
        "cached_tokens": _or_dash(None if job is None else job.cached),
        "ttft_s": ttft,
        "seconds": f"{seconds:.3f}",
        "finish": "-" if job is None else ",".join(_finishes(trace, status)),
    }
    return " ".join(f"{k}={v}" for k, v in fields.items())


def _finishes(trace: _Trace, status: int) -> list:
    """Each choice's finish reason: the scheduler's (``stop``, ``length``), else
    ``stop`` for a stop string the reply matched, ``cancelled`` when the client
    went away, ``error`` otherwise."""
    other = "stop" if status == 200 else "cancelled" if status == 499 else "error"
    if trace.job.error is not None:  # a stream's error event (its status was already 200)
        other = "error"
    return [trace.finish.get(i, other) for i in range(trace.job.n)]


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def _route(request) -> str:
    """The route's path template (bounded label values: an unknown path is ``unmatched``)."""
    resource = request.match_info.route.resource
    return "unmatched" if resource is None else resource.canonical


def kv_bytes(scheduler: Scheduler) -> int:
    """``scheduler.nbytes()`` from another thread: the walk over the prefix cache's
    entries is retried if the scheduler's thread changed them meanwhile."""
    for _ in range(3):
        try:
            return scheduler.nbytes()
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return scheduler.nbytes()


class _SchedulerCollector:
    """The scheduler's state, read when Prometheus scrapes (not every round)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def describe(self) -> list:
        return []  # (nothing read at registration: the scheduler may not run yet)

    def collect(self):
        s = self.scheduler
        yield GaugeMetricFamily("kvstate_queue_depth", "requests waiting", value=s.queued)
        yield GaugeMetricFamily("kvstate_active_rows", "rows decoding", value=s.active_rows)
        yield GaugeMetricFamily(
            "kvstate_kv_bytes",
            "KV bytes resident: rows and prefix cache, each shared record once",
            value=kv_bytes(s),
        )
        cache = s.prefix_cache
        if cache is not None:
            yield GaugeMetricFamily(
                "kvstate_prefix_cache_entries", "prompts in the prefix cache", value=len(cache)
            )
            yield CounterMetricFamily(
                "kvstate_prefix_cache_evictions", "entries evicted", value=cache.evictions
            )
        st = s.stats
        for name, key, what in (
            ("kvstate_rounds", "rounds", "decode or speculative rounds run"),
            ("kvstate_draft_tokens", "drafted", "draft tokens proposed"),
            ("kvstate_draft_accepted_tokens", "accepted", "draft tokens accepted"),
        ):
            yield CounterMetricFamily(name, what, value=st[key])

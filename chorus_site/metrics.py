"""Prometheus metrics (issue 12 item 3): the counters and histograms, and who may scrape them.

Two kinds of numbers, each kept where it is sound with several portal processes and workers:

* **State** (how many turns run, stalled turns, connections by status, heartbeat ages, runs by
  state) is read from the database at scrape time by collectors (sessions_app/metrics.py,
  executions/metrics.py): every process answers the same, nothing to aggregate.
* **Happenings** (turns finished, wake errors, interrupts and their time to confirmed, command
  delivery, events ingested, Celery task latency, live clients) are counted where they happen, in
  whichever process that is, with prometheus_client.  With ``PROMETHEUS_MULTIPROC_DIR`` set (every
  portal and worker process of a host, the directory emptied at start: docs/alerts.md) its
  multiprocess mode sums them across the host's processes at scrape time; without it, a single
  process (the embedded mode) counts in memory.

``/metrics`` answers only a scraper that shows ``CHORUS_METRICS_TOKEN`` as a bearer token or
comes from ``CHORUS_METRICS_ALLOWLIST`` (addresses or networks); with neither set it is off (404).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import time

from django.conf import settings
from prometheus_client import Counter, Gauge, Histogram

# Seconds: an interrupt is confirmed within the SIGINT grace (10 s default) + the kill confirmation.
STOP_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 20, 30, 60, 120, 300)
FAST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

TURNS_FINISHED = Counter("chorus_turns_finished", "Turns that reached a final status",
                         ["status", "reason", "backend"])
WAKE_ERRORS = Counter("chorus_wake_errors", "Turns that ended with a wake error", ["kind", "backend"])
INTERRUPTS = Counter("chorus_interrupts", "Stops of turns by outcome (confirmed, unconfirmed)", ["outcome"])
INTERRUPT_CONFIRM_SECONDS = Histogram("chorus_interrupt_confirm_seconds",
                                      "From a stop requested to the stop confirmed", buckets=STOP_BUCKETS)
STALLS = Counter("chorus_turn_stalls", "Running turns flagged stalled", ["backend"])
COMMAND_DELIVERY_SECONDS = Histogram("chorus_command_delivery_seconds",
                                     "From a control command created to the daemon's ack", ["action"],
                                     buckets=FAST_BUCKETS)
EVENTS_INGESTED = Counter("chorus_agent_events_ingested", "Agent events taken from daemon reports")
CELERY_TASK_SECONDS = Histogram("chorus_celery_task_seconds", "Celery task run time", ["task", "outcome"],
                                buckets=FAST_BUCKETS)
CELERY_TASK_QUEUE_SECONDS = Histogram("chorus_celery_task_queue_seconds",
                                      "From a Celery task sent to its start (ETA tasks: past their ETA)",
                                      ["task"], buckets=FAST_BUCKETS)
# livesum: the clients of processes that are alive, summed (a process that died is dropped).
LIVE_CLIENTS = Gauge("chorus_live_clients", "Open live streams (ws: admin pages, sse: API, daemon: sockets)",
                     ["kind"], multiprocess_mode="livesum")


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


# ---------------------------------------------------------------- who may scrape
def scrape_refusal(request) -> tuple[int, str] | None:
    """None if the request may read /metrics, else (HTTP status, reason)."""
    token = settings.CHORUS_METRICS_TOKEN
    allowlist = settings.CHORUS_METRICS_ALLOWLIST
    if not token and not allowlist:
        return 404, "metrics are off: set CHORUS_METRICS_TOKEN or CHORUS_METRICS_ALLOWLIST"
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return None
    if allowlist and not _through_a_proxy(request) and _address_allowed(request.META.get("REMOTE_ADDR", ""), allowlist):
        return None
    return 401, "a bearer token (CHORUS_METRICS_TOKEN) or an allowed address is required"


# Headers a reverse proxy adds: a request carrying one came through it, and its REMOTE_ADDR is the
# proxy's own (127.0.0.1 in docs/deployment.md), not the caller's.
PROXY_HEADERS = ("HTTP_FORWARDED", "HTTP_X_FORWARDED_FOR", "HTTP_X_FORWARDED_PROTO", "HTTP_X_REAL_IP")


def _through_a_proxy(request) -> bool:
    return any(name in request.META for name in PROXY_HEADERS)


def _address_allowed(address: str, allowlist: list[str]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    for entry in allowlist:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


# ---------------------------------------------------------------- Celery
def celery_signals_connect() -> None:
    """Task latency from Celery's signals: the time sent rides in a header of the message."""
    from celery.signals import before_task_publish, task_postrun, task_prerun, worker_process_shutdown

    started: dict[str, float] = {}

    @before_task_publish.connect(weak=False)
    def _sent(headers=None, **_):
        if isinstance(headers, dict):
            headers.setdefault("chorus_sent_at", time.time())

    @task_prerun.connect(weak=False)
    def _prerun(task_id=None, task=None, **_):
        started[task_id] = time.monotonic()
        request = getattr(task, "request", None)
        sent = getattr(request, "chorus_sent_at", None) or (getattr(request, "headers", None) or {}).get(
            "chorus_sent_at")
        if isinstance(sent, (int, float)):
            eta = getattr(request, "eta", None)
            since = sent
            if eta:  # an ETA task waits by design: its latency counts from its ETA
                try:
                    from datetime import datetime

                    since = max(sent, datetime.fromisoformat(str(eta)).timestamp())
                except ValueError:
                    pass
            CELERY_TASK_QUEUE_SECONDS.labels(task.name).observe(max(0.0, time.time() - since))

    @task_postrun.connect(weak=False)
    def _postrun(task_id=None, task=None, state=None, **_):
        begun = started.pop(task_id, None)
        if begun is not None and task is not None:
            CELERY_TASK_SECONDS.labels(task.name, str(state or "unknown").lower()).observe(time.monotonic() - begun)

    @worker_process_shutdown.connect(weak=False)
    def _gone(pid=None, **_):
        if multiprocess():
            from prometheus_client import multiprocess as mp

            mp.mark_process_dead(pid or os.getpid())

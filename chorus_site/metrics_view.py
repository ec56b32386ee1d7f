"""``GET /metrics`` for Prometheus (issue 12 item 3; chorus_site/metrics.py, docs/alerts.md).

It sits on the top floor with urls.py: it gathers the collectors of every app.
"""

from __future__ import annotations

from django.http import HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from executions.metrics import ExecutionsCollector
from sessions_app.metrics import SessionsCollector

from . import metrics


def _happenings() -> bytes:
    """Counters and histograms: summed over the host's processes in multiprocess mode."""
    if metrics.multiprocess():
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(REGISTRY)


def _state() -> bytes:
    """Gauges read from the database now: the same from every process."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SessionsCollector())
    registry.register(ExecutionsCollector())
    return generate_latest(registry)


@require_GET
def metrics_view(request):
    refusal = metrics.scrape_refusal(request)
    if refusal is not None:
        status, reason = refusal
        response = HttpResponse(reason + "\n", status=status, content_type="text/plain; charset=utf-8")
        if status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(_happenings() + _state(), content_type=CONTENT_TYPE_LATEST)

"""executions' part of /metrics (issue 12 item 3): runs by state, read at scrape time."""

from __future__ import annotations

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily

from .models import Run


class ExecutionsCollector:
    def collect(self):
        runs = GaugeMetricFamily("chorus_runs", "Runs by state (final states included)", labels=["state"])
        for row in Run.objects.values("state").annotate(n=Count("pk")).order_by():
            runs.add_metric([row["state"]], row["n"])
        yield runs

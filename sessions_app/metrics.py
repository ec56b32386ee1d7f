"""sessions_app's part of /metrics (issue 12 item 3; chorus_site/metrics.py says which kind is where).

``SessionsCollector`` reads the state from the database at scrape time; the ``*_observed`` helpers
count what happened, after the commit of the change (a rolled-back change counts nothing), and
never raise: a metric must not fail the service that records it.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import Count
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from chorus_site import metrics
from chorus_site.models import Event

from . import states
from .models import Connection, ControlCommand, Turn

log = logging.getLogger(__name__)


class SessionsCollector:
    """Turns, stalled turns, connections and commands as they stand, read at scrape time."""

    def collect(self):
        turns = GaugeMetricFamily("chorus_turns", "Turns not yet final, by status and backend",
                                  labels=["status", "backend"])
        for row in (Turn.objects.filter(status__in=sorted(states.TURN_ACTIVE))
                    .values("status", "session__backend").annotate(n=Count("pk")).order_by()):
            turns.add_metric([row["status"], row["session__backend"]], row["n"])
        yield turns

        stalled = GaugeMetricFamily("chorus_turns_stalled", "Running turns flagged stalled, by backend",
                                    labels=["backend"])
        for row in (Turn.objects.filter(status=states.RUNNING, stalled_at__isnull=False)
                    .values("session__backend").annotate(n=Count("pk")).order_by()):
            stalled.add_metric([row["session__backend"]], row["n"])
        yield stalled

        unconfirmed = GaugeMetricFamily("chorus_stops_unconfirmed",
                                        "Turns whose stop is unconfirmed (a process may survive)")
        unconfirmed.add_metric([], Turn.objects.filter(stop_state=states.STOP_UNCONFIRMED).count())
        yield unconfirmed

        connections = GaugeMetricFamily("chorus_connections", "Connections by status and backend",
                                        labels=["status", "backend"])
        for row in Connection.objects.values("status", "backend").annotate(n=Count("pk")).order_by():
            connections.add_metric([row["status"], row["backend"]], row["n"])
        yield connections

        age = GaugeMetricFamily("chorus_connection_heartbeat_age_seconds",
                                "Seconds since each connection's last daemon heartbeat",
                                labels=["connection", "status"])
        now = timezone.now()
        for name, status, beat in Connection.objects.exclude(last_heartbeat_at=None).values_list(
                "name", "status", "last_heartbeat_at"):
            age.add_metric([name, status], max(0.0, (now - beat).total_seconds()))
        yield age

        commands = GaugeMetricFamily("chorus_commands_undelivered",
                                     "Control commands not yet acked by their daemon, by action",
                                     labels=["action"])
        for row in (ControlCommand.objects.filter(state__in=[states.CMD_PENDING, states.CMD_DELIVERED])
                    .values("action").annotate(n=Count("pk")).order_by()):
            commands.add_metric([row["action"]], row["n"])
        yield commands


# ---------------------------------------------------------------- happenings (after commit)
def _after_commit(fn, *args):
    def run():
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 — a metric never fails the change it counts
            log.warning("metric %s failed", fn.__name__, exc_info=True)

    transaction.on_commit(run)


def turn_status_observed(turn_id, status: str) -> None:
    if status in states.TURN_TERMINAL:
        _after_commit(_turn_finished, turn_id)


def _turn_finished(turn_id) -> None:
    row = Turn.objects.filter(pk=turn_id).values("status", "interrupted_reason", "session__backend",
                                                  "wake_error").first()
    if row is None:
        return
    backend = row["session__backend"]
    metrics.TURNS_FINISHED.labels(row["status"], row["interrupted_reason"] or "", backend).inc()
    if row["wake_error"]:
        metrics.WAKE_ERRORS.labels(str(row["wake_error"].get("kind") or "unknown"), backend).inc()


def stop_state_observed(turn_id, stop_state: str | None) -> None:
    if stop_state in {states.STOP_CONFIRMED, states.STOP_UNCONFIRMED}:
        _after_commit(_stop_settled, turn_id, stop_state)


def _stop_settled(turn_id, stop_state: str) -> None:
    metrics.INTERRUPTS.labels(stop_state).inc()
    if stop_state != states.STOP_CONFIRMED:
        return
    session_id = Turn.objects.filter(pk=turn_id).values_list("session_id", flat=True).first()
    requested = (Event.objects.filter(stream=f"session:{session_id}", kind="turn.stop_state", data__id=str(turn_id),
                                      data__stop_state=states.STOP_REQUESTED)
                 .order_by("-id").values_list("at", flat=True).first())
    if requested is not None:  # a pending turn stopped at once had no request to wait on
        metrics.INTERRUPT_CONFIRM_SECONDS.observe(max(0.0, (timezone.now() - requested).total_seconds()))


def command_state_observed(command_id, state: str) -> None:
    if state == states.CMD_ACKED:
        _after_commit(_command_acked, command_id)


def _command_acked(command_id) -> None:
    row = ControlCommand.objects.filter(pk=command_id).values("action", "created_at", "acked_at").first()
    if row and row["acked_at"]:
        metrics.COMMAND_DELIVERY_SECONDS.labels(row["action"]).observe(
            max(0.0, (row["acked_at"] - row["created_at"]).total_seconds()))


def stall_observed(backend: str) -> None:
    _after_commit(metrics.STALLS.labels(backend).inc)


def events_ingested(count: int) -> None:
    if count:
        _after_commit(metrics.EVENTS_INGESTED.inc, count)

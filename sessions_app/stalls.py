"""Stall detection (issue 12 item 1): a running turn that nothing has come from for a while.

A turn is *stalled* when it is ``running``, no stop is under way, and nothing came from it — no
output, tool event or progress line (``turn.output``), no status change — for its threshold: the
connection's ``stall_threshold_s``, else its backend's (``BackendSetting``), else
``settings.CHORUS_STALL_THRESHOLD_S`` (10 min).  Stalled is a flag with evidence
(``Turn.stalled_at`` / ``stall_evidence``), never a status: the turn stays ``running`` and the flag
clears by itself when output resumes (``turn_output_resumed``, called by the events report) or the
turn leaves ``running`` (the sweep).  Each change is one event: ``turn.stalled`` / ``turn.unstalled``.

Evidence: when it last printed, its last tool call, and the daemon's latest process sample from the
heartbeat (``Connection.turn_activity``): ``waiting_on_child`` (idle, a child alive: a tool blocks),
``silent`` (idle, no child) or ``busy`` (using CPU), with the children's command lines — redacted
by the daemon (agents/redaction_rules.py) and again here before storage.

Locks follow the house order (session → turn → event stream), as every writer of a turn.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.db.models import CharField, OuterRef, Subquery, Value
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, Concat, Greatest
from django.utils import timezone

from chorus_site.events import event_append
from chorus_site.models import Event
from chorus_site.redaction import ingest, redact_data

from . import metrics, services, states
from .models import BackendSetting, Connection, Turn

# What counts as something coming from a turn (its own events on its session's stream).
ACTIVITY_KINDS = ("turn.output", "turn.status", "turn.reconciled")
CHILDREN_MAX = 20
CMDLINE_MAX = 500


# ---------------------------------------------------------------- thresholds
def stall_threshold_s(connection: Connection, backend_thresholds: dict[str, int] | None = None) -> int:
    """The connection's own threshold, else its backend's, else the site default."""
    if connection.stall_threshold_s:
        return connection.stall_threshold_s
    if backend_thresholds is None:
        backend_thresholds = backend_stall_thresholds()
    return backend_thresholds.get(connection.backend) or settings.CHORUS_STALL_THRESHOLD_S


def backend_stall_thresholds() -> dict[str, int]:
    return dict(BackendSetting.objects.values_list("backend", "stall_threshold_s"))


# ---------------------------------------------------------------- the daemon's samples
def connection_store_activity(*, connection_id, activity: list[dict]) -> None:
    """Keep the heartbeat's process samples of the connection's running turns (replacing the last)."""
    now = timezone.now().isoformat()
    samples = {}
    for item in ingest(activity):  # the daemon redacted them; stored text is redacted here again
        sample = {k: v for k, v in item.items() if k != "turn"}
        sample["children"] = [{"pid": c.get("pid"), "cmdline": str(c.get("cmdline") or "")[:CMDLINE_MAX]}
                              for c in (item.get("children") or [])[:CHILDREN_MAX]]
        sample["sampled_at"] = now
        samples[str(item["turn"])] = sample
    query = Connection.objects.filter(pk=connection_id)
    if not samples:
        query = query.exclude(turn_activity={})  # nothing runs: one write when the last turn leaves
    query.update(turn_activity=samples)


# ---------------------------------------------------------------- reading
def _own_events(kinds):
    """The turn's own events (``data.id`` is the turn) on its session's stream, newest first."""
    return (Event.objects.filter(stream=Concat(Value("session:"), Cast(OuterRef("session_id"), CharField())),
                                 kind__in=kinds)
            .alias(turn_ref=KeyTextTransform("id", "data"))
            .filter(turn_ref=Cast(OuterRef("pk"), CharField())).order_by("-id"))


def running_with_activity():
    """Running turns with ``last_activity_at``: their newest own event, else when they started."""
    started = Coalesce("started_at", "created_at")
    return (Turn.objects.filter(status=states.RUNNING)
            .annotate(last_activity_at=Greatest(Coalesce(Subquery(_own_events(ACTIVITY_KINDS).values("at")[:1]),
                                                         started), started))
            .select_related("connection", "session__connection"))


def _last_output(turn: Turn) -> tuple[str | None, dict | None]:
    """When the turn last printed anything, and its last tool call ({name, input, at})."""
    outputs = Event.objects.filter(stream=turn.stream, kind="turn.output", data__id=str(turn.pk)).order_by("-id")
    last = outputs.values_list("at", flat=True).first()
    tool = outputs.filter(data__type="tool").values("at", "data").first()
    call = None
    if tool is not None:
        data = (tool["data"] or {}).get("data") or {}
        call = redact_data({"name": data.get("name"), "input": data.get("input"), "at": tool["at"].isoformat()})
    return (last.isoformat() if last else None), call


def evidence_for(turn: Turn, *, threshold_s: int, now) -> dict:
    connection = turn.connection or turn.session.connection
    last_output_at, last_tool_call = _last_output(turn)
    sample = (connection.turn_activity or {}).get(str(turn.pk))
    return ingest({
        "basis": "no_output", "threshold_s": threshold_s, "detected_at": now.isoformat(),
        "last_activity_at": turn.last_activity_at.isoformat(),
        "silent_s": round((now - turn.last_activity_at).total_seconds(), 1),
        "last_output_at": last_output_at, "last_tool_call": last_tool_call,
        "connection": str(connection.pk),
        # The daemon's word on the process tree (None: no heartbeat sample of this turn yet).
        "process_state": (sample or {}).get("state"), "process": sample,
    })


# ---------------------------------------------------------------- writers
def turn_flag_stalled(*, turn_id, evidence: dict, now=None) -> bool:
    """Flag a running, unflagged turn stalled with its evidence; False if it changed meanwhile."""
    now = now or timezone.now()
    with transaction.atomic():
        turn = services.turn_lock(turn_id)  # session → turn
        if (turn is None or turn.status != states.RUNNING or turn.stalled_at is not None
                or turn.stop_state != states.STOP_NONE):
            return False
        Turn.objects.filter(pk=turn.pk).update(stalled_at=now, stall_evidence=evidence)
        event_append(stream=turn.stream, kind="turn.stalled", data={
            "id": str(turn.pk), "session": str(turn.session_id), "stalled": "stalled",
            "threshold_s": evidence.get("threshold_s"), "silent_s": evidence.get("silent_s"),
            "process_state": evidence.get("process_state")})
        metrics.stall_observed(turn.session.backend)
    return True


def turn_unstall(*, turn_id, basis: str, now=None) -> bool:
    """Clear a turn's stall flag (``basis``: output, status, stop); its evidence stays, marked cleared."""
    now = now or timezone.now()
    with transaction.atomic():
        turn = services.turn_lock(turn_id)  # session → turn, before the stream's counter
        if turn is None or turn.stalled_at is None:
            return False
        evidence = {**(turn.stall_evidence or {}), "cleared_at": now.isoformat(), "cleared_by": basis}
        Turn.objects.filter(pk=turn.pk).update(stalled_at=None, stall_evidence=evidence)
        event_append(stream=turn.stream, kind="turn.unstalled", data={
            "id": str(turn.pk), "session": str(turn.session_id), "stalled": "not_stalled", "basis": basis,
            "stalled_for_s": round((now - turn.stalled_at).total_seconds(), 1)})
    return True


def turn_output_resumed(turn: Turn) -> None:
    """Called by the events report before it appends: output from a stalled turn clears the flag.
    Free for a turn that is not stalled (the report already read the row)."""
    if turn.stalled_at is not None:
        turn_unstall(turn_id=turn.pk, basis="output")


def turns_sweep_stalled(*, now=None) -> dict:
    """Flag running turns silent past their threshold; clear flags that no longer hold (the turn
    left running, a stop began, or something came from it that the events hook did not see)."""
    now = now or timezone.now()
    thresholds = backend_stall_thresholds()
    flagged = cleared = 0
    for turn in running_with_activity().filter(stop_state=states.STOP_NONE, stalled_at__isnull=True):
        threshold = stall_threshold_s(turn.connection or turn.session.connection, thresholds)
        if (now - turn.last_activity_at).total_seconds() < threshold:
            continue
        if turn_flag_stalled(turn_id=turn.pk, evidence=evidence_for(turn, threshold_s=threshold, now=now), now=now):
            flagged += 1
    for turn_id in Turn.objects.filter(stalled_at__isnull=False).exclude(
            status=states.RUNNING, stop_state=states.STOP_NONE).values_list("pk", flat=True):
        cleared += turn_unstall(turn_id=turn_id, basis="status", now=now)
    refreshed = 0
    for turn in running_with_activity().filter(stalled_at__isnull=False):
        if turn.last_activity_at > turn.stalled_at:
            cleared += turn_unstall(turn_id=turn.pk, basis="output", now=now)
        else:
            refreshed += _evidence_refresh(turn, now=now)
    return {"stalled_flagged": flagged, "stalled_cleared": cleared, "stalled_refreshed": refreshed}


def _evidence_refresh(turn: Turn, *, now) -> int:
    """A stalled turn's evidence follows the daemon's newer samples (a heartbeat may come after the
    flag): how long it has been silent, and what its processes do now.  No event: the flag is unchanged."""
    sample = ((turn.connection or turn.session.connection).turn_activity or {}).get(str(turn.pk))
    evidence = turn.stall_evidence or {}
    if not sample or sample.get("sampled_at") == (evidence.get("process") or {}).get("sampled_at"):
        return 0
    evidence = ingest({**evidence, "process": sample, "process_state": sample.get("state"),
                       "silent_s": round((now - turn.last_activity_at).total_seconds(), 1)})
    # Conditional: a flag cleared (or re-set) meanwhile is not overwritten.
    return Turn.objects.filter(pk=turn.pk, stalled_at=turn.stalled_at).update(stall_evidence=evidence)


"""Which rules a happening matches, and the deliveries it makes (issue 12 item 2).

Happenings come from the event log, read in order from a cursor by a periodic scan (so nothing is
missed while a worker is down, and nothing is sent for a change that rolled back): a turn that
ended with a wake error (``turn.status``), a turn flagged stalled (``turn.stalled``), a stop
marked unconfirmed (``turn.stop_state``), a run that failed or partially succeeded
(``run.state``), a daemon key used from another host (``connection.new_host``).  "Connection
offline", "approval waiting" and "turn waiting for an answer" longer than N are states, read at
each scan.

The quiet period counts per rule and per *subject*: the session for turn rules (a session whose
every turn fails on a refused key notifies once per period), the connection, the run.  A
happening inside the period is logged as ``suppressed``, never silently dropped.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import CharField, OuterRef, Subquery, Value
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, Concat
from django.urls import reverse
from django.utils import timezone

from chorus_site.models import Event
from chorus_site.redaction import redact_data
from executions.models import Approval, Attempt, Issue, Run
from sessions_app import states as ss
from sessions_app.models import Connection, Turn

from . import models as m
from .models import NotificationCursor, NotificationDelivery, NotificationRule

SCAN_KINDS = ("turn.status", "turn.stalled", "turn.stop_state", "run.state", "connection.new_host")
SCAN_BATCH = 1000
CURSOR = "events"


def _link(name: str, pk) -> str:
    return settings.CHORUS_PUBLIC_URL.rstrip("/") + reverse(name, args=[pk])


def _turn_facts(turn_id) -> dict | None:
    turn = Turn.objects.select_related("session", "connection").filter(pk=turn_id).first()
    if turn is None:
        return None
    connection_id = turn.connection_id or turn.session.connection_id
    return {"turn": turn, "subject": f"session:{turn.session_id}", "about": f"turn:{turn.pk}",
            "connection_id": connection_id, "backend": turn.session.backend, "workflow": _workflow_of(turn),
            "url": _link("admin:sessions_app_turn_change", turn.pk),
            "facts": {"turn": str(turn.pk), "session": str(turn.session_id), "seq": turn.seq,
                      "connection": str(connection_id), "backend": turn.session.backend, "status": turn.status_label}}


def _workflow_of(turn: Turn) -> str:
    """The workflow of the run whose attempt the turn executes ("" for a turn of no run)."""
    if not turn.attempt_id:
        return ""
    attempt = (Attempt.objects.select_related("task__node__run__workflow_revision__workflow")
               .filter(pk=turn.attempt_id).first())
    revision = attempt.task.node.run.workflow_revision if attempt is not None else None
    return revision.workflow.name if revision is not None else ""


def happenings_of(event: Event) -> list[dict]:
    data = event.data or {}
    if event.kind == "turn.status" and data.get("status") == ss.INTERRUPTED \
            and data.get("interrupted_reason") in ss.WAKE_ERROR_REASONS:
        found = _turn_facts(data.get("id"))
        if not found or not found["turn"].wake_error:
            return []
        wake = found["turn"].wake_error
        found.update(trigger=m.TURN_FAILED, kind=wake.get("kind") or "",
                     summary=f"Turn {found['turn'].seq} of session {found['turn'].session} failed: "
                             f"{wake.get('kind')}: {wake.get('summary')}")
        found["facts"]["wake_error"] = {"kind": wake.get("kind"), "summary": wake.get("summary")}
        return [found]
    if event.kind == "turn.stalled":
        found = _turn_facts(data.get("id"))
        if not found:
            return []
        found.update(trigger=m.TURN_STALLED, kind="",
                     summary=f"Turn {found['turn'].seq} of session {found['turn'].session} is stalled: nothing from "
                             f"it for {data.get('silent_s')} s ({data.get('process_state') or 'no process sample'})")
        found["facts"]["stall"] = {k: data.get(k) for k in ("threshold_s", "silent_s", "process_state")}
        return [found]
    if event.kind == "turn.stop_state" and data.get("stop_state") == ss.STOP_UNCONFIRMED:
        found = _turn_facts(data.get("id"))
        if not found:
            return []
        found.update(trigger=m.STOP_UNCONFIRMED, kind="",
                     summary=f"The stop of turn {found['turn'].seq} of session {found['turn'].session} is unconfirmed: "
                             "a process of the agent may still run")
        return [found]
    if event.kind == "connection.new_host":
        connection = Connection.objects.filter(pk=data.get("id")).first()
        if connection is None:
            return []
        return [{"trigger": m.NEW_HOST, "kind": "", "subject": f"connection:{connection.pk}",
                 "about": f"connection:{connection.pk}", "connection_id": connection.pk,
                 "backend": connection.backend, "workflow": "",
                 "url": _link("admin:sessions_app_connection_change", connection.pk),
                 "summary": f"The key of connection {connection.name} was used from {data.get('host')} "
                            f"(before: {data.get('previous_host')})",
                 "facts": {"connection": str(connection.pk), "name": connection.name, "host": data.get("host"),
                           "previous_host": data.get("previous_host")}}]
    if event.kind == "run.state" and data.get("state") in {"failed", "partial_succeeded"}:
        run = Run.objects.select_related("workflow_revision__workflow", "issue").filter(pk=data.get("id")).first()
        if run is None:
            return []
        workflow = run.workflow_revision.workflow.name if run.workflow_revision_id else ""
        return [{"trigger": m.RUN_FAILED, "kind": "", "subject": f"run:{run.pk}", "about": f"run:{run.pk}",
                 "connection_id": None, "backend": "", "workflow": workflow,
                 "url": _link("admin:executions_run_change", run.pk),
                 "summary": f"Run {run.pk} {'of ' + workflow + ' ' if workflow else ''}ended {data.get('state')}",
                 "facts": {"run": str(run.pk), "state": data.get("state"), "workflow": workflow}}]
    return []


def offline_happenings(rule: NotificationRule, now) -> list[dict]:
    cutoff = now - timedelta(seconds=rule.older_than_s)
    out = []
    for connection in Connection.objects.filter(status=ss.CONN_OFFLINE).exclude(last_heartbeat_at__gt=cutoff):
        seen = connection.last_heartbeat_at.isoformat() if connection.last_heartbeat_at else None
        out.append({"trigger": m.CONNECTION_OFFLINE, "kind": "", "subject": f"connection:{connection.pk}",
                    "about": f"connection:{connection.pk}", "connection_id": connection.pk,
                    "backend": connection.backend, "workflow": "",
                    "url": _link("admin:sessions_app_connection_change", connection.pk),
                    "summary": f"Connection {connection.name} has been offline since {seen or 'it was registered'}",
                    "facts": {"connection": str(connection.pk), "name": connection.name, "last_heartbeat_at": seen}})
    return out


def approval_happenings(rule: NotificationRule, now) -> list[dict]:
    cutoff = now - timedelta(seconds=rule.older_than_s)
    out = []
    for approval in (Approval.objects.filter(status="pending", created_at__lte=cutoff)
                     .select_related("node__run__workflow_revision__workflow")):
        run = approval.node.run if approval.node_id else None
        workflow = run.workflow_revision.workflow.name if run is not None and run.workflow_revision_id else ""
        out.append({"trigger": m.APPROVAL_WAITING, "kind": "", "subject": f"approval:{approval.pk}",
                    "about": f"approval:{approval.pk}", "connection_id": None, "backend": "", "workflow": workflow,
                    "url": _link("admin:executions_approval_change", approval.pk),
                    "summary": f"An approval has waited since {approval.created_at.isoformat()}: "
                               f"{approval.prompt[:200]}",
                    "facts": {"approval": str(approval.pk), "run": str(run.pk) if run else None,
                              "workflow": workflow, "waiting_since": approval.created_at.isoformat()}})
    return out


def answer_happenings(rule: NotificationRule, now) -> list[dict]:
    """Turns in requires_action since before the cutoff (since: their newest turn.status event there)."""
    cutoff = now - timedelta(seconds=rule.older_than_s)
    since = (Event.objects.filter(stream=Concat(Value("session:"), Cast(OuterRef("session_id"), CharField())),
                                  kind="turn.status", data__status=ss.REQUIRES_ACTION)
             .alias(turn_ref=KeyTextTransform("id", "data")).filter(turn_ref=Cast(OuterRef("pk"), CharField()))
             .order_by("-id").values("at")[:1])
    out = []
    for turn in (Turn.objects.filter(status=ss.REQUIRES_ACTION).annotate(waiting_since=Subquery(since))
                 .filter(waiting_since__lte=cutoff).values_list("pk", "waiting_since")):
        found = _turn_facts(turn[0])
        if not found:
            continue
        items = (found["turn"].requires_action or {}).get("items") or []
        found.update(trigger=m.ANSWER_WAITING, kind="",
                     summary=f"Turn {found['turn'].seq} of session {found['turn'].session} has waited for an answer "
                             f"since {turn[1].isoformat()}: " + "; ".join(str(i.get("text"))[:100] for i in items[:3]))
        found["facts"]["waiting_since"] = turn[1].isoformat()
        out.append(found)
    return out


def review_happenings(rule: NotificationRule, now) -> list[dict]:
    """Issues in review since before the cutoff (since: their newest issue.status event to in_review;
    an issue put there without one counts from its last change).  Workflow: of its newest run."""
    cutoff = now - timedelta(seconds=rule.older_than_s)
    since = (Event.objects.filter(stream=Concat(Value("issue:"), Cast(OuterRef("pk"), CharField())),
                                  kind="issue.status", data__status="in_review").order_by("-id").values("at")[:1])
    newest_run = Run.objects.filter(issue=OuterRef("pk")).order_by("-id")
    out = []
    for issue in (Issue.objects.filter(status="in_review")
                  .annotate(waiting_since=Coalesce(Subquery(since), "updated_at"),
                            run_id=Subquery(newest_run.values("pk")[:1]),
                            workflow=Subquery(newest_run.values("workflow_revision__workflow__name")[:1]))
                  .filter(waiting_since__lte=cutoff)):
        workflow = issue.workflow or ""
        out.append({"trigger": m.REVIEW_WAITING, "kind": "", "subject": f"issue:{issue.pk}",
                    "about": f"issue:{issue.pk}", "connection_id": None, "backend": "", "workflow": workflow,
                    "url": _link("admin:executions_issue_change", issue.pk),
                    "summary": f"Issue {issue.title[:150]} has waited for review since {issue.waiting_since.isoformat()}",
                    "facts": {"issue": str(issue.pk), "title": issue.title[:200], "workflow": workflow,
                              "run": str(issue.run_id) if issue.run_id else None,
                              "waiting_since": issue.waiting_since.isoformat()}})
    return out


STATE_HAPPENINGS = {m.CONNECTION_OFFLINE: offline_happenings, m.APPROVAL_WAITING: approval_happenings,
                    m.ANSWER_WAITING: answer_happenings, m.REVIEW_WAITING: review_happenings}


def rule_matches(rule: NotificationRule, happening: dict) -> bool:
    if not rule.enabled or rule.trigger != happening["trigger"]:
        return False
    if rule.trigger == m.TURN_FAILED and rule.wake_error_kind and rule.wake_error_kind != happening["kind"]:
        return False
    if rule.connection_id and rule.connection_id != happening["connection_id"]:
        return False
    if rule.backend and rule.backend != happening["backend"]:
        return False
    if rule.workflow and rule.workflow != happening["workflow"]:
        return False
    return True


def payload_of(rule: NotificationRule, happening: dict, *, event_id, now) -> dict:
    """What every channel sends: redacted (rule names and summaries may quote agent text)."""
    return redact_data({"rule": rule.name, "trigger": rule.trigger, "about": happening["about"],
                        "subject": happening["subject"], "summary": happening["summary"], "url": happening["url"],
                        "facts": happening["facts"], "event_id": event_id, "at": now.isoformat()})


def deliveries_create(rule: NotificationRule, happening: dict, *, event_id=None, now=None,
                      log_suppressed: bool = True) -> list[NotificationDelivery]:
    """One delivery per channel of the rule; inside the rule's quiet period for this subject they
    are recorded ``suppressed`` (a state re-read at every scan, ``log_suppressed=False``, is not
    logged again each time).  Call inside a transaction that locked the rule (no double send)."""
    now = now or timezone.now()
    payload = payload_of(rule, happening, event_id=event_id, now=now)
    quiet = NotificationDelivery.objects.filter(
        rule=rule, subject=happening["subject"], created_at__gte=now - timedelta(seconds=rule.quiet_period_s),
        state__in=[NotificationDelivery.PENDING, NotificationDelivery.SENT, NotificationDelivery.FAILED]).exists()
    if quiet and not log_suppressed:
        return []
    channels = ([(NotificationDelivery.EMAIL, ", ".join(rule.emails()))] if rule.emails() else []) + \
        ([(NotificationDelivery.WEBHOOK, rule.webhook_url)] if rule.webhook_url else [])
    made = []
    for channel, target in channels:
        made.append(NotificationDelivery.objects.create(
            rule=rule, subject=happening["subject"], about=happening["about"], channel=channel, target=target,
            payload=payload, event_id=event_id,
            state=NotificationDelivery.SUPPRESSED if quiet else NotificationDelivery.PENDING,
            reason=f"quiet period: {happening['subject']} was notified by this rule in the last "
                   f"{rule.quiet_period_s} s" if quiet else "",
            finished_at=now if quiet else None))
    return made


def notifications_scan(*, now=None) -> dict:
    """Read new events from the cursor, match every enabled rule, create deliveries and send them
    after commit; check the offline rules.  Safe to run twice at once (the cursor row is locked)."""
    from .tasks import notification_deliver

    now = now or timezone.now()
    created: list[NotificationDelivery] = []
    with transaction.atomic():
        cursor, fresh = NotificationCursor.objects.select_for_update(no_key=True).get_or_create(
            name=CURSOR, defaults={"last_event_id": Event.objects.order_by("-id").values_list("id", flat=True).first()
                                   or 0})
        rules = list(NotificationRule.objects.select_for_update(no_key=True).filter(enabled=True))
        events = [] if fresh else list(Event.objects.filter(id__gt=cursor.last_event_id, kind__in=SCAN_KINDS)
                                       .order_by("id")[:SCAN_BATCH])
        if events and rules:
            for event in events:
                for happening in happenings_of(event):
                    for rule in rules:
                        if rule_matches(rule, happening):
                            created += deliveries_create(rule, happening, event_id=event.id, now=now)
        for rule in rules:
            if rule.trigger in STATE_HAPPENINGS:
                for happening in STATE_HAPPENINGS[rule.trigger](rule, now):
                    if rule_matches(rule, happening):
                        created += deliveries_create(rule, happening, now=now, log_suppressed=False)
        if events:
            NotificationCursor.objects.filter(pk=CURSOR).update(last_event_id=events[-1].id)
        pending = [d.pk for d in created if d.state == NotificationDelivery.PENDING]
        transaction.on_commit(lambda: [notification_deliver.delay(pk) for pk in pending])
    return {"events": len(events), "deliveries": len(created), "pending": len(pending)}

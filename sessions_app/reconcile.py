"""The daemon's snapshot is the truth about the processes it holds (SPEC §11, §3.1 ``last_snapshot``).

The portal settles a running turn ``interrupted(offline)`` when its daemon's heartbeat goes stale:
a guess, made while the daemon may only be frozen (SIGSTOP), cut off, or waiting for a restarted
portal.  When the daemon that runs the turn says it still holds it — it lists the turn in its
snapshot or its heartbeat, or it reports on the turn — the turn is reopened (``running``, held by
its daemon) by one explicit, audited reconcile (``services.turn_reopen_held``); its reports are then
accepted as usual and an interrupt reaches it.

Pending work is reconciled the same way when a daemon comes back: a turn queued behind one that
was settled while the daemon was away is dispatched, and a turn whose start the daemon acked
before it died (it held the turn only in memory) is sent again — unless the daemon says it still
runs or queues it.  A daemon never starts a turn twice (it ignores a start for a turn it knows,
also one it has spooled reports of from an earlier run).
"""

from __future__ import annotations

import logging
import uuid

from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from chorus_site.audit import actor_name, audit_record
from chorus_site.errors import ApplicationError
from chorus_site.events import event_append

from . import selectors, services, states
from .actions import _start_command_of, session_dispatch, stop_ask
from .bridge import command_send
from .models import Connection, Session, Turn

log = logging.getLogger(__name__)

EVIDENCE_FIELDS = ("pid", "pgid", "started_at", "process_start_time")


def listed_turns(items) -> dict[str, dict]:
    """``{turn id: what the daemon said of it}`` from a snapshot (RunningTurn dicts) or a heartbeat (ids)."""
    listed = {}
    for item in items or []:
        raw = item.get("turn") if isinstance(item, dict) else item
        try:
            turn_id = str(uuid.UUID(str(raw)))
        except (TypeError, ValueError, AttributeError):
            continue
        listed[turn_id] = {k: item[k] for k in EVIDENCE_FIELDS if k in item} if isinstance(item, dict) else {}
    return listed


# ---------------------------------------------------------------- held turns
def _runner_id(turn: Turn):
    return turn.connection_id or turn.session.connection_id


def turn_reconcile_held(*, connection_id, turn_id, evidence: dict, ask_again: bool = False) -> bool:
    """Reopen an ``interrupted(offline)`` turn that the daemon running it says it holds; True if reopened."""
    turn = Turn.objects.select_related("session").filter(pk=turn_id).first()
    if turn is None or turn.status != states.INTERRUPTED or turn.interrupted_reason != states.REASON_OFFLINE:
        return False
    runner = _runner_id(turn)
    if runner != connection_id:
        # Only the daemon that runs the turn knows about its process (issue 7 item 9).
        log.warning("connection %s lists turn %s, which runs on %s; ignored", connection_id, turn.pk, runner)
        return False
    evidence = {**evidence, "connection": str(connection_id), "at": timezone.now().isoformat()}
    try:
        with transaction.atomic():
            services.turn_reopen_held(turn_id=turn.pk, evidence=evidence)
            audit_record(actor=None, action="turn.reconcile", target=f"turn:{turn.pk}",
                         outcome=f"reopened as running: its daemon holds it ({evidence['basis']})", client="daemon",
                         reason="the portal had settled it offline while its daemon was away")
    except ApplicationError as error:
        log.info("turn %s not reopened: %s", turn.pk, error.message)
        if error.code == "conflict":
            turn_stop_held(connection_id=connection_id, turn_id=turn.pk, evidence=evidence, refusal=error.message,
                           ask_again=ask_again)
        return False
    return True


def turn_stop_held(*, connection_id, turn_id, evidence: dict, refusal: str, ask_again: bool = False) -> bool:
    """The daemon holds a process of a settled turn that may not run again (``refusal``): tell it to
    stop it, explicitly and audited (issue 7 item 10: an interrupt always reaches a process a daemon
    says it holds).  The turn stays settled; its stop is ``requested`` until that daemon confirms, and
    ``unconfirmed`` past the deadline.  Once per settle: True if asked now.  ``ask_again`` (an
    operator's interrupt): a stop that went unconfirmed is asked again; never on a heartbeat alone."""
    with transaction.atomic():
        turn = services.turn_lock(turn_id, related=("session",))  # session → turn
        if turn is None or turn.status != states.INTERRUPTED or _runner_id(turn) != connection_id:
            return False
        if turn.stop_state != states.STOP_NONE and not (ask_again and turn.stop_state == states.STOP_UNCONFIRMED):
            return False  # already asked (each heartbeat lists the process until it is gone)
        again = turn.stop_state == states.STOP_UNCONFIRMED
        turn, deadline = stop_ask(turn, Connection.objects.get(pk=connection_id))
        event_append(stream=turn.stream, kind="turn.held_stop", actor=actor_name(None),
                     data={"id": str(turn.pk), "connection": str(connection_id), "not_reopened": refusal,
                           "evidence": evidence, "deadline": deadline.isoformat()})
        audit_record(actor=None, action="turn.reconcile", target=f"turn:{turn.pk}",
                     outcome=f"not reopened; its daemon is told {'again ' if again else ''}to stop its process",
                     client="daemon", reason=refusal)
    return True


def turns_reconcile_listed(*, connection_id, listed: dict[str, dict], basis: str, snapshot_at=None) -> list[str]:
    """Reopen every listed turn of this connection that the portal settled offline (one query if none).

    A listed turn settled otherwise without a stop (an operator marked it interrupted on a stale
    heartbeat: the daemon was frozen, its process lived on) is not reopened: the operator's settle is
    carried out on the process (turn_stop_held)."""
    if not listed:
        return []
    settled = Turn.objects.filter(pk__in=list(listed), status=states.INTERRUPTED).filter(
        Q(interrupted_reason=states.REASON_OFFLINE) | Q(stop_state=states.STOP_NONE)).values_list(
        "pk", "interrupted_reason")
    reopened = []
    for turn_id, reason in settled:
        evidence = {"basis": basis, **listed[str(turn_id)]}
        if snapshot_at:
            evidence["snapshot_at"] = snapshot_at
        if reason != states.REASON_OFFLINE:
            turn_stop_held(connection_id=connection_id, turn_id=turn_id, evidence=evidence,
                           refusal=f"it was settled interrupted({reason}) while its daemon still held it")
        elif turn_reconcile_held(connection_id=connection_id, turn_id=turn_id, evidence=evidence):
            reopened.append(str(turn_id))
    return reopened


def turn_reconcile_if_listed(*, turn: Turn, ask_again: bool = False) -> bool:
    """Before an interrupt: a settled turn its daemon's latest snapshot lists is reopened (offline), so
    the interrupt reaches the process, or its daemon is told to stop it (SPEC §4.1, issue 7 item 10),
    again if ``ask_again`` and that stop went unconfirmed.  True if reopened."""
    connection = selectors.turn_runner_connection(turn)
    snapshot = connection.last_snapshot or {}
    listed = listed_turns(snapshot.get("running"))
    if str(turn.pk) not in listed:
        return False
    evidence = {"basis": "snapshot", "snapshot_at": snapshot.get("at"), **listed[str(turn.pk)]}
    if turn.interrupted_reason != states.REASON_OFFLINE:
        turn_stop_held(connection_id=connection.pk, turn_id=turn.pk, evidence=evidence,
                       refusal=f"it was settled interrupted({turn.interrupted_reason}) while its daemon still held it",
                       ask_again=ask_again)
        return False
    return turn_reconcile_held(connection_id=connection.pk, turn_id=turn.pk, evidence=evidence, ask_again=ask_again)


# ---------------------------------------------------------------- pending turns
def connection_dispatch_pending(*, connection_id, held: set[str], queued: set[str] | None, linked_at) -> dict:
    """After a daemon's snapshot: dispatch what waits for it, send again what it lost.

    ``held``/``queued``: the turns it runs / has in its local queue.  A start acked on an earlier
    link (before ``linked_at``, the current hello) that it neither runs nor queues was lost with the
    daemon's memory (SIGKILL) and is sent again; ``queued`` None (a daemon that does not say) sends
    nothing again.
    """
    dispatched = []
    sessions = (Session.objects.filter(connection_id=connection_id, status=states.SESSION_ACTIVE,
                                       turns__status=states.PENDING).distinct().values_list("pk", flat=True))
    for session_id in sessions:
        try:
            with transaction.atomic():
                turn = session_dispatch(session_id=session_id)
        except ApplicationError:
            log.info("pending turn of %s not dispatched", session_id, exc_info=True)
            continue
        if turn is not None:
            dispatched.append(str(turn.pk))
    resent = []
    if queued is not None and linked_at is not None:
        for turn_id in Turn.objects.filter(connection_id=connection_id, status=states.PENDING).values_list(
                "pk", flat=True):
            if str(turn_id) in held or str(turn_id) in queued:
                continue
            if _start_again(connection_id=connection_id, turn_id=turn_id, linked_at=linked_at):
                resent.append(str(turn_id))
    return {"dispatched": dispatched, "resent": resent}


def _start_again(*, connection_id, turn_id, linked_at) -> bool:
    lost = _start_command_of(turn_id)
    if lost is None or lost.connection_id != connection_id or lost.state not in {
            states.CMD_ACKED, states.CMD_DONE, states.CMD_EXPIRED}:
        return False  # never sent (session_dispatch sends it), or still on its way (replayed until acked)
    if (lost.acked_at or lost.created_at) >= linked_at:
        return False  # taken by the daemon on its current link: it holds it in memory
    with transaction.atomic():
        turn = Turn.objects.select_related("session").get(pk=turn_id)
        Session.objects.select_for_update(no_key=True).filter(pk=turn.session_id).values("pk").first()
        turn.refresh_from_db(fields=["status"])
        latest = _start_command_of(turn_id)
        if turn.status != states.PENDING or latest is None or latest.pk != lost.pk:
            return False  # started, settled or sent again meanwhile
        if lost.state == states.CMD_ACKED:
            services.command_set_state(command_id=lost.pk, state=states.CMD_EXPIRED)
        command = command_send(connection_id=connection_id, action=lost.action, turn_id=turn_id,
                               payload=lost.payload)
        event_append(stream=turn.stream, kind="turn.redispatched",
                     data={"id": str(turn_id), "connection": str(connection_id), "lost_command": str(lost.pk),
                           "command": str(command.pk), "action": lost.action})
        audit_record(actor=None, action="turn.redispatch", target=f"turn:{turn_id}",
                     outcome="start sent again: its daemon acked it, then lost it", client="daemon")
    return True


def linked_at_of(snapshot: dict):
    value = (snapshot or {}).get("hello_at")
    return parse_datetime(value) if isinstance(value, str) else None


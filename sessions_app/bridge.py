"""The portal's side of the daemon bridge (SPEC §5): presence, control commands and reports.

Daemons authenticate with their connection key.  A daemon may report only on turns of its own
connection (SPEC §1 rule 6), may not report ``offline`` (the server's verdict), and every report
is applied once per report id.
"""

from __future__ import annotations

import hmac
import json
import logging
from datetime import timedelta

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection as db_connection, transaction
from django.db.models.expressions import RawSQL
from django.utils import timezone

from agents import protocol
from chorus_site import presence
from chorus_site.audit import actor_name, audit_record
from chorus_site.errors import ApplicationError
from chorus_site.events import event_append, events_append_many
from chorus_site.idempotency import idempotent_call
from chorus_site.redaction import StreamRedactor, ingest

from . import daemon_schemas, metrics, selectors, services, stalls, states
from .listeners import turn_env
from .models import Connection, ControlCommand, Session, Turn

log = logging.getLogger(__name__)

COMMAND_TTL = timedelta(hours=1)
# A pending turn has no process to lose, so it waits for its daemon longer than a running turn does:
# a daemon restarted (or a portal back) just after the sweep settled its running turns still gets its
# queued work (sessions_app.reconcile dispatches or re-sends it from the daemon's snapshot).  Past
# this many heartbeat thresholds it is settled, so it never stays pending forever (issue 7 item 6).
PENDING_GRACE_FACTOR = 3
STOPS_UNDER_WAY = {states.STOP_REQUESTED, states.STOP_SIGNALLED, states.STOP_ESCALATED}


def daemon_group(connection_id) -> str:
    return f"daemon.{connection_id}"


# ---------------------------------------------------------------- authentication
def connection_authenticate(key: str | None) -> Connection | None:
    """The connection whose key this is (``chk_<prefix>_<secret>``), or None."""
    parts = (key or "").strip().split("_", 2)
    if len(parts) != 3 or parts[0] != "chk":
        return None
    connection = Connection.objects.filter(key_prefix=parts[1]).first()
    if connection is None:
        return None
    if not hmac.compare_digest(connection.key_hash, services.connection_key_hash(key.strip())):
        return None
    return connection


# ---------------------------------------------------------------- presence
def connection_daemon_connected(*, connection_id, hello: dict) -> Connection:
    hello = ingest(hello)  # daemon text: storable and redacted before it is stored (issue 8)
    now = timezone.now()
    fields = {
        "last_heartbeat_at": now,
        "daemon_version": str(hello.get("version", ""))[:32],
        "capabilities": {k: hello.get(k) for k in ("backends", "cwds", "max_concurrency", "sigint_timeout_s", "spool")
                         if k in hello},
    }
    if hello.get("host"):
        fields["host"] = str(hello["host"])[:255]
    # A new link: its snapshot follows.  A start acked before this moment was taken by an earlier
    # link, possibly by a daemon that died since (sessions_app.reconcile).
    fields["last_snapshot"] = {"hello_at": now.isoformat()}
    with transaction.atomic():
        connection = Connection.objects.select_for_update(no_key=True).get(pk=connection_id)
        if fields.get("host") and connection.host and fields["host"] != connection.host:
            # The key is used from another machine than the last one (a notification trigger, issue 12).
            event_append(stream=f"connection:{connection_id}", kind="connection.new_host",
                         data={"id": str(connection_id), "host": fields["host"], "previous_host": connection.host})
        if connection.status == states.CONN_OFFLINE:
            connection = services.connection_set_status(connection_id=connection_id, status=states.CONN_ONLINE,
                                                        **fields)
        else:
            Connection.objects.filter(pk=connection_id).update(**fields)
            event_append(stream=f"connection:{connection_id}", kind="connection.hello",
                         data={"id": str(connection_id), "version": fields["daemon_version"]})
            connection = Connection.objects.get(pk=connection_id)
    if connection.auto_resume_crashed:
        sessions_auto_resume_crashed(connection=connection)
    return connection


def sessions_auto_resume_crashed(*, connection: Connection) -> list[str]:
    """On reconnect, resume (once) each session whose latest turn crashed, if the connection says so.

    User interrupts never resume by themselves (SPEC §4.3); a crashed resume is not resumed again.
    """
    from .actions import session_resume

    resumed = []
    for session in Session.objects.filter(connection=connection, status=states.SESSION_ACTIVE):
        last = session.turns.order_by("-seq").first()
        if (last is None or last.status != states.INTERRUPTED or last.interrupted_reason != states.REASON_CRASH
                or last.trigger == "resume"):
            continue
        try:
            answer = session_resume(actor=None, session_id=session.pk, client="system",
                                    reason="automatic resume of a crashed turn after the daemon reconnected")
        except ApplicationError:
            continue
        resumed.append(answer["turn"])
    return resumed


def _with_spool_health(spool: dict | None) -> dict:
    """The UPDATE fields that keep a daemon's spool health (``capabilities["spool"]``, merged in one
    statement: a heartbeat must not overwrite what a concurrent hello stored)."""
    if spool is None:
        return {}
    if db_connection.vendor == "sqlite":  # embedded mode (make run): SQLite has no jsonb ``||``
        return {"capabilities": RawSQL("json_set(COALESCE(capabilities, '{}'), '$.spool', json(%s))",
                                       [json.dumps(spool)])}
    return {"capabilities": RawSQL("COALESCE(capabilities, '{}'::jsonb) || %s::jsonb",
                                   [json.dumps({"spool": spool})])}


def connection_store_spool_health(*, connection_id, spool: dict) -> None:
    """What the daemon's report spool holds (queued, parked refusals, oldest age): the connection's
    page shows it, so a report the portal refused is never lost from sight (issue 7 item 3)."""
    Connection.objects.filter(pk=connection_id).update(**_with_spool_health(spool))


def connection_seen(*, connection_id, spool: dict | None = None) -> bool:
    """The daemon was heard (a frame of any kind, issue 9 item 2): ``last_heartbeat_at``, which the
    stale sweep judges, is now.  One UPDATE; False while the connection is offline (its heartbeat,
    ``connection_heartbeat``, brings it back online)."""
    return bool(Connection.objects.filter(pk=connection_id).exclude(status=states.CONN_OFFLINE).update(
        last_heartbeat_at=timezone.now(), **_with_spool_health(spool)))


def connection_heartbeat(*, connection_id, spool: dict | None = None, running: list | None = None) -> None:
    """Frequent and cheap: no event; the status flips back online if a sweep had marked it offline.

    ``running``: the turns the daemon runs (ids).  One that the sweep settled offline meanwhile (a
    daemon frozen, its socket still open: no new hello or snapshot follows) is reopened at once.
    """
    updated = connection_seen(connection_id=connection_id, spool=spool)
    if not updated:
        try:
            services.connection_set_status(connection_id=connection_id, status=states.CONN_ONLINE,
                                           last_heartbeat_at=timezone.now())
        except ApplicationError:
            pass
        if running is None:  # a daemon that does not say: its latest snapshot, on the same socket
            running = (Connection.objects.filter(pk=connection_id).values_list("last_snapshot", flat=True).first()
                       or {}).get("running")
    if running:
        from .reconcile import listed_turns, turns_reconcile_listed

        _reconcile_safely(turns_reconcile_listed, connection_id=connection_id, listed=listed_turns(running),
                          basis="heartbeat")


def _reconcile_safely(fn, **kwargs):
    """A reconcile that fails is logged; it never takes a daemon's presence down with it."""
    try:
        return fn(**kwargs)
    except Exception:  # noqa: BLE001 — the next snapshot or heartbeat tries again
        log.exception("reconcile %s of %s failed", fn.__name__, kwargs.get("connection_id"))
        return None


def connection_socket_claim(*, connection_id, socket: str, client: str = "") -> str:
    """The newest daemon socket of a connection speaks for it; returns the socket it replaces ("").

    A daemon that reconnects after a network blip may leave a half-open socket behind, so the
    newer socket wins explicitly (an event says so); the replaced one is closed and its close no
    longer marks the connection offline.
    """
    with transaction.atomic():
        previous = (Connection.objects.select_for_update(no_key=True).filter(pk=connection_id)
                    .values_list("daemon_socket", flat=True).first()) or ""
        Connection.objects.filter(pk=connection_id).update(daemon_socket=socket)
        if previous and previous != socket:
            event_append(stream=f"connection:{connection_id}", kind="connection.socket_replaced",
                         data={"id": str(connection_id), "client": client[:100]})
    return previous if previous != socket else ""


def connection_socket_is_current(*, connection_id, socket: str) -> bool:
    return Connection.objects.filter(pk=connection_id, daemon_socket=socket).exists()


def connection_daemon_disconnected(*, connection_id, socket: str | None = None) -> None:
    """Presence is gone; running turns are settled by the sweep once the heartbeat is stale,
    so a short network blip does not end work that is still running.

    With ``socket``: only the connection's current socket takes presence down; the close of a
    socket that a newer one replaced changes nothing.
    """
    if socket is not None and not Connection.objects.filter(pk=connection_id, daemon_socket=socket).update(
            daemon_socket=""):
        return
    try:
        services.connection_set_status(connection_id=connection_id, status=states.CONN_OFFLINE)
    except ApplicationError:
        pass  # already offline


def connection_store_snapshot(*, connection_id, running: list, queued: list | None = None) -> None:
    """Keep the daemon's running set (authoritative for reconcile, SPEC §3.1) and reconcile with it:
    turns settled offline that it holds run again; pending work it does not hold is (re)dispatched."""
    from .reconcile import connection_dispatch_pending, linked_at_of, listed_turns, turns_reconcile_listed

    running, queued = ingest(running), ingest(queued)
    now = timezone.now()
    with transaction.atomic():
        previous = Connection.objects.select_for_update(no_key=True).filter(pk=connection_id).values_list(
            "last_snapshot", flat=True).first() or {}
        snapshot = {"at": now.isoformat(), "running": running}
        if queued is not None:
            snapshot["queued"] = queued
        if previous.get("hello_at"):
            snapshot["hello_at"] = previous["hello_at"]
        Connection.objects.filter(pk=connection_id).update(last_snapshot=snapshot, last_heartbeat_at=now)
    listed = listed_turns(running)
    _reconcile_safely(turns_reconcile_listed, connection_id=connection_id, listed=listed, basis="snapshot",
                      snapshot_at=snapshot["at"])
    _reconcile_safely(connection_dispatch_pending, connection_id=connection_id, held=set(listed),
                      queued=None if queued is None else set(listed_turns(queued)), linked_at=linked_at_of(snapshot))


def connections_sweep_stale(*, now=None) -> dict:
    """Mark connections with a stale heartbeat offline and settle their active turns ``offline``.

    Only a silence the portal could have heard counts: while no portal process is up, and for one
    threshold after one comes back, nobody is judged (chorus_site/presence.py).  Daemons wait out a
    portal outage and reconnect; their turns were never lost (issue 7 item 8, SPEC §11 R9).
    """
    now = now or timezone.now()
    cutoff = now - selectors.heartbeat_timeout()
    pending_cutoff = now - PENDING_GRACE_FACTOR * selectors.heartbeat_timeout()
    if not presence.silence_judged_since(cutoff, now=now):
        up_since = presence.portal_up_since(now=now)
        log.info("stale sweep: no daemon judged; the portal %s", "is down" if up_since is None
                 else f"is back since {up_since.isoformat()}, less than a threshold")
        # (Nor pending turns: their grace is longer still.)
        return {"connections_offline": 0, "turns_settled": 0, "pending_settled": 0,
                "portal_up_since": up_since.isoformat() if up_since else None}
    went_offline = 0
    for connection_id in Connection.objects.filter(status__in=[states.CONN_ONLINE, states.CONN_DRAINING]).filter(
            last_heartbeat_at__lt=cutoff).values_list("pk", flat=True):
        try:
            services.connection_set_status(connection_id=connection_id, status=states.CONN_OFFLINE)
            went_offline += 1
        except ApplicationError:
            pass
    settled = 0
    # A turn's own connection decides (a session may have moved while the turn runs elsewhere).
    active = Turn.objects.filter(status__in=[states.RUNNING, states.REQUIRES_ACTION])
    stale = set(active.filter(connection__isnull=False).exclude(
        connection__last_heartbeat_at__gte=cutoff).values_list("pk", flat=True))
    stale |= set(active.filter(connection__isnull=True).exclude(
        session__connection__last_heartbeat_at__gte=cutoff).values_list("pk", flat=True))
    for turn_id in sorted(stale):
        try:
            services.turn_set_status(
                turn_id=turn_id, status=states.INTERRUPTED, reason=states.REASON_OFFLINE,
                interrupt_evidence={"basis": "heartbeat_stale", "cutoff": cutoff.isoformat()},
                data={"evidence": "heartbeat_stale"},
            )
            settled += 1
        except ApplicationError:
            pass  # the daemon's own report won the race
    return {"connections_offline": went_offline, "turns_settled": settled,
            "pending_settled": _pending_turns_settle_gone(pending_cutoff)}


def _pending_turns_settle_gone(cutoff) -> int:
    """Pending turns (sent or queued) whose connection has been gone past the pending grace
    (PENDING_GRACE_FACTOR thresholds) settle ``interrupted(offline)``: a daemon killed after acking a
    start would otherwise leave the turn pending forever, blocking every later turn of its session.
    A start command the daemon never took is withdrawn first, so a daemon that comes back does not
    start a settled turn.  A daemon back within the grace reconciles its pending turns itself
    (hello/snapshot, sessions_app.reconcile)."""
    pending = Turn.objects.filter(status=states.PENDING, created_at__lt=cutoff)
    gone = set(pending.filter(connection__isnull=False).exclude(
        connection__last_heartbeat_at__gte=cutoff).values_list("pk", flat=True))
    gone |= set(pending.filter(connection__isnull=True).exclude(
        session__connection__last_heartbeat_at__gte=cutoff).values_list("pk", flat=True))
    settled = 0
    for turn in Turn.objects.filter(pk__in=gone).select_related("connection", "session__connection").order_by("pk"):
        connection = turn.connection or turn.session.connection
        start = ControlCommand.objects.filter(turn_id=turn.pk, action__in=[protocol.START_TURN, protocol.RESUME]) \
            .order_by("-id").first()
        evidence = {"basis": "connection_gone_while_pending", "cutoff": cutoff.isoformat(),
                    "connection": str(connection.pk), "connection_status": connection.status,
                    "last_heartbeat_at": connection.last_heartbeat_at.isoformat() if connection.last_heartbeat_at
                    else None, "start_command": start.state if start else None}
        try:
            with transaction.atomic():
                if start is not None and start.state in {states.CMD_PENDING, states.CMD_DELIVERED}:
                    _set_command_state(start.pk, states.CMD_EXPIRED)
                services.turn_set_status(turn_id=turn.pk, status=states.INTERRUPTED, reason=states.REASON_OFFLINE,
                                         interrupt_evidence=evidence, data={"evidence": evidence["basis"]})
            settled += 1
        except ApplicationError:
            pass  # it started or was settled meanwhile
    return settled


# ---------------------------------------------------------------- commands
def command_send(*, connection_id, action: str, turn_id=None, payload: dict | None = None) -> ControlCommand:
    """Persist a command and wake the daemon's consumer after commit (it replays on reconnect)."""
    command = services.command_create(connection_id=connection_id, action=action, turn_id=turn_id, payload=payload,
                                      expires_at=timezone.now() + COMMAND_TTL)
    transaction.on_commit(lambda: _push(connection_id))
    return command


def _push(connection_id) -> None:
    layer = get_channel_layer()
    try:
        async_to_sync(layer.group_send)(daemon_group(connection_id), {"type": "commands.push"})
    except Exception:  # replay on reconnect or the next push delivers it
        log.warning("could not wake the daemon of %s", connection_id, exc_info=True)


def commands_pending(*, connection_id) -> bool:
    return ControlCommand.objects.filter(connection_id=connection_id, state=states.CMD_PENDING).exists()


def commands_to_deliver(*, connection_id) -> list[dict]:
    """Pending (and delivered but unacked) commands in order, marked delivered."""
    now = timezone.now()
    out = []
    queryset = ControlCommand.objects.filter(
        connection_id=connection_id, state__in=[states.CMD_PENDING, states.CMD_DELIVERED]).order_by("id")
    for command in queryset:
        if command.expires_at and command.expires_at <= now:
            _set_command_state(command.pk, states.CMD_EXPIRED)
            continue
        message = {"type": protocol.COMMAND, "id": str(command.pk), "action": command.action,
                   "turn": str(command.turn_id) if command.turn_id else None, "payload": _wire_payload(command)}
        size = protocol.encoded_size(message)
        if size > protocol.COMMAND_MAX_BYTES:
            # Never sent: a frame the daemon cannot take would close its socket and replay on every
            # reconnect, blocking the connection's other commands (issue 7 item 14).
            command_refuse_oversized(command=command, size=size)
            continue
        if command.state == states.CMD_PENDING:
            _set_command_state(command.pk, states.CMD_DELIVERED, delivered_at=now)
        out.append(message)
    return out


def command_refuse_oversized(*, command: ControlCommand, size: int) -> None:
    """Expire a command too large to send, with the reason; its turn settles with a clear wake error
    and the session's next pending turn goes on."""
    limit = protocol.COMMAND_MAX_BYTES
    log.error("command %s (%s) for %s is %d bytes, over the %d-byte frame limit: expired, not sent",
              command.pk, command.action, command.connection_id, size, limit)
    _set_command_state(command.pk, states.CMD_EXPIRED,
                       result={"error": "frame_too_large", "bytes": size, "limit": limit})
    if not command.turn_id or command.action not in {protocol.START_TURN, protocol.RESUME}:
        return
    turn = Turn.objects.filter(pk=command.turn_id).first()
    if turn is None or turn.status != states.PENDING:
        return
    try:
        services.turn_set_status(
            turn_id=turn.pk, status=states.INTERRUPTED, reason=states.REASON_CRASH,
            wake_error={"kind": "protocol", "source": "portal",
                        "summary": f"the turn's start command is {size} bytes, more than the {limit} bytes a "
                                   "command may have: it was not sent to the daemon (shorten the prompt)"},
            data={"evidence": "command_too_large"})
    except ApplicationError:
        return  # settled meanwhile
    _dispatch_next(turn.session_id)


def _wire_payload(command: ControlCommand) -> dict:
    """The stored payload plus what is sent on the wire only: the agent's environment.

    That environment holds the attempt's task token, a credential that is computed here at each
    delivery and never stored (a viewer who can read command rows must not obtain it).
    """
    payload = dict(command.payload or {})
    if command.turn_id and command.action in {protocol.START_TURN, protocol.RESUME}:
        turn = Turn.objects.filter(pk=command.turn_id).first()
        if turn is not None:
            payload["env"] = {**(payload.get("env") or {}), **turn_env(turn)}
    return payload


def command_acked(*, connection_id, command_id) -> None:
    command = ControlCommand.objects.filter(pk=command_id, connection_id=connection_id).first()
    if command and command.state in {states.CMD_PENDING, states.CMD_DELIVERED}:
        _set_command_state(command.pk, states.CMD_ACKED, acked_at=timezone.now())


def command_result(*, connection_id, command_id, result: dict) -> None:
    result = ingest(result)
    command = ControlCommand.objects.filter(pk=command_id, connection_id=connection_id).first()
    if command is None:
        return
    if command.state in {states.CMD_PENDING, states.CMD_DELIVERED}:
        _set_command_state(command.pk, states.CMD_ACKED, acked_at=timezone.now())
    _set_command_state(command.pk, states.CMD_DONE, result=result)
    if command.action == protocol.INTERRUPT and command.turn_id and result.get("held") is False:
        _settle_interrupt_not_held(command)


def _settle_interrupt_not_held(command: ControlCommand) -> None:
    """A daemon asked to interrupt a turn it does not hold answers "not held" (§4.1).

    That settles the turn only when that daemon is the one that runs it: the word of any other
    connection says nothing about the agent's process.
    """
    turn = Turn.objects.select_related("session").filter(pk=command.turn_id).first()
    if (turn is not None and turn.status == states.INTERRUPTED
            and turn.stop_state in [*STOPS_UNDER_WAY, states.STOP_UNCONFIRMED]
            and _runner_id(turn) == command.connection_id):
        # A settled turn whose process its daemon held (reconcile.turn_stop_held): gone now, by its
        # word, also when that word comes after the deadline.
        try:
            with transaction.atomic():
                services.turn_set_stop_state(turn_id=turn.pk, stop_state=states.STOP_CONFIRMED)
                if turn.stop_state == states.STOP_UNCONFIRMED:
                    _stop_late(turn, states.STOP_CONFIRMED, basis=f"interrupt_not_held (command {command.pk})")
        except ApplicationError:
            pass  # its own stop report got there first
        return
    if turn is None or turn.status not in {states.PENDING, states.RUNNING, states.REQUIRES_ACTION}:
        return
    if _runner_id(turn) != command.connection_id:
        log.warning("interrupt of turn %s answered 'not held' by %s, which does not run it; not settled",
                    turn.pk, command.connection_id)
        return
    evidence = {"basis": "interrupt_not_held", "command": str(command.pk), "connection": str(command.connection_id),
                "at": timezone.now().isoformat()}
    try:
        with transaction.atomic():
            if turn.status == states.PENDING:
                # Its start was delivered but never taken (commands go in order: the daemon would hold
                # it by now): withdrawn, so that a replay after a reconnect does not start it.
                from .actions import _start_command_of

                start = _start_command_of(turn.pk)
                if start is not None and start.state in {states.CMD_PENDING, states.CMD_DELIVERED}:
                    services.command_set_state(command_id=start.pk, state=states.CMD_EXPIRED)
            services.turn_set_status(turn_id=turn.pk, status=states.INTERRUPTED, reason=states.REASON_USER,
                                     stop_state=states.STOP_CONFIRMED, interrupt_evidence=evidence,
                                     data={"evidence": evidence["basis"]})
            if turn.stop_state == states.STOP_UNCONFIRMED:
                _stop_late(turn, states.STOP_CONFIRMED, basis=f"interrupt_not_held (command {command.pk})")
    except ApplicationError:
        return  # its own report (ended, interrupted) got there first
    _dispatch_next(turn.session_id)


def _set_command_state(command_id, state, **updates):
    try:
        services.command_set_state(command_id=command_id, state=state, **updates)
    except ApplicationError:
        pass  # another delivery path got there first


# ---------------------------------------------------------------- reports
def _runner_id(turn: Turn):
    """The connection that runs the turn (set at dispatch); before that, its session's."""
    return turn.connection_id or turn.session.connection_id


def _owned_turn(connection: Connection, turn_id) -> Turn:
    turn = Turn.objects.select_related("session").filter(pk=turn_id).first()
    if turn is None or _runner_id(turn) != connection.pk:
        # A daemon reports only on turns it runs: not another connection's, nor a turn of a session
        # that moved here while the turn still runs elsewhere.  It learns nothing about them.
        raise ApplicationError("not_found", "no such turn on this connection")
    return turn


def report_advance(*, connection: Connection, turn_id, report: dict) -> tuple[int, dict, bool]:
    # Nothing that does not validate is stored (issue 7 item 13); refusals are not recorded, so a
    # daemon that retries a refused report has it decided again (its spool parks, never drops, it).
    report = daemon_schemas.as_report(daemon_schemas.validated(daemon_schemas.AdvanceReportIn, report))
    return idempotent_call(user=None, scope=f"connection:{connection.pk}", route="daemon.advance",
                           key=str(report["report_id"]), body={"turn": str(turn_id), **report},
                           action=lambda: (200, _apply_advance(connection, turn_id, report)), record_refusals=False)


def _apply_advance(connection: Connection, turn_id, report: dict) -> dict:
    # Everything below stores fields of this one value: every string in it (requires_action items,
    # background_processes[].cmdline, wake_error, final_reply, changes, the outcome) is made
    # storable (NUL, lone surrogates → U+FFFD) and redacted here, once, so a new field cannot miss it.
    report = ingest(report)
    turn = _owned_turn(connection, turn_id)
    # Decide on the turn as it stands under its locks (session → turn, chorus_site/transitions.py),
    # not on a read that a concurrent interrupt or answer has changed since.
    turn = services.turn_lock(turn.pk, related=("session",))
    status = report.get("status")
    stop_state = report.get("stop_state")
    if (turn.status == states.INTERRUPTED and turn.interrupted_reason == states.REASON_OFFLINE
            and status in {protocol.RUNNING, protocol.REQUIRES_ACTION, protocol.ENDED}):
        # The daemon that runs it reports on a turn settled offline while it was away: it held the
        # turn after all.  Reopened (explicit, audited), then this report applies as usual.
        from .reconcile import turn_reconcile_held

        if turn_reconcile_held(connection_id=connection.pk, turn_id=turn.pk, evidence={
                "basis": "daemon_report", "status": status, "report_id": str(report.get("report_id"))}):
            turn = services.turn_lock(turn.pk, related=("session",))
            if status == protocol.RUNNING:
                if report.get("pid") is not None:
                    Turn.objects.filter(pk=turn.pk).update(pid=int(report["pid"]))
                return {"turn": str(turn.pk), "status": turn.status, "stop_state": turn.stop_state}
        elif status in {protocol.RUNNING, protocol.REQUIRES_ACTION}:
            # Not reopened (its session or its attempt went on without it): it stays settled and
            # this daemon has been told to stop the process (reconcile.turn_stop_held).  The report
            # is taken as the daemon's word that the process lives, not refused: a refusal would
            # roll that stop back.
            turn = services.turn_lock(turn.pk, related=("session",))
            return {"turn": str(turn.pk), "status": turn.status, "stop_state": turn.stop_state}
    session = turn.session
    if report.get("backend_session_id") and report["backend_session_id"] != session.backend_session_id:
        # Not from where the session moved away; the condition is in the UPDATE itself, so a move
        # committing meanwhile (it clears the id) is not overwritten by a report read before it.
        Session.objects.filter(pk=session.pk, connection_id=_runner_id(turn)).update(
            backend_session_id=str(report["backend_session_id"])[:255])
    late = turn.stop_state == states.STOP_UNCONFIRMED  # its deadline passed before this report came
    basis = f"report {report.get('report_id')}"
    if status in (None, turn.status) and stop_state:
        # Stop progress only: signalled → escalated.
        if late and stop_state != states.STOP_CONFIRMED:
            # A step on the way (the daemon was frozen or cut off past the deadline): superseded by
            # the doubt only its confirmation lifts.  Accepted, not refused: a refusal would hold up
            # the confirmation queued behind it in the daemon's spool (agents/spool.py).
            _stop_late(turn, stop_state, basis=basis)
            return {"turn": str(turn.pk), "status": turn.status, "stop_state": turn.stop_state}
        turn = services.turn_set_stop_state(turn_id=turn.pk, stop_state=stop_state)
        if late:
            _stop_late(turn, stop_state, basis=basis)
        return {"turn": str(turn.pk), "status": turn.status, "stop_state": turn.stop_state}
    if status not in {protocol.RUNNING, protocol.REQUIRES_ACTION, protocol.ENDED, protocol.INTERRUPTED}:
        raise ApplicationError("bad_request", f"unknown status {status!r}")
    if status == protocol.REQUIRES_ACTION and turn.status == states.REQUIRES_ACTION:
        # A later report of the same wait (e.g. at the agent's exit) adds what it knows; no transition.
        updates = {name: report[name] for name in ("requires_action", "usage", "changes") if
                   isinstance(report.get(name), dict)}
        Turn.objects.filter(pk=turn.pk).update(**updates)
        return {"turn": str(turn.pk), "status": turn.status, "stop_state": turn.stop_state}
    fields = {}
    if report.get("pid") is not None:
        fields["pid"] = int(report["pid"])
    if status == protocol.REQUIRES_ACTION:
        fields["requires_action"] = report.get("requires_action") or {"kind": "confirmation", "items": []}
    if status in {protocol.REQUIRES_ACTION, protocol.ENDED, protocol.INTERRUPTED}:
        for name in ("changes", "usage"):
            if isinstance(report.get(name), dict):
                fields[name] = report[name]
    if status in {protocol.ENDED, protocol.INTERRUPTED}:
        if isinstance(report.get("background_processes"), list):
            fields["background_processes"] = report["background_processes"][:100]
        if report.get("final_reply"):
            fields["final_reply"] = str(report["final_reply"])
        if stop_state is None and turn.stop_state in {states.STOP_REQUESTED, states.STOP_SIGNALLED,
                                                      states.STOP_ESCALATED, states.STOP_UNCONFIRMED}:
            # The agent exited while a stop was under way (or in doubt).  Confirmed only if nothing
            # survived; a daemon that could not clear the tree lists the survivors and the deadline
            # job then marks the stop unconfirmed: it never pretends.
            if not report.get("background_processes"):
                stop_state = states.STOP_CONFIRMED
    turn = services.turn_set_status(
        turn_id=turn.pk, status=status, reason=report.get("reason") if status == protocol.INTERRUPTED else None,
        wake_error=report.get("wake_error"), stop_state=stop_state, from_daemon=True, **fields)
    if late and stop_state == states.STOP_CONFIRMED:
        _stop_late(turn, stop_state, basis=basis)
    if status in {protocol.ENDED, protocol.INTERRUPTED}:
        if isinstance(report.get("usage"), dict):
            services.session_add_usage(session_id=session.pk, usage=report["usage"])
        if turn.final_reply:
            services.transcript_append(session_id=session.pk, role="assistant", text=turn.final_reply,
                                       turn_id=turn.pk)
        elif status == protocol.INTERRUPTED:
            _transcript_partial_reply(turn)
        _dispatch_next(session.pk)
    return {"turn": str(turn.pk), "status": turn.status, "stop_state": turn.stop_state}


def _stop_late(turn: Turn, step: str, *, basis: str) -> None:
    """A daemon's step of a stop the portal had marked ``unconfirmed``: its word comes late, and is
    recorded as such (a ``turn.stop_late`` event; a confirmation is audited too).  Only the
    confirmation changes the stop; a step on the way (signalled, escalated) is superseded."""
    applied = step == states.STOP_CONFIRMED
    event_append(stream=turn.stream, kind="turn.stop_late", actor=actor_name(None), data={
        "id": str(turn.pk), "session": str(turn.session_id), "step": step, "applied": applied,
        "stop_state": step if applied else states.STOP_UNCONFIRMED, "basis": basis})
    if applied:
        audit_record(actor=None, action="turn.stop_late", target=f"turn:{turn.pk}",
                     outcome="stop confirmed by its daemon after it had been marked unconfirmed", client="daemon",
                     reason=basis)


PARTIAL_REPLY_MAX = 20_000


def _transcript_partial_reply(turn: Turn) -> None:
    """A turn interrupted before its final reply (a crash, a stop) keeps what the agent had said in the
    session's transcript, marked as partial: the text events of its output (already redacted), not
    its raw lines.  A resume, a handoff's transcript tail and the operator then see it."""
    from chorus_site.models import Event

    texts = [str((data.get("data") or {}).get("text") or "").strip() for data in Event.objects.filter(
        stream=turn.stream, kind="turn.output", at__gte=turn.created_at, data__id=str(turn.pk),
        data__type=protocol.EV_TEXT).order_by("id").values_list("data", flat=True)[:500]
        if not (data.get("data") or {}).get("raw")]
    said = "\n\n".join(t for t in texts if t)
    if not said:
        return
    reason = f"interrupted ({turn.interrupted_reason})" if turn.interrupted_reason else "interrupted"
    services.transcript_append(session_id=turn.session_id, role="assistant", turn_id=turn.pk,
                               text=f"{said[-PARTIAL_REPLY_MAX:]}\n\n[partial reply: the turn was {reason} before it finished]")


def _dispatch_next(session_id) -> None:
    from .actions import session_dispatch

    try:
        with transaction.atomic():
            session_dispatch(session_id=session_id)
    except ApplicationError:
        log.info("next pending turn of %s not dispatched", session_id, exc_info=True)


def report_events(*, connection: Connection, turn_id, report: dict) -> tuple[int, dict, bool]:
    report = daemon_schemas.as_report(daemon_schemas.validated(daemon_schemas.EventsReportIn, report))
    events = report["events"]
    return idempotent_call(user=None, scope=f"connection:{connection.pk}", route="daemon.events",
                           key=str(report["report_id"]),
                           body={"turn": str(turn_id), "n": len(events), "first": events[:1]},
                           action=lambda: (200, _apply_events(connection, turn_id, events)), record_refusals=False)


def _retrying_follow(turn: Turn, items: list[dict]) -> None:
    """A ``turn.retrying`` event {id, retrying: the CLI's words, or "" once other output follows} when
    a report changes whether the turn's CLI is retrying a model call (selectors.turn_retrying reads
    the state from the output itself): the changelists follow state events, not the output."""
    def retry_message(item):
        data = item["data"]
        if data["type"] == protocol.EV_PROGRESS and isinstance(data["data"].get("retry"), dict):
            return str(data["data"].get("message") or "retrying")
        return None

    if not items:
        return
    now = retry_message(items[-1])
    if now is None and not any(retry_message(item) for item in items) and selectors.turn_retrying(turn) is None:
        return  # not retrying before this report, nor within it
    event_append(stream=turn.stream, kind="turn.retrying",
                 data={"id": str(turn.pk), "session": str(turn.session_id), "retrying": now or ""})


def _apply_events(connection: Connection, turn_id, events: list) -> dict:
    # As in _apply_advance: the whole report, once; in order, so a private key printed line by line
    # stays masked across the events of the report (the daemon does the same across reports).
    events = StreamRedactor().events(events)
    turn = _owned_turn(connection, turn_id)
    # Output from a stalled turn clears the flag; first, so the locks go session → turn → stream.
    stalls.turn_output_resumed(turn)
    items = []
    for raw in events:
        if not isinstance(raw, dict) or raw.get("kind") not in protocol.EVENT_KINDS:
            continue  # unknown kinds from newer daemons are skipped, not fatal
        data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
        if raw["kind"] == protocol.EV_SESSION and data.get("id") and not turn.session.backend_session_id:
            # Conditional in SQL, as in _apply_advance: a move that commits meanwhile wins.
            Session.objects.filter(pk=turn.session_id, connection_id=_runner_id(turn),
                                   backend_session_id__isnull=True).update(backend_session_id=str(data["id"])[:255])
        # The agent's data sits under its own key: its ``id`` (a backend session id, a tool call id)
        # must not overwrite the turn's, which the timelines and the engine filter on.
        items.append({"kind": "turn.output", "data": {"id": str(turn.pk), "type": raw["kind"], "data": data}})
    _retrying_follow(turn, items)
    # Redacted above, once for the whole report: one INSERT, one broadcast after commit (issue 9).
    events_append_many(stream=turn.stream, items=items, redacted=True)
    metrics.events_ingested(len(items))
    return {"accepted": len(items), "skipped": len(events) - len(items)}

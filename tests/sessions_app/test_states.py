"""The sessions_app state machines (SPEC §3.1), table-driven from ``sessions_app/states.py``.

Every allowed pair goes through its service and writes exactly one event on the right stream;
every other pair (repeating the current state included) is refused with ``invalid_transition``
and changes nothing: same row, no event.
"""

from __future__ import annotations

import pytest

from chorus_site.errors import ApplicationError
from sessions_app import services, states
from sessions_app.models import Connection, ControlCommand, Session, Turn
from tests.factories import events_since, last_event_id, make_connection, make_session, make_turn
from tests.state_machines import assert_one_event, assert_refused, ids, pairs


# ---------------------------------------------------------------- the tables themselves
def test_turn_table_is_the_one_of_the_spec():
    # SPEC §3.1: pending → running → ended | interrupted; pending → merged; pending → interrupted;
    # running ⇄ requires_action; requires_action → ended | interrupted.  Nothing else.
    assert states.TURN_TRANSITIONS == {
        "pending": {"running", "merged", "interrupted"},
        "running": {"ended", "interrupted", "requires_action"},
        "requires_action": {"running", "ended", "interrupted"},
    }
    assert set(states.TURN_STATUSES) == {"pending", "running", "requires_action", "ended", "interrupted", "merged"}
    for terminal in states.TURN_TERMINAL:
        assert terminal not in states.TURN_TRANSITIONS
    assert states.DAEMON_REPORTABLE_REASONS == {"user", "crash", "shutdown", "invalid_path", "timeout"}
    assert states.WAKE_ERROR_REASONS == {"crash", "invalid_path", "timeout"}


@pytest.mark.parametrize("table", [
    states.TURN_TRANSITIONS, states.STOP_TRANSITIONS, states.SESSION_TRANSITIONS, states.CONNECTION_TRANSITIONS,
    states.COMMAND_TRANSITIONS,
], ids=["turn", "stop", "session", "connection", "command"])
def test_no_table_allows_repeating_a_state(table):
    for source, targets in table.items():
        assert source not in targets


# ---------------------------------------------------------------- turn status
TURN_ALLOWED, TURN_FORBIDDEN = pairs(states.TURN_STATUSES, states.TURN_TRANSITIONS)


def _turn_kwargs(target):
    return {"reason": states.REASON_USER} if target == states.INTERRUPTED else {}


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", TURN_ALLOWED, ids=ids(TURN_ALLOWED))
def test_turn_allowed_transition(source, target):
    turn = make_turn(status=source)
    mark = last_event_id()

    result = services.turn_set_status(turn_id=turn.id, status=target, **_turn_kwargs(target))

    assert result.status == target
    stored = Turn.objects.get(pk=turn.id)
    assert stored.status == target
    event = assert_one_event(mark, stream=f"session:{turn.session_id}", kind="turn.status", field="status",
                             source=source, target=target, pk=turn.id)
    assert event.data["session"] == str(turn.session_id)
    if target == states.INTERRUPTED:
        assert stored.interrupted_reason == states.REASON_USER
        assert event.data["interrupted_reason"] == states.REASON_USER
    if target in states.TURN_TERMINAL:
        assert stored.ended_at is not None
    else:
        assert stored.ended_at is None
    if target == states.RUNNING:
        assert stored.started_at is not None


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", TURN_FORBIDDEN, ids=ids(TURN_FORBIDDEN))
def test_turn_forbidden_transition(source, target):
    turn = make_turn(status=source)
    error = assert_refused(
        lambda: services.turn_set_status(turn_id=turn.id, status=target, **_turn_kwargs(target)),
        model=Turn, pk=turn.id,
    )
    assert error.detail["from"] == source
    assert error.detail["to"] == target


@pytest.mark.django_db
@pytest.mark.parametrize("reason", states.INTERRUPTED_REASONS)
def test_turn_interrupted_with_each_reason_from_the_server(reason):
    turn = make_turn(status=states.RUNNING)
    result = services.turn_set_status(turn_id=turn.id, status=states.INTERRUPTED, reason=reason)
    assert (result.status, result.interrupted_reason) == (states.INTERRUPTED, reason)


# ---------------------------------------------------------------- stop state (§4.1)
STOP_ALLOWED, STOP_FORBIDDEN = pairs(states.STOP_STATES, states.STOP_TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", STOP_ALLOWED, ids=ids(STOP_ALLOWED))
def test_stop_state_allowed_transition(source, target):
    turn = make_turn(status=states.RUNNING, stop_state=source)
    mark = last_event_id()
    result = services.turn_set_stop_state(turn_id=turn.id, stop_state=target)
    assert result.stop_state == target
    assert Turn.objects.get(pk=turn.id).status == states.RUNNING
    assert_one_event(mark, stream=f"session:{turn.session_id}", kind="turn.stop_state", field="stop_state",
                     source=source, target=target, pk=turn.id)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", STOP_FORBIDDEN, ids=ids(STOP_FORBIDDEN))
def test_stop_state_forbidden_transition(source, target):
    turn = make_turn(status=states.RUNNING, stop_state=source)
    assert_refused(lambda: services.turn_set_stop_state(turn_id=turn.id, stop_state=target), model=Turn, pk=turn.id)


# ---------------------------------------------------------------- session status
SESSION_STATUSES = [states.SESSION_ACTIVE, states.SESSION_ENDED]
SESSION_ALLOWED, SESSION_FORBIDDEN = pairs(SESSION_STATUSES, states.SESSION_TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", SESSION_ALLOWED, ids=ids(SESSION_ALLOWED))
def test_session_allowed_transition(source, target):
    session = make_session(status=source)
    mark = last_event_id()
    assert services.session_set_status(session_id=session.id, status=target).status == target
    assert_one_event(mark, stream=f"session:{session.id}", kind="session.status", field="status",
                     source=source, target=target, pk=session.id)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", SESSION_FORBIDDEN, ids=ids(SESSION_FORBIDDEN))
def test_session_forbidden_transition(source, target):
    session = make_session(status=source)
    assert_refused(lambda: services.session_set_status(session_id=session.id, status=target),
                   model=Session, pk=session.id)


# ---------------------------------------------------------------- connection status
CONNECTION_STATUSES = [states.CONN_ONLINE, states.CONN_OFFLINE, states.CONN_DRAINING]
CONNECTION_ALLOWED, CONNECTION_FORBIDDEN = pairs(CONNECTION_STATUSES, states.CONNECTION_TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", CONNECTION_ALLOWED, ids=ids(CONNECTION_ALLOWED))
def test_connection_allowed_transition(source, target):
    connection = make_connection(status=source)
    mark = last_event_id()
    assert services.connection_set_status(connection_id=connection.id, status=target).status == target
    assert_one_event(mark, stream=f"connection:{connection.id}", kind="connection.status", field="status",
                     source=source, target=target, pk=connection.id)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", CONNECTION_FORBIDDEN, ids=ids(CONNECTION_FORBIDDEN))
def test_connection_forbidden_transition(source, target):
    connection = make_connection(status=source)
    assert_refused(lambda: services.connection_set_status(connection_id=connection.id, status=target),
                   model=Connection, pk=connection.id)


# ---------------------------------------------------------------- control commands
COMMAND_STATES = [states.CMD_PENDING, states.CMD_DELIVERED, states.CMD_ACKED, states.CMD_DONE, states.CMD_EXPIRED]
COMMAND_ALLOWED, COMMAND_FORBIDDEN = pairs(COMMAND_STATES, states.COMMAND_TRANSITIONS)


def _command(state):
    turn = make_turn(status=states.RUNNING)
    command = services.command_create(connection_id=turn.session.connection_id, action="interrupt", turn_id=turn.id)
    ControlCommand.objects.filter(pk=command.pk).update(state=state)
    return command


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", COMMAND_ALLOWED, ids=ids(COMMAND_ALLOWED))
def test_command_allowed_transition(source, target):
    command = _command(source)
    mark = last_event_id()
    assert services.command_set_state(command_id=command.id, state=target).state == target
    assert_one_event(mark, stream=f"connection:{command.connection_id}", kind="command.state", field="state",
                     source=source, target=target, pk=command.id)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", COMMAND_FORBIDDEN, ids=ids(COMMAND_FORBIDDEN))
def test_command_forbidden_transition(source, target):
    command = _command(source)
    assert_refused(lambda: services.command_set_state(command_id=command.id, state=target),
                   model=ControlCommand, pk=command.id)


@pytest.mark.django_db
def test_transition_of_a_missing_turn_is_not_found():
    import uuid

    mark = last_event_id()
    with pytest.raises(ApplicationError) as refused:
        services.turn_set_status(turn_id=uuid.uuid4(), status=states.RUNNING)
    assert refused.value.code == "not_found"
    assert events_since(mark) == []

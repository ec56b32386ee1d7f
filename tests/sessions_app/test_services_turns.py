"""Rules attached to turn statuses (SPEC §3.1) and turn transitions racing on PostgreSQL."""

from __future__ import annotations

import base64

import pytest

from chorus_site.errors import ApplicationError
from chorus_site.models import Event
from sessions_app import services, states
from sessions_app.models import Session, Turn
from tests.factories import events_since, last_event_id, make_session, make_turn
from tests.concurrency import run_together

SECRET = "sk-ant-api03-Zq8xW2vK9mL4pR7tY1uE6sD3fG5hJ0kA"


def interrupt(turn, reason, **kwargs):
    return services.turn_set_status(turn_id=turn.id, status=states.INTERRUPTED, reason=reason, **kwargs)


# ---------------------------------------------------------------- reasons
@pytest.mark.django_db
@pytest.mark.parametrize("reason", [None, "", "bogus", "USER"])
def test_interrupted_needs_a_known_reason(reason):
    turn = make_turn(status=states.RUNNING)
    mark = last_event_id()
    with pytest.raises(ApplicationError) as refused:
        services.turn_set_status(turn_id=turn.id, status=states.INTERRUPTED, reason=reason)
    assert refused.value.code == "bad_request"
    assert Turn.objects.get(pk=turn.id).status == states.RUNNING
    assert events_since(mark) == []


@pytest.mark.django_db
def test_a_reason_is_refused_for_other_statuses():
    turn = make_turn(status=states.RUNNING)
    mark = last_event_id()
    with pytest.raises(ApplicationError) as refused:
        services.turn_set_status(turn_id=turn.id, status=states.ENDED, reason=states.REASON_USER)
    assert refused.value.code == "bad_request"
    assert Turn.objects.get(pk=turn.id).status == states.RUNNING
    assert events_since(mark) == []


@pytest.mark.django_db
def test_daemon_may_not_report_offline():
    turn = make_turn(status=states.RUNNING)
    mark = last_event_id()
    with pytest.raises(ApplicationError) as refused:
        interrupt(turn, states.REASON_OFFLINE, from_daemon=True)
    assert refused.value.code == "bad_request"
    stored = Turn.objects.get(pk=turn.id)
    assert (stored.status, stored.interrupted_reason) == (states.RUNNING, "")
    assert events_since(mark) == []

    # The server's own reconcile may.
    assert interrupt(turn, states.REASON_OFFLINE).interrupted_reason == states.REASON_OFFLINE


@pytest.mark.django_db
@pytest.mark.parametrize("reason", sorted(states.DAEMON_REPORTABLE_REASONS))
def test_daemon_may_report_every_other_reason(reason):
    turn = make_turn(status=states.RUNNING)
    assert interrupt(turn, reason, from_daemon=True).interrupted_reason == reason


# ---------------------------------------------------------------- wake errors
@pytest.mark.django_db
@pytest.mark.parametrize("reason", sorted(states.WAKE_ERROR_REASONS))
def test_wake_error_is_stored_for_crash_invalid_path_and_timeout(reason):
    turn = make_turn(status=states.RUNNING)
    error = {"kind": "exited_nonzero", "summary": "agent exited with code 3", "source": "scripted",
             "details": "Traceback: boom", "exit_code": 3, "signal": None}
    stored = interrupt(turn, reason, wake_error=error).wake_error
    assert stored == {"kind": "exited_nonzero", "summary": "agent exited with code 3", "source": "scripted",
                      "details": "Traceback: boom", "exit_code": 3, "signal": None}
    assert Turn.objects.get(pk=turn.id).wake_error == stored


@pytest.mark.django_db
@pytest.mark.parametrize("reason", sorted(set(states.INTERRUPTED_REASONS) - states.WAKE_ERROR_REASONS))
def test_wake_error_is_not_stored_for_other_reasons(reason):
    # A user interrupt is never shown as a crash (SPEC §3.1), whatever the report carries.
    turn = make_turn(status=states.RUNNING)
    result = interrupt(turn, reason, wake_error={"kind": "signal", "summary": "killed", "signal": "SIGKILL"})
    assert result.wake_error is None
    assert Turn.objects.get(pk=turn.id).wake_error is None


@pytest.mark.django_db
def test_wake_error_is_not_stored_on_ended_turns():
    turn = make_turn(status=states.RUNNING)
    result = services.turn_set_status(turn_id=turn.id, status=states.ENDED,
                                      wake_error={"kind": "signal", "summary": "killed"})
    assert result.wake_error is None


@pytest.mark.django_db
@pytest.mark.parametrize("reason,kind", [("crash", "exited_nonzero"), ("invalid_path", "invalid_path"),
                                         ("timeout", "timeout")])
def test_generic_summary_when_no_error_was_given(reason, kind):
    turn = make_turn(status=states.RUNNING)
    stored = interrupt(turn, reason).wake_error
    assert stored["summary"] == services.GENERIC_WAKE_SUMMARY
    assert stored["kind"] == kind
    assert stored["details"] == ""


@pytest.mark.django_db
def test_generic_summary_when_error_has_no_summary():
    turn = make_turn(status=states.RUNNING)
    stored = interrupt(turn, "crash", wake_error={"kind": "signal", "signal": "SIGSEGV"}).wake_error
    assert stored["summary"] == services.GENERIC_WAKE_SUMMARY
    assert stored["signal"] == "SIGSEGV"


@pytest.mark.django_db
def test_wake_error_details_are_redacted_at_storage():
    turn = make_turn(status=states.RUNNING)
    encoded = base64.b64encode(f"OPENAI_API_KEY={SECRET}".encode()).decode()
    details = f"starting agent\nAuthorization: Bearer {SECRET}\nenv dump: {encoded}\nexit 1\n"
    stored = interrupt(turn, "crash", wake_error={
        "kind": "exited_nonzero", "summary": f"auth failed for {SECRET}", "details": details, "exit_code": 1,
    }).wake_error
    raw = Turn.objects.filter(pk=turn.id).values_list("wake_error", flat=True).get()
    for text in (stored["details"], stored["summary"], str(raw)):
        assert SECRET not in text
        assert encoded not in text
    assert "starting agent" in stored["details"]
    assert "exit 1" in stored["details"]
    # Nor in the event written for the change.
    assert not any(SECRET in str(e.data) for e in Event.objects.filter(stream=turn.stream))


@pytest.mark.django_db
def test_wake_error_details_are_truncated_to_64_kib_keeping_the_tail():
    turn = make_turn(status=states.RUNNING)
    details = "".join(f"line {n} of noisy output é\n" for n in range(10_000)) + "THE-LAST-LINE"
    assert len(details.encode()) > 200 * 1024
    stored = interrupt(turn, "crash", wake_error={"kind": "exited_nonzero", "details": details}).wake_error
    assert len(stored["details"].encode()) <= 64 * 1024
    assert len(stored["details"].encode()) > 60 * 1024
    assert stored["details"].endswith("THE-LAST-LINE")
    assert "line 0 of" not in stored["details"]


@pytest.mark.django_db
def test_wake_error_details_have_ansi_sequences_stripped():
    turn = make_turn(status=states.RUNNING)
    details = (
        "\x1b[31mred error\x1b[0m\n"               # SGR colour
        "\x1b[1;38;2;255;0;0mtruecolor\x1b[m\n"     # 24-bit colour
        "\x1b[2K\x1b[1Gprogress 100%\n"            # erase line, cursor column
        "\x1b[?25lhidden cursor\x1b[?25h\n"        # private mode
        "\x1b]0;window title\x07after title\n"     # OSC ended by BEL
        "\x1b]8;;https://example.com/x\x1b\\link text\x1b]8;;\x1b\\\n"  # OSC 8 hyperlink ended by ST
        "\x1b(Bcharset reset\n"                    # charset designation
        "\x1b[>4;2mmodifyOtherKeys\n"              # CSI with '>' parameter
        "\x1b=keypad and a stray escape\x1b\n"
    )
    stored = interrupt(turn, "crash", wake_error={"kind": "exited_nonzero", "details": details}).wake_error
    assert "\x1b" not in stored["details"]
    assert "\x07" not in stored["details"]
    assert stored["details"] == (
        "red error\ntruecolor\nprogress 100%\nhidden cursor\nafter title\nlink text\ncharset reset\n"
        "modifyOtherKeys\nkeypad and a stray escape\n"
    )


@pytest.mark.django_db
def test_ansi_codes_cannot_hide_a_secret_from_redaction():
    turn = make_turn(status=states.RUNNING)
    coloured = f"key: \x1b[1m{SECRET[:10]}\x1b[0m{SECRET[10:]}"
    stored = interrupt(turn, "crash", wake_error={"kind": "exited_nonzero", "details": coloured}).wake_error
    assert SECRET not in stored["details"]
    assert SECRET[12:] not in stored["details"]


@pytest.mark.django_db
def test_unknown_wake_error_kind_is_refused_and_changes_nothing():
    turn = make_turn(status=states.RUNNING)
    mark = last_event_id()
    with pytest.raises(ApplicationError) as refused:
        interrupt(turn, "crash", wake_error={"kind": "meltdown"})
    assert refused.value.code == "bad_request"
    assert Turn.objects.get(pk=turn.id).status == states.RUNNING
    assert events_since(mark) == []


@pytest.mark.django_db
def test_a_repeated_terminal_report_keeps_the_first_error():
    turn = make_turn(status=states.RUNNING)
    first = interrupt(turn, "crash", wake_error={"kind": "exited_nonzero", "summary": "first", "exit_code": 1})
    mark = last_event_id()
    with pytest.raises(ApplicationError) as refused:
        interrupt(turn, "timeout", wake_error={"kind": "timeout", "summary": "second"})
    assert refused.value.code == "invalid_transition"
    stored = Turn.objects.get(pk=turn.id)
    assert stored.wake_error == first.wake_error
    assert stored.wake_error["summary"] == "first"
    assert stored.interrupted_reason == "crash"
    assert events_since(mark) == []


# ---------------------------------------------------------------- other fields
@pytest.mark.django_db
def test_final_reply_is_redacted():
    turn = make_turn(status=states.RUNNING)
    result = services.turn_set_status(turn_id=turn.id, status=states.ENDED, final_reply=f"done; token={SECRET}")
    assert SECRET not in result.final_reply
    assert result.final_reply.startswith("done; token=")


@pytest.mark.django_db
def test_prompt_is_redacted_when_the_turn_is_created():
    turn = make_turn(prompt=f"use this key {SECRET} please")
    assert SECRET not in Turn.objects.get(pk=turn.id).prompt


@pytest.mark.django_db
def test_turn_seq_grows_per_session():
    session = make_session()
    other = make_session()
    assert [make_turn(session=session).seq for _ in range(3)] == [1, 2, 3]
    assert make_turn(session=other).seq == 1


@pytest.mark.django_db
def test_started_at_is_kept_when_a_turn_returns_from_requires_action():
    turn = make_turn(status=states.PENDING)
    started = services.turn_set_status(turn_id=turn.id, status=states.RUNNING).started_at
    services.turn_set_status(turn_id=turn.id, status=states.REQUIRES_ACTION)
    again = services.turn_set_status(turn_id=turn.id, status=states.RUNNING)
    assert again.started_at == started


@pytest.mark.django_db
def test_stop_state_and_reason_travel_with_the_event():
    turn = make_turn(status=states.RUNNING, stop_state=states.STOP_ESCALATED)
    mark = last_event_id()
    result = interrupt(turn, states.REASON_USER, stop_state=states.STOP_CONFIRMED, from_daemon=True)
    assert result.stop_state == states.STOP_CONFIRMED
    (event,) = events_since(mark)
    assert event.data["interrupted_reason"] == "user"
    assert event.data["stop_state"] == "confirmed"


# ---------------------------------------------------------------- races (PostgreSQL)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_conflicting_turn_transitions_race_one_wins():
    session = make_session()
    for _ in range(20):
        turn = make_turn(session=session, status=states.RUNNING)
        mark = last_event_id()
        outcomes = run_together(
            lambda: services.turn_set_status(turn_id=turn.id, status=states.ENDED),
            lambda: services.turn_set_status(turn_id=turn.id, status=states.INTERRUPTED, reason="user"),
        )
        assert sorted(outcomes) == ["invalid_transition", "ok"], outcomes
        winner = states.ENDED if outcomes[0] == "ok" else states.INTERRUPTED
        stored = Turn.objects.get(pk=turn.id)
        assert stored.status == winner
        assert stored.interrupted_reason == ("user" if winner == states.INTERRUPTED else "")
        new = events_since(mark)
        assert [(e.kind, e.data["status"], e.data["from"]) for e in new] == [("turn.status", winner, "running")]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_turn_transitions_and_new_turns_of_one_session_do_not_deadlock():
    # turn_create locks the session row and then the stream; a transition must take its locks in
    # the same order (session → turn → stream), or PostgreSQL aborts one side with a deadlock.
    session = make_session()
    for _ in range(20):
        turn = make_turn(session=session, status=states.RUNNING)
        outcomes = run_together(
            lambda: services.turn_set_status(turn_id=turn.id, status=states.ENDED),
            lambda: services.turn_create(session=session, trigger="human_instruction", prompt="next"),
            lambda: services.turn_create(session=session, trigger="human_instruction", prompt="next"),
        )
        assert outcomes == ["ok", "ok", "ok"]
    seqs = list(Turn.objects.filter(session=session).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))
    stream_seqs = list(Event.objects.filter(stream=session.stream).order_by("id").values_list("seq", flat=True))
    assert stream_seqs == list(range(1, len(stream_seqs) + 1))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_sessions_for_one_idea_key_one_wins_the_other_is_a_conflict():
    # Turns need their session: two starts of the same idea must not fork it, and the loser gets
    # the service's "conflict" refusal rather than a database error.
    session = make_session()
    connection = session.connection
    for n in range(10):
        idea = f"idea-race-{n}"
        outcomes = run_together(
            lambda: services.session_create(connection=connection, cwd=connection.cwds[0], idea_key=idea),
            lambda: services.session_create(connection=connection, cwd=connection.cwds[0], idea_key=idea),
        )
        assert sorted(outcomes) == ["conflict", "ok"], outcomes
        assert Session.objects.filter(idea_key=idea).count() == 1
        assert Event.objects.filter(kind="session.created", data__idea_key=idea).count() == 1


@pytest.mark.django_db
def test_unknown_wake_error_fields_are_refused_and_change_nothing():
    turn = make_turn(status=states.RUNNING)
    mark = last_event_id()
    with pytest.raises(ApplicationError) as refused:
        interrupt(turn, "crash", wake_error={"kind": "signal", "colour": "red"})
    assert refused.value.code == "bad_request"
    assert refused.value.detail["unknown"] == ["colour"]
    assert Turn.objects.get(pk=turn.id).status == states.RUNNING
    assert events_since(mark) == []

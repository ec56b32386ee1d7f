"""SPEC §11 R4: a stateful property test over start / message / run / end / crash / interrupt / mark
interrupted / resume / offline sweeps / runs (start, tick, pause, resume, cancel, rerun).

Hypothesis drives the real services against PostgreSQL (each example in a transaction rolled back
at the end).  Invariants: at most one running turn per session, terminal states stay terminal,
turn seq strictly increasing, attempt numbers strictly increasing per task.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from chorus_site import permissions
from chorus_site.errors import ApplicationError
from executions import actions as run_actions
from executions import engine
from executions.models import Attempt, Run
from sessions_app import actions, bridge
from sessions_app.models import Connection, Session, Turn
from tests import factories
from tests.conftest import role_group

TURN_TERMINAL = {"ended", "interrupted", "merged"}
RUN_TERMINAL = {"cancelled", "succeeded", "partial_succeeded", "failed"}
ATTEMPT_TERMINAL = {"succeeded", "failed", "cancelled"}


class Conversations(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.atomic = transaction.atomic()
        self.atomic.__enter__()
        self.connection = factories.make_connection(cwds=["/srv/work"])
        self.online()
        self.operator = factories.make_user(groups=[role_group(permissions.OPERATOR)])
        self.issue = factories.make_issue()
        self.final_turns: dict = {}
        self.final_runs: dict = {}
        self.final_attempts: dict = {}

    def teardown(self):
        transaction.set_rollback(True)
        self.atomic.__exit__(None, None, None)

    # -- helpers
    def online(self):
        Connection.objects.filter(pk=self.connection.pk).update(status="online", last_heartbeat_at=timezone.now())

    def report(self, turn, **body):
        try:
            bridge._apply_advance(self.connection, turn.pk, {"report_id": str(uuid.uuid4()), **body})
        except ApplicationError:
            pass  # the portal refused it (e.g. a report on a finished turn): refusals are allowed
        self.tick_all()

    def tick_all(self):
        for run_id in Run.objects.exclude(state__in=RUN_TERMINAL).values_list("pk", flat=True):
            engine.run_tick_apply(run_id=run_id)

    def pick(self, data, queryset):
        # Draw an index, not an element: what Hypothesis draws must not depend on the database,
        # or it cannot replay and shrink a failing example.
        index = data.draw(st.integers(min_value=0, max_value=1000))
        items = list(queryset.order_by("created_at", "pk"))
        return items[index % len(items)] if items else None

    def attempt(self, fn, **kwargs):
        try:
            fn(actor=self.operator, **kwargs)
        except ApplicationError:
            pass
        self.tick_all()

    # -- conversation rules
    @rule(idea=st.sampled_from(["a", "b", "c"]))
    def start(self, idea):
        self.online()
        self.attempt(actions.session_start, connection_id=self.connection.pk, cwd="/srv/work",
                     prompt="@reply ok", idea_key=f"idea:{idea}", acknowledge_changes=True)

    @rule(data=st.data())
    def message(self, data):
        session = self.pick(data, Session.objects.filter(status="active"))
        if session:
            self.attempt(actions.session_message, session_id=session.pk, prompt="more")

    @rule(data=st.data())
    def daemon_starts(self, data):
        turn = self.pick(data, Turn.objects.filter(status="pending", commands__isnull=False).distinct())
        if turn:
            self.report(turn, status="running", pid=1000)

    @rule(data=st.data(), how=st.sampled_from(["ended", "crash", "user", "succeeded", "requires_action"]))
    def daemon_finishes(self, data, how):
        turn = self.pick(data, Turn.objects.filter(status="running"))
        if turn is None:
            return
        if how == "ended":
            self.report(turn, status="ended", final_reply="done")
        elif how == "succeeded":
            from chorus_site.events import event_append

            event_append(stream=turn.stream, kind="turn.output",
                         data={"id": str(turn.pk), "type": "outcome", "data": {"intent": "succeeded"}})
            self.report(turn, status="ended", final_reply="done")
        elif how == "crash":
            self.report(turn, status="interrupted", reason="crash",
                        wake_error={"kind": "exited_nonzero", "exit_code": 1})
        elif how == "requires_action":
            self.report(turn, status="requires_action",
                        requires_action={"kind": "confirmation", "items": [{"id": "1", "text": "ok?"}]})
        else:
            self.report(turn, status="interrupted", reason="user", stop_state="confirmed")

    @rule(data=st.data())
    def interrupt(self, data):
        turn = self.pick(data, Turn.objects.all())
        if turn:
            self.attempt(actions.turn_interrupt, turn_id=turn.pk)

    @rule(data=st.data())
    def mark_interrupted(self, data):
        turn = self.pick(data, Turn.objects.filter(status__in=["running", "requires_action"]))
        if turn:
            self.attempt(actions.turn_mark_interrupted, turn_id=turn.pk, evidence={"basis": "test"})

    @rule(data=st.data())
    def resume(self, data):
        session = self.pick(data, Session.objects.filter(status="active"))
        if session:
            self.online()
            self.attempt(actions.session_resume, session_id=session.pk, context="go on")

    @rule()
    def daemon_lost(self):
        Connection.objects.filter(pk=self.connection.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
        bridge.connections_sweep_stale()
        self.online()
        self.tick_all()

    # -- run rules
    @rule()
    def start_run(self):
        self.online()
        self.attempt(engine.run_start, issue_id=self.issue.pk, mode="direct", input={"prompt": "@outcome succeeded"},
                     policy={"infra_retries": 1})

    @rule(data=st.data(), action=st.sampled_from(["pause", "resume", "cancel", "rerun"]))
    def run_action(self, data, action):
        run = self.pick(data, Run.objects.all())
        if run:
            fn = {"pause": run_actions.run_pause, "resume": run_actions.run_resume, "cancel": run_actions.run_cancel,
                  "rerun": run_actions.run_rerun}[action]
            self.attempt(fn, run_id=run.pk)

    # -- invariants
    @invariant()
    def at_most_one_running_turn_per_session(self):
        for session in Session.objects.all():
            assert session.turns.filter(status__in=["running", "requires_action"]).count() <= 1

    @invariant()
    def at_most_one_turn_in_flight_per_session(self):
        # In flight: running, waiting for an answer, or sent to the daemon and not yet settled.
        for session in Session.objects.all():
            sent = session.turns.filter(status="pending", commands__action__in=["start_turn", "resume"],
                                        commands__state__in=["pending", "delivered", "acked"]).distinct().count()
            assert session.turns.filter(status__in=["running", "requires_action"]).count() + sent <= 1

    @invariant()
    def seq_strictly_increasing(self):
        for session in Session.objects.all():
            seqs = list(session.turns.order_by("created_at", "id").values_list("seq", flat=True))
            assert seqs == sorted(set(seqs))

    @invariant()
    def terminal_states_are_final(self):
        for pk, status in Turn.objects.values_list("pk", "status"):
            if pk in self.final_turns:
                assert status == self.final_turns[pk], f"turn left terminal {self.final_turns[pk]} for {status}"
            elif status in TURN_TERMINAL:
                self.final_turns[pk] = status
        for pk, state in Run.objects.values_list("pk", "state"):
            if pk in self.final_runs:
                assert state == self.final_runs[pk]
            elif state in RUN_TERMINAL:
                self.final_runs[pk] = state
        for pk, state in Attempt.objects.values_list("pk", "state"):
            if pk in self.final_attempts:
                assert state == self.final_attempts[pk]
            elif state in ATTEMPT_TERMINAL:
                self.final_attempts[pk] = state

    @invariant()
    def attempt_numbers_strictly_increase(self):
        numbers: dict = {}
        for task_id, number in Attempt.objects.order_by("created_at", "id").values_list("task_id", "number"):
            assert number > numbers.get(task_id, 0)
            numbers[task_id] = number


@pytest.mark.django_db
def test_conversation_and_run_invariants_hold():
    # No shrinking: each step touches the database, and shrinking a failure would outlast the test's
    # timeout; the unshrunk failing sequence is printed instead.
    run_state_machine_as_test(Conversations, settings=settings(
        max_examples=60, stateful_step_count=25, deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    ))

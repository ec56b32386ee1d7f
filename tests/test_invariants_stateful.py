"""SPEC §11 R4: a stateful property test of conversations, runs and daemons together (issue 7).

Hypothesis drives the real actions, services, engine and bridge against PostgreSQL (each example in a
transaction rolled back at the end) with two connections, each served by a modelled daemon
(tests/model_daemon.py) that holds agent processes, takes commands through
``bridge.commands_to_deliver``, sends its frames through the consumer's schemas and bridge functions
and its spooled reports through ``bridge.report_advance``/``report_events``, judged by
``agents.spool.classify``.  The rules: start (also the same idea on the other connection: a moved
session), message, resume, interrupt, mark interrupted (on the portal's own evidence), agents that
exit in every way, commands delivered with acks that land late, spools flushed, daemons that lose
their link, freeze (SIGSTOP) or are killed and come back (hello + snapshot, or a heartbeat), the
offline sweep; runs: direct and declared with a subrun whose child waits for an approval, pause,
resume, cancel, rerun, approvals decided, task retries, issue reopen.

Invariants: at most one running turn (and one in flight) per session; turn seq strictly increasing;
terminal states stay terminal, except exactly the audited reconcile interrupted(offline) → running;
attempt numbers and task ordinals strictly increase, at most one active task per node; a stop is
never ``confirmed`` while a process of the turn lives on a daemon; no report dropped (each is
delivered, kept in the spool, or parked with the portal's recorded refusal) and a delivered report
was applied; a command for a turn goes only to the connection that runs it; a cancelled run has no
unfinished subrun or pending approval; a paused run never finishes or progresses until resumed.

Checked to catch regressions (each fix undone locally, the test failed): interrupt sent to the
session's connection instead of the turn's (a moved session), the spool dropping a 409 as
delivered, cancel not reaching subruns, a paused run completing by itself.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models import Count
from django.utils import timezone
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from agents import protocol
from chorus_site import permissions
from chorus_site.errors import ApplicationError
from chorus_site.models import AuditEntry, Event
from executions import actions as run_actions
from executions import engine
from executions.models import AgentTask, Approval, Attempt, Run, RunNode
from executions.workflows import workflow_create
from sessions_app import actions, bridge
from sessions_app.models import Connection, ControlCommand, Session, Turn
from tests import factories
from tests.conftest import role_group
from tests.model_daemon import ModelDaemon

TURN_TERMINAL = {"ended", "interrupted", "merged"}
RUN_TERMINAL = {"cancelled", "succeeded", "partial_succeeded", "failed"}
ATTEMPT_TERMINAL = {"succeeded", "failed", "cancelled"}
TASK_TERMINAL = {"completed", "failed", "cancelled"}
HOSTS = ("a", "b")
MAX_LIVE_RUNS = 3
STATS: Counter = Counter()


class Conversations(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.atomic = transaction.atomic()
        self.atomic.__enter__()
        self.daemons = {host: ModelDaemon(factories.make_connection(cwds=[f"/srv/{host}"]),
                                          on_command=self.command_seen, on_answer=self.answer_seen)
                        for host in HOSTS}
        self.violations: list[str] = []
        self.time_passes()
        self.operator = factories.make_user(groups=[role_group(permissions.OPERATOR)])
        self.issues = [factories.make_issue(), factories.make_issue(completion_policy="automatic")]
        leaf = workflow_create(name=factories.unique("wf-child"), spec={"nodes": [
            {"key": "work", "type": "agent", "prompt": "@outcome succeeded"},
            {"key": "ok", "type": "approval", "depends_on": ["work"]}]})
        self.revision = workflow_create(name=factories.unique("wf-parent"), spec={"nodes": [
            {"key": "sub", "type": "subrun", "revision": str(leaf.pk)},
            {"key": "after", "type": "agent", "depends_on": ["sub"], "prompt": "@outcome succeeded"}]})
        self.final_turns: dict = {}
        self.final_turns_reconciles: dict = {}
        self.final_runs: dict = {}
        self.final_attempts: dict = {}
        self.paused: dict = {}  # run id -> (node states, attempt count) when it was seen paused
        self.reconciled: Counter = Counter()
        self.final_approvals: dict = {}

    def teardown(self):
        # What the example reached (printed by the test, to see that the rules get somewhere).
        STATS["examples"] += 1
        STATS["reconciled"] += sum(self.reconciled.values())
        for kind in ("session.moved", "turn.redispatched", "turn.reconciled"):
            STATS[kind] += Event.objects.filter(kind=kind).count()
        STATS["parked"] += sum(len(d.parked) for d in self.daemons.values())
        STATS["refused"] += sum(1 for d in self.daemons.values() for r in d.produced.values()
                                for status, _ in r.answers if 400 <= status < 500)
        STATS["subruns"] += Run.objects.filter(parent_run__isnull=False).count()
        STATS["cancelled_with_subrun"] += Run.objects.filter(state="cancelled", child_runs__isnull=False).count()
        STATS["approvals_decided"] += Approval.objects.filter(status__in=["approved", "rejected"]).count()
        STATS["approvals_cancelled"] += Approval.objects.filter(status="cancelled").count()
        STATS["task_retries"] += AgentTask.objects.filter(retry_of__isnull=False).count()
        STATS["issue_reopens"] += AuditEntry.objects.filter(action="issue.reopen", outcome="in_progress").count()
        STATS["stops_confirmed"] += Turn.objects.filter(stop_state="confirmed").count()
        STATS["paused_runs"] += len(self.paused)
        for state, n in Run.objects.values_list("state").annotate(n=Count("pk")):
            STATS[f"run:{state}"] += n
        for state, n in Attempt.objects.values_list("state").annotate(n=Count("pk")):
            STATS[f"attempt:{state}"] += n
        transaction.set_rollback(True)
        self.atomic.__exit__(None, None, None)

    # -- helpers
    def time_passes(self):
        """Between two steps every serving daemon heartbeats (listing the processes it holds)."""
        for daemon in self.daemons.values():
            daemon.heartbeat()

    def tick_all(self):
        """The ticks the committed changes would have enqueued (on_commit never fires in the test's
        transaction): every live run, and the subruns that a tick started."""
        ticked = set()
        while True:
            live = [pk for pk in Run.objects.exclude(state__in=RUN_TERMINAL).order_by("created_at", "pk")
                    .values_list("pk", flat=True) if pk not in ticked]
            if not live:
                return
            for run_id in live:
                engine.run_tick_apply(run_id=run_id)
            ticked.update(live)

    def pick(self, data, queryset):
        # Draw an index, not an element: what Hypothesis draws must not depend on the database,
        # or it cannot replay and shrink a failing example.
        index = data.draw(st.integers(min_value=0, max_value=1000))
        items = list(queryset.order_by("created_at", "pk"))
        return items[index % len(items)] if items else None

    def pick_mostly(self, data, live, everything):
        """Mostly one of ``live`` (the ones an action can change), sometimes any (refused or unchanged)."""
        return self.pick(data, everything if data.draw(st.integers(0, 3), label="any") == 0 else live)

    def pick_from(self, data, items):
        """One of the modelled daemons' turns (or (turn, host) pairs), oldest turn first."""
        index = data.draw(st.integers(min_value=0, max_value=1000))
        items = list(items)
        turn_of = (lambda item: item[0]) if items and isinstance(items[0], tuple) else (lambda item: item)
        created = dict(Turn.objects.filter(pk__in=[turn_of(i) for i in items]).values_list("pk", "created_at"))
        items.sort(key=lambda item: (created.get(uuid.UUID(turn_of(item))) or timezone.now(), item))
        return items[index % len(items)] if items else None

    def attempt(self, fn, fast=False, **kwargs):
        """An operator's action; ``fast``: then every serving daemon takes its commands and sends its
        reports at once (the usual case; otherwise they lag behind, which the daemon rules play)."""
        self.time_passes()
        try:
            answer = fn(actor=self.operator, **kwargs)
        except ApplicationError:
            answer = None
        self.tick_all()
        if fast:
            self.daemons_catch_up()
        return answer

    def daemons_catch_up(self):
        for daemon in self.daemons.values():
            daemon.take_commands(acks_land=True)
            daemon.flush()
        self.tick_all()

    def daemon_of(self, host) -> ModelDaemon:
        return self.daemons[host]

    # -- what the modelled daemons see (checked as it happens)
    def command_seen(self, daemon, command):
        if not command.get("turn"):
            return
        turn = Turn.objects.select_related("session").get(pk=command["turn"])
        runner = turn.connection_id or turn.session.connection_id
        if runner != daemon.pk:
            self.violations.append(f"{command['action']} for turn {turn.pk} (run by {runner}) sent to {daemon.pk}")

    def answer_seen(self, daemon, report, status, answer):
        # Delivered means applied: the turn is now what the report says (an answer 2xx that changed
        # nothing would be a report silently dropped).
        if not 200 <= status < 300:
            self.violations.append(f"report {report.id} answered {status} was dropped as delivered")
            return
        reported = report.body.get("status")
        if report.path == "advance" and reported and answer.get("status") != reported:
            self.violations.append(f"report {report.id} ({reported}) answered {status} but the turn is "
                                   f"{answer.get('status')}")

    # -- conversation rules
    @rule(idea=st.sampled_from(["a", "b", "c"]), host=st.sampled_from(HOSTS), fast=st.booleans())
    def start(self, idea, host, fast):
        # The same idea from the other host moves its session (§3.1), also while its turn runs.
        daemon = self.daemon_of(host)
        self.attempt(actions.session_start, connection_id=daemon.pk, cwd=f"/srv/{host}", prompt="@reply ok",
                     idea_key=f"idea:{idea}", acknowledge_changes=True, fast=fast)

    @rule(data=st.data(), then=st.sampled_from(["nothing", "interrupt", "mark_interrupted"]), fast=st.booleans())
    def move_while_running(self, data, then, fast):
        """The same idea started from the other host while its turn runs: the session moves, the turn
        keeps running (and reporting) where it runs, the new turn queues behind it."""
        turn = self.pick(data, Turn.objects.filter(status__in=["running", "requires_action"]).select_related("session"))
        if turn is None:
            return
        host = next(h for h, d in self.daemons.items() if d.pk != turn.session.connection_id)
        self.attempt(actions.session_start, connection_id=self.daemon_of(host).pk, cwd=f"/srv/{host}",
                     prompt="elsewhere", idea_key=turn.session.idea_key, acknowledge_changes=True)
        if then == "interrupt":
            self.attempt(actions.turn_interrupt, turn_id=turn.pk, fast=fast)
        elif then == "mark_interrupted":
            self.mark_interrupted_turn(turn)

    @rule(data=st.data(), fast=st.booleans())
    def message(self, data, fast):
        session = self.pick(data, Session.objects.filter(status="active"))
        if session:
            self.attempt(actions.session_message, session_id=session.pk, prompt="more", fast=fast)

    @rule(data=st.data(), fast=st.booleans())
    def interrupt(self, data, fast):
        turn = self.pick_mostly(data, Turn.objects.filter(status__in=["pending", "running", "requires_action"]),
                                Turn.objects.all())
        if turn:
            self.attempt(actions.turn_interrupt, turn_id=turn.pk, fast=fast)

    @rule(data=st.data())
    def mark_interrupted(self, data):
        # On the portal's own evidence (its probe needs a live daemon and no transaction: not here).
        turn = self.pick(data, Turn.objects.filter(status__in=["running", "requires_action"]))
        if turn:
            self.mark_interrupted_turn(turn)

    def mark_interrupted_turn(self, turn):
        from sessions_app import selectors

        turn = Turn.objects.select_related("connection", "session__connection").get(pk=turn.pk)
        evidence = actions._evidence_without_probe(turn, selectors.turn_runner_connection(turn))
        if evidence is not None:
            self.attempt(actions.turn_mark_interrupted, turn_id=turn.pk, evidence=evidence)

    @rule(data=st.data(), fast=st.booleans())
    def resume(self, data, fast):
        session = self.pick(data, Session.objects.filter(status="active"))
        if session:
            self.attempt(actions.session_resume, session_id=session.pk, context="go on", fast=fast)

    # -- daemon rules
    @rule(host=st.sampled_from(HOSTS), acks_land=st.booleans())
    def daemon_takes_commands(self, host, acks_land):
        self.time_passes()
        self.daemon_of(host).take_commands(acks_land=acks_land)
        self.tick_all()

    @rule(data=st.data(), how=st.sampled_from(["ended", "crash", "succeeded", "succeeded", "succeeded", "failed",
                                                "requires_action", "output"]))
    def agent_exits(self, data, how):
        held = [(turn, host) for host, daemon in self.daemons.items() if not daemon.frozen for turn in daemon.procs]
        picked = self.pick_from(data, held)
        if picked is None:
            return
        turn, host = picked
        daemon = self.daemon_of(host)
        ended = dict(status=protocol.ENDED, final_reply="done")
        if how == "output":  # it talks and goes on
            daemon.report(turn, "events", events=[{"kind": "text", "data": {"text": "working"}}])
        elif how in {"succeeded", "failed"}:
            daemon.exit(turn, dict(path="events", events=[{"kind": "outcome", "data": {"intent": how}}]), ended)
        elif how == "ended":
            daemon.exit(turn, ended)
        elif how == "crash":
            daemon.exit(turn, dict(status=protocol.INTERRUPTED, reason="crash",
                                   wake_error={"kind": "exited_nonzero", "exit_code": 1}))
        else:
            daemon.exit(turn, dict(status=protocol.REQUIRES_ACTION,
                                   requires_action={"kind": "confirmation", "items": [{"id": "1", "text": "ok?"}]}))
        self.time_passes()
        daemon.flush()
        self.tick_all()
        daemon.take_commands(acks_land=True)  # the session's next turn, the run's next attempt
        daemon.flush()
        self.tick_all()

    @rule(host=st.sampled_from(HOSTS))
    def daemon_flushes(self, host):
        self.time_passes()
        daemon = self.daemon_of(host)
        daemon.land_outbox()
        daemon.flush()
        self.tick_all()

    @rule(host=st.sampled_from(HOSTS), how=st.sampled_from(["disconnect", "freeze"]), sweep=st.booleans())
    def daemon_goes_away(self, host, how, sweep):
        self.daemon_of(host).go_away(how)
        if sweep:  # and stays away past the heartbeat threshold: the sweep settles its turns offline
            self.offline_sweep(long=False)

    @rule(long=st.booleans())
    def offline_sweep(self, long):
        self.time_passes()
        now = timezone.now()
        if long:  # an hour passes (past the pending grace too); the serving daemons heartbeat all along
            now += timedelta(hours=1)
            serving = [daemon.pk for daemon in self.daemons.values() if daemon.serving]
            Connection.objects.filter(pk__in=serving).update(last_heartbeat_at=now)
        bridge.connections_sweep_stale(now=now)
        actions.stops_settle_overdue(now=now)
        self.tick_all()

    @rule(host=st.sampled_from(HOSTS), acks_land=st.booleans())
    def daemon_comes_back(self, host, acks_land):
        self.daemon_of(host).come_back(acks_land=acks_land)
        self.time_passes()
        self.tick_all()

    @rule(host=st.sampled_from(HOSTS), how=st.sampled_from(["disconnect", "freeze", "killed"]), data=st.data(),
          meanwhile=st.sampled_from(["nothing", "exits", "interrupt", "mark_interrupted"]))
    def daemon_outage(self, host, how, data, meanwhile):
        """The whole story at once: away past the threshold, swept, something happens meanwhile, back."""
        daemon = self.daemon_of(host)
        daemon.go_away("freeze" if how == "freeze" else "disconnect")
        if meanwhile == "mark_interrupted":  # an operator settles it first, on the stale heartbeat
            marked = self.pick_from(data, daemon.procs)
            if marked is not None:
                self.mark_interrupted_turn(Turn.objects.get(pk=marked))
        self.offline_sweep(long=False)
        turn = self.pick_from(data, daemon.procs)
        if turn is not None and meanwhile == "exits" and how != "freeze":
            daemon.exit(turn, dict(status=protocol.ENDED, final_reply="done while away"))
        elif turn is not None and meanwhile == "interrupt":
            self.attempt(actions.turn_interrupt, turn_id=turn)
        if how == "killed":
            daemon.killed_and_restarted()
        else:
            daemon.come_back()
        self.time_passes()
        self.tick_all()
        self.daemons_catch_up()

    @rule(host=st.sampled_from(HOSTS))
    def daemon_killed_and_restarted(self, host):
        self.daemon_of(host).killed_and_restarted()
        self.time_passes()
        self.tick_all()

    # -- run rules
    def few_live_runs(self):
        # Each step ticks every live run: a few at a time keep the example short and still interleave.
        # (Not a precondition: what Hypothesis draws must not depend on the database.)
        return Run.objects.exclude(state__in=RUN_TERMINAL).count() < MAX_LIVE_RUNS

    @rule(issue=st.sampled_from([0, 1]), declared=st.booleans(), fast=st.booleans())
    def start_run(self, issue, declared, fast):
        if not self.few_live_runs():
            return
        kwargs = {"issue_id": self.issues[issue].pk, "policy": {"infra_retries": 1}}
        if declared:
            kwargs.update(mode="declared", workflow_revision_id=self.revision.pk)
        else:
            kwargs.update(mode="direct", input={"prompt": "@outcome succeeded"})
        self.attempt(engine.run_start, fast=fast, **kwargs)

    @rule(data=st.data(), action=st.sampled_from(["pause", "pause", "resume", "cancel", "rerun"]),
          fast=st.booleans())
    def run_action(self, data, action, fast):
        run = self.pick_mostly(data, Run.objects.exclude(state__in=RUN_TERMINAL) if action != "rerun" else
                               Run.objects.filter(state__in=RUN_TERMINAL), Run.objects.all())
        if run:
            if action == "rerun" and not self.few_live_runs():
                return
            fn = {"pause": run_actions.run_pause, "resume": run_actions.run_resume, "cancel": run_actions.run_cancel,
                  "rerun": run_actions.run_rerun}[action]
            answer = self.attempt(fn, run_id=run.pk, fast=fast)
            if answer is not None and action in {"resume", "cancel"}:
                self.paused.pop(run.pk, None)  # the operator let it go on (or stop)

    @rule(data=st.data(), outcome=st.sampled_from(["succeeded", "failed", None]))
    def pause_while_its_agent_works(self, data, outcome):
        """Pause a run whose attempt's agent runs; the agent may then finish (its result is recorded,
        the run does not go on: §4.7)."""
        attempt = self.pick(data, Attempt.objects.filter(state="running", turn__status="running"))
        if attempt is None:
            return
        self.attempt(run_actions.run_pause, run_id=attempt.task.node.run_id)
        self.a_paused_run_stays_as_it_is()  # seen paused
        held = [(str(attempt.turn_id), h) for h, d in self.daemons.items() if str(attempt.turn_id) in d.procs]
        if outcome and held and not self.daemon_of(held[0][1]).frozen:
            daemon = self.daemon_of(held[0][1])
            daemon.exit(held[0][0], dict(path="events", events=[{"kind": "outcome", "data": {"intent": outcome}}]),
                        dict(status=protocol.ENDED, final_reply="done"))
            daemon.flush()
            self.tick_all()

    @rule(data=st.data(), decide=st.booleans())
    def cancel_a_run_with_a_subrun(self, data, decide):
        """Cancel a parent whose subrun is under way; then someone tries to decide the child's approval."""
        run = self.pick(data, Run.objects.filter(parent_run__isnull=True, child_runs__isnull=False).exclude(
            state__in=RUN_TERMINAL).distinct())
        if run is None:
            return
        self.attempt(run_actions.run_cancel, run_id=run.pk, fast=True)
        self.paused.pop(run.pk, None)
        approval = Approval.objects.filter(node__run__parent_run=run).order_by("created_at", "pk").first()
        if decide and approval is not None:
            self.attempt(run_actions.approval_decide, approval_id=approval.pk, decision="approved", fast=True)

    @rule(data=st.data(), decision=st.sampled_from(["approved", "approved", "rejected"]))
    def decide_approval(self, data, decision):
        # Mostly the pending ones; sometimes one decided or cancelled already (refused or unchanged).
        approval = self.pick_mostly(data, Approval.objects.filter(status="pending"), Approval.objects.all())
        if approval:
            self.attempt(run_actions.approval_decide, approval_id=approval.pk, decision=decision, fast=True)

    @rule(data=st.data(), cancel_first=st.sampled_from([True, False, False]))
    def retry_task(self, data, cancel_first):
        # A cancelled task blocks its node until it is retried (or the run cancelled).
        task = self.pick_mostly(data, AgentTask.objects.exclude(node__run__state__in=RUN_TERMINAL),
                                AgentTask.objects.all())
        if task:
            if cancel_first:
                self.attempt(run_actions.task_cancel, task_id=task.pk)
            self.attempt(run_actions.task_retry, task_id=task.pk, fast=True)

    @rule(issue=st.sampled_from([0, 1]), rerun=st.booleans())
    def reopen_issue(self, issue, rerun):
        # Its automatic completion made it done; reopened, its finished run can be rerun.
        self.attempt(run_actions.issue_reopen, issue_id=self.issues[issue].pk)
        last = Run.objects.filter(issue=self.issues[issue], state__in=RUN_TERMINAL, parent_run__isnull=True).order_by(
            "-created_at").first()
        if rerun and last is not None and self.few_live_runs():
            self.attempt(run_actions.run_rerun, run_id=last.pk, fast=True)

    # -- invariants
    @invariant()
    def nothing_seen_that_must_not_be(self):
        assert not self.violations, self.violations

    @invariant()
    def at_most_one_turn_running_or_in_flight_per_session(self):
        # In flight: running, waiting for an answer, or sent to the daemon and not yet settled.
        running = Counter(Turn.objects.filter(status__in=["running", "requires_action"]).values_list(
            "session_id", flat=True))
        assert all(count <= 1 for count in running.values()), running
        sent = Counter(dict(Turn.objects.filter(status="pending", commands__action__in=["start_turn", "resume"],
                                                commands__state__in=["pending", "delivered", "acked"])
                            .values_list("session_id").annotate(n=Count("pk", distinct=True))))
        assert all(running[s] + sent[s] <= 1 for s in set(running) | set(sent)), (running, sent)

    @invariant()
    def seq_strictly_increasing(self):
        seqs: dict = {}
        for session_id, seq in Turn.objects.order_by("created_at", "id").values_list("session_id", "seq"):
            assert seq > seqs.get(session_id, 0), (session_id, seq, seqs.get(session_id))
            seqs[session_id] = seq

    @invariant()
    def terminal_states_are_final(self):
        for pk, status, reason in Turn.objects.values_list("pk", "status", "interrupted_reason"):
            if pk in self.final_turns and (status, reason) != self.final_turns[pk][:2]:
                # The one way out: interrupted(offline) → running by the audited reconcile (its daemon
                # holds the turn), each time with its event and audit entry; it may have settled again
                # since (within the same step).
                before, seen = self.final_turns.pop(pk)[:2], self.final_turns_reconciles.pop(pk)
                events = Event.objects.filter(kind="turn.reconciled", data__id=str(pk)).count()
                audits = AuditEntry.objects.filter(action="turn.reconcile", target=f"turn:{pk}").count()
                assert before == ("interrupted", "offline") and events > seen, \
                    f"turn {pk} left terminal {before} for {status}({reason}) (reconciles {seen} → {events})"
                assert events == audits, (events, audits)
                self.reconciled[pk] = events
            if pk not in self.final_turns and status in TURN_TERMINAL:
                self.final_turns[pk] = (status, reason)
                self.final_turns_reconciles[pk] = Event.objects.filter(kind="turn.reconciled", data__id=str(pk)).count()
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
    def attempt_numbers_and_task_ordinals_strictly_increase(self):
        numbers: dict = {}
        for task_id, number in Attempt.objects.order_by("created_at", "id").values_list("task_id", "number"):
            assert number > numbers.get(task_id, 0)
            numbers[task_id] = number
        ordinals: dict = {}
        active = Counter()
        for node_id, ordinal, status in AgentTask.objects.order_by("created_at", "id").values_list(
                "node_id", "ordinal", "status"):
            assert ordinal > ordinals.get(node_id, 0)
            ordinals[node_id] = ordinal
            active[node_id] += status not in TASK_TERMINAL
        assert all(count <= 1 for count in active.values()), active

    @invariant()
    def never_confirmed_while_a_process_lives(self):
        held = {turn for daemon in self.daemons.values() for turn in daemon.procs}
        confirmed = {str(pk) for pk in Turn.objects.filter(stop_state="confirmed").values_list("pk", flat=True)}
        assert not held & confirmed, f"stop confirmed while the daemon holds a live process: {held & confirmed}"

    @invariant()
    def a_held_process_of_a_settled_turn_runs_again_or_is_told_to_stop(self):
        """Issue 7 item 10: once its daemon has listed it, a process of a turn the portal settled
        interrupted (offline, or marked by an operator) is reopened or that daemon is asked to stop it."""
        for daemon in self.daemons.values():
            if daemon.listed_at is None:
                continue
            settled = Turn.objects.filter(pk__in=list(daemon.procs), status="interrupted",
                                          ended_at__lt=daemon.listed_at).select_related("session")
            for turn in settled:
                if (turn.connection_id or turn.session.connection_id) != daemon.pk:
                    continue
                asked = ControlCommand.objects.filter(turn=turn, connection_id=daemon.pk, action="interrupt",
                                                      created_at__gte=turn.ended_at).exists()
                assert turn.stop_state != "none" or asked, \
                    f"turn {turn.pk} settled {turn.status}({turn.interrupted_reason}) while {daemon.pk} holds it"

    @invariant()
    def no_report_dropped(self):
        for host, daemon in self.daemons.items():
            spooled = Counter(r.id for r in daemon.spool)
            parked = Counter(r.id for r in daemon.parked)
            for report_id, report in daemon.produced.items():
                places = (report_id in daemon.delivered) + spooled[report_id] + parked[report_id]
                assert places == 1, f"report {report_id} of {host}: delivered/spooled/parked {places} times"
            for report in daemon.parked:
                # Parked only on the portal's refusal, with the reason it gave (a §8 code, never a 500).
                assert report.answers and all(400 <= s < 500 and code for s, code in report.answers[-2:]), \
                    report.answers

    @invariant()
    def commands_go_to_the_connection_that_runs_the_turn(self):
        for connection_id, runner, home, action in ControlCommand.objects.filter(turn__isnull=False).values_list(
                "connection_id", "turn__connection_id", "turn__session__connection_id", "action"):
            if action in {"interrupt", "probe"}:
                assert connection_id == (runner or home), action
            else:
                assert connection_id == runner, action

    @invariant()
    def a_cancelled_run_leaves_no_subrun_or_approval_behind(self):
        assert not Run.objects.filter(parent_run__state="cancelled").exclude(state__in=RUN_TERMINAL).exists()
        # ...and from the moment of the cancel its subruns are being cancelled too.
        assert not Run.objects.filter(parent_run__state__in=["cancelling", "cancelled"]).exclude(
            state__in=RUN_TERMINAL | {"cancelling"}).exists()
        # A cancel reaches the whole tree's approvals at once, and a decided (or cancelled) approval
        # stays so: nothing of a cancelled tree is decided afterwards.
        assert not Approval.objects.filter(node__run__state__in=["cancelling", "cancelled"], status="pending").exists()
        for pk, status in Approval.objects.values_list("pk", "status"):
            if pk in self.final_approvals:
                assert status == self.final_approvals[pk], f"approval {pk} left {self.final_approvals[pk]}"
            elif status != "pending":
                self.final_approvals[pk] = status

    @invariant()
    def a_paused_run_stays_as_it_is(self):
        for run_id, state in Run.objects.filter(pk__in=list(self.paused)).values_list("pk", "state"):
            nodes, attempts = self.paused[run_id]
            if state in {"cancelling", "cancelled"} and AuditEntry.objects.filter(
                    action="run.cancel", target=f"run:{run_id}").exclude(outcome="unchanged").exists():
                del self.paused[run_id]  # an operator cancelled it (or the run above it): it may stop
                continue
            assert state == "paused", f"paused run {run_id} went {state} with no operator resume"
            assert Attempt.objects.filter(task__node__run_id=run_id).count() == attempts
            now = dict(RunNode.objects.filter(run_id=run_id).values_list("pk", "state"))
            for pk, before in nodes.items():  # running nodes may record their attempt's result
                assert now[pk] == before or before in {"running", "waiting"}, (pk, before, now[pk])
        for run_id in Run.objects.filter(state="paused").exclude(pk__in=list(self.paused)).values_list("pk", flat=True):
            self.paused[run_id] = (dict(RunNode.objects.filter(run_id=run_id).values_list("pk", "state")),
                                   Attempt.objects.filter(task__node__run_id=run_id).count())


@pytest.mark.django_db
def test_conversation_run_and_daemon_invariants_hold():
    # No shrinking: each step touches the database, and shrinking a failure would outlast the test's
    # timeout; the unshrunk failing sequence is printed instead.  About 45 s on a loaded 2-core
    # machine; CHORUS_STATEFUL_EXAMPLES / _STEPS explore further (e.g. 200 / 40 before a release).
    STATS.clear()
    run_state_machine_as_test(Conversations, settings=settings(
        max_examples=int(os.environ.get("CHORUS_STATEFUL_EXAMPLES", 20)),
        stateful_step_count=int(os.environ.get("CHORUS_STATEFUL_STEPS", 30)), deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    ))
    print("reached:", dict(STATS))  # with -s: what the examples got to (reconciles, parked reports, ...)

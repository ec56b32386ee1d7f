"""Which runs need a tick, read from the database alone (issue 7 items 1 and 2).

A tick is asked for by a Celery message (after a turn changed, a node was decided, a run was
started or resumed), and a message can be lost: a worker SIGKILLed holding it, a broker down when
it was sent, a listener that failed.  Every tick the engine could be waiting for therefore leaves
a trace in the rows themselves, and the periodic ``runs_tick_waiting`` ticks each run found here.
A tick of a run that needs none changes nothing (it takes the run's row lock and converges), so a
false positive costs one tick; a false negative is a run that never moves again.
"""

from __future__ import annotations

from django.db.models import Exists, OuterRef

from sessions_app import states as session_states
from sessions_app.models import Turn

from . import states
from .models import AgentTask, Attempt, Run, RunNode

LIVE_RUN = ["running", "waiting", "cancelling"]


def runs_needing_a_tick() -> list[str]:
    ids: set = set()
    # Waiting runs: their cause may have cleared (host back, capacity, a decision, a backoff over).
    # Cancelling runs: they finish once their attempts are terminal.
    ids |= set(Run.objects.filter(state__in=["waiting", "cancelling"]).values_list("pk", flat=True))
    ids |= set(_attempts_whose_turn_ended())
    ids |= set(_running_runs_with_work_to_dispatch())
    # Timers fall due, dependencies finish (also in a running run with other work going on).
    ids |= set(RunNode.objects.filter(run__state__in=["running", "waiting"], state="waiting",
                                      wait_reason__in=["timer", "dependency"]).values_list("run_id", flat=True))
    return [str(i) for i in ids]


def _attempts_whose_turn_ended():
    """A live attempt whose latest turn is over: the engine has not heard (the listener's tick lost)."""
    turns = Turn.objects.filter(attempt_id=OuterRef("pk"))
    return (Attempt.objects.filter(task__node__run__state__in=LIVE_RUN)
            .exclude(state__in=states.ATTEMPT_TERMINAL)
            .filter(Exists(turns.filter(status__in=session_states.TURN_TERMINAL)))
            .exclude(Exists(turns.filter(status__in=session_states.TURN_ACTIVE)))
            .values_list("task__node__run_id", flat=True))


def _running_runs_with_work_to_dispatch() -> set:
    running = RunNode.objects.filter(run__state="running")
    ids = set(running.filter(state="ready").values_list("run_id", flat=True))
    # A running agent node with no live task (its task ended; a policy retry or a block is due).
    live_tasks = AgentTask.objects.filter(node=OuterRef("pk")).exclude(status__in=states.TASK_TERMINAL)
    ids |= set(running.filter(type="agent", state="running").exclude(Exists(live_tasks))
               .values_list("run_id", flat=True))
    # A live task without a live attempt (an infrastructure retry after its backoff, a fresh fallback).
    live_attempts = Attempt.objects.filter(task=OuterRef("pk")).exclude(state__in=states.ATTEMPT_TERMINAL)
    ids |= set(AgentTask.objects.filter(node__run__state="running").exclude(status__in=states.TASK_TERMINAL)
               .exclude(status="waiting").exclude(Exists(live_attempts)).values_list("node__run_id", flat=True))
    # A running run whose nodes are all over (the tick that completes it was lost).
    live_nodes = RunNode.objects.filter(run=OuterRef("pk")).exclude(state__in=states.NODE_TERMINAL)
    ids |= set(Run.objects.filter(state="running").exclude(Exists(live_nodes)).values_list("pk", flat=True))
    ids |= _pending_nodes_whose_dependencies_ended()
    return ids


def _pending_nodes_whose_dependencies_ended() -> set:
    """A pending node becomes ready (or skipped) once its dependencies are over; the tick that
    promotes it may be the one lost (a signal, a decision, a subrun finishing its parent's node)."""
    pending = list(RunNode.objects.filter(run__state="running", state="pending").values_list("run_id", "depends_on"))
    if not pending:
        return set()
    node_states = {(run_id, key): state for run_id, key, state in RunNode.objects.filter(
        run_id__in={run_id for run_id, _ in pending}).values_list("run_id", "key", "state")}
    ids = set()
    for run_id, depends_on in pending:
        deps = depends_on if isinstance(depends_on, list) else []
        if all(node_states.get((run_id, key), "succeeded") in states.NODE_TERMINAL for key in deps):
            ids.add(run_id)
    return ids

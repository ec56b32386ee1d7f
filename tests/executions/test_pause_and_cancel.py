"""Pause holds a run still until an operator resumes it; cancel reaches subruns and their approvals
(issue 7 item 12, SPEC §4.7).  Engine and actions on PostgreSQL, no agents."""

from __future__ import annotations

import pytest

from chorus_site.errors import ApplicationError
from executions import actions, engine
from executions.models import Approval, Attempt, Run
from executions.workflows import workflow_create
from tests import factories
from tests.executions.test_engine_fallback import declared, finish_with, live

pytestmark = pytest.mark.django_db


def test_a_paused_run_whose_last_node_succeeds_stays_paused_until_resumed(operator):
    connection = live(factories.make_connection(cwds=["/srv/a"]))
    run = declared([{"key": "only", "type": "agent", "prompt": "@outcome succeeded"}], connection)
    actions.run_pause(actor=operator, run_id=run.pk)
    paused_at = factories.last_event_id()
    attempt = Attempt.objects.get(task__node__run=run)
    finish_with(connection, attempt, "succeeded")
    engine.run_tick_apply(run_id=run.pk)  # and again: nothing more happens
    run.refresh_from_db()
    assert run.state == "paused"
    assert Attempt.objects.get(pk=attempt.pk).state == "succeeded"  # the result is recorded
    assert run.nodes.get().state == "succeeded"
    assert not [e for e in factories.events_since(paused_at) if e.stream == run.stream and e.kind == "run.state"]
    assert run.issue.status == "in_progress"  # nor does the issue move
    answer = actions.run_resume(actor=operator, run_id=run.pk)
    assert answer["changed"] is True
    engine.run_tick_apply(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "succeeded"
    states = [(e.data.get("state"), e.actor) for e in factories.events_since(paused_at)
              if e.stream == run.stream and e.kind == "run.state"]
    assert states[0] == ("running", operator.username)  # resumed by the operator, not by the system


def test_a_paused_run_dispatches_nothing_new():
    connection = live(factories.make_connection(cwds=["/srv/a"]))
    run = declared([{"key": "first", "type": "agent", "prompt": "@outcome succeeded"},
                    {"key": "second", "type": "agent", "depends_on": ["first"], "prompt": "@outcome succeeded"}],
                   connection)
    actions.run_pause(actor=None, run_id=run.pk)
    finish_with(connection, Attempt.objects.get(task__node__run=run), "succeeded")
    engine.run_tick_apply(run_id=run.pk)
    assert run.nodes.get(key="second").state == "pending"
    assert Attempt.objects.filter(task__node__run=run).count() == 1
    actions.run_resume(actor=None, run_id=run.pk)
    engine.run_tick_apply(run_id=run.pk)
    assert run.nodes.get(key="second").state == "running"


def subrun_tree():
    """parent → subrun child → subrun grandchild, whose approval node waits."""
    leaf = workflow_create(name=factories.unique("wf-leaf"), spec={"nodes": [{"key": "ok", "type": "approval"}]})
    middle = workflow_create(name=factories.unique("wf-mid"),
                             spec={"nodes": [{"key": "deeper", "type": "subrun", "revision": str(leaf.pk)}]})
    top = workflow_create(name=factories.unique("wf-top"),
                          spec={"nodes": [{"key": "sub", "type": "subrun", "revision": str(middle.pk)}]})
    parent = engine.run_start(issue_id=factories.make_issue().pk, mode="declared", workflow_revision_id=top.pk)
    engine.run_tick_apply(run_id=parent.pk)
    child = Run.objects.get(parent_run=parent)
    engine.run_tick_apply(run_id=child.pk)
    grandchild = Run.objects.get(parent_run=child)
    engine.run_tick_apply(run_id=grandchild.pk)
    approval = Approval.objects.get(node__run=grandchild)
    assert [r.state for r in Run.objects.filter(pk__in=[parent.pk, child.pk, grandchild.pk]).order_by("id")] == \
        ["waiting"] * 3 and approval.status == "pending"
    return parent, child, grandchild, approval


def test_cancelling_a_parent_cancels_its_subruns_and_their_approvals(operator):
    parent, child, grandchild, approval = subrun_tree()
    answer = actions.run_cancel(actor=operator, run_id=parent.pk, reason="wrong issue")
    for run in (child, grandchild):
        assert Run.objects.get(pk=run.pk).state == "cancelling"
    assert answer["cancelled_subruns"] == [str(child.pk)]  # the grandchild through its own parent
    approval.refresh_from_db()
    assert approval.status == "cancelled"
    with pytest.raises(ApplicationError) as refused:
        actions.approval_decide(actor=operator, approval_id=approval.pk, decision="approved")
    assert refused.value.code == "invalid_transition"
    # Ticks in any order: the parent is cancelled only once its subruns are.
    for run in (parent, grandchild, child, parent):
        engine.run_tick_apply(run_id=run.pk)
    assert [Run.objects.get(pk=r.pk).state for r in (parent, child, grandchild)] == ["cancelled"] * 3
    assert Approval.objects.get(pk=approval.pk).status == "cancelled"
    from chorus_site.models import AuditEntry

    assert AuditEntry.objects.filter(action="run.cancel", target__in=[f"run:{r.pk}" for r in
                                                                      (parent, child, grandchild)]).count() == 3


def test_a_cancelled_parent_waits_for_its_subrun_before_it_is_cancelled(operator):
    parent, child, grandchild, _ = subrun_tree()
    actions.run_cancel(actor=operator, run_id=parent.pk)
    engine.run_tick_apply(run_id=parent.pk)
    assert Run.objects.get(pk=parent.pk).state == "cancelling"  # its subrun is not finished yet

"""Runs end to end (issue: run engine): every attempt is a real turn on the real daemon."""

from __future__ import annotations

import pytest

from executions.models import AgentTask, Attempt, Issue, Run
from sessions_app.models import Turn
from tests.e2e.conftest import alive, output_value, wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]


def create_issue(api, **extra) -> dict:
    status, body = api.call("POST", "/issues", {"title": "Add a greeting", "body": "Write hello.txt.",
                                                "acceptance_criteria": "hello.txt exists", **extra})
    assert status == 201, body
    return body


def wait_run(run_id, states_wanted, timeout=60) -> Run:
    return wait_until(lambda: (r := Run.objects.get(pk=run_id)).state in states_wanted and r, timeout=timeout,
                      message=f"run to reach {states_wanted}")


def test_direct_run_succeeds_on_an_explicit_outcome(bridge):
    api = bridge["api"]
    issue = create_issue(api)
    status, body = api.call("POST", "/runs", {
        "issue": issue["id"], "mode": "direct", "target": {"connection": str(bridge["connection"].pk)},
        "input": {"prompt": "@write hello.txt hello\n@outcome succeeded\n@reply Greeting written."}})
    assert status == 201, body
    run = wait_run(body["run"], {"succeeded", "failed"})
    assert run.state == "succeeded"
    attempt = Attempt.objects.get(task__node__run=run)
    assert attempt.state == "succeeded" and attempt.turn.final_reply == "Greeting written."
    assert attempt.session.idea_key == f"task:{attempt.task_id}"
    assert "Issue: Add a greeting" in attempt.turn.prompt and "hello.txt exists" in attempt.turn.prompt
    assert Issue.objects.get(pk=issue["id"]).status == "in_review"  # acceptance is a separate act
    status, detail = api.call("GET", f"/runs/{run.pk}")
    assert detail["nodes"][0]["tasks"][0]["attempts"][0]["state"] == "succeeded"


def test_prose_is_not_success_and_a_rerun_is_a_new_run(bridge):
    api = bridge["api"]
    issue = create_issue(api)
    status, body = api.call("POST", "/runs", {"issue": issue["id"], "mode": "direct",
                                              "input": {"prompt": "@reply I will continue later."}})
    assert status == 201, body
    run = wait_run(body["run"], {"succeeded", "failed"})
    assert run.state == "failed"
    assert Attempt.objects.get(task__node__run=run).failure_code == "no_outcome"
    status, again = api.call("POST", f"/runs/{run.pk}/rerun", {})
    assert status == 200, again
    rerun = Run.objects.get(pk=again["run"])
    assert rerun.rerun_of_id == run.pk and rerun.input == run.input and rerun.issue_id == run.issue_id
    wait_run(rerun.pk, {"failed"})
    assert Run.objects.get(pk=run.pk).state == "failed"  # history is not rewritten


def test_agent_failure_under_a_retry_policy_makes_a_second_task(bridge, ops_admin_user):
    from chorus_site.tokens import token_create
    from tests.e2e.conftest import Api

    _t, raw = token_create(user=ops_admin_user, name="admin")
    admin_api = Api(bridge["portal"], raw)
    status, wf = admin_api.call("POST", "/workflows", {"name": "retry-once", "spec": {"nodes": [
        {"key": "build", "type": "agent", "prompt": "@outcome failed\n@reply could not build {{ input.target }}",
         "retry": {"max_task_retries": 1}}]}})
    assert status == 201, wf
    issue = create_issue(bridge["api"])
    status, body = bridge["api"].call("POST", "/runs", {"issue": issue["id"], "mode": "declared",
                                                        "workflow_revision": wf["revision"],
                                                        "input": {"target": "the api"}})
    assert status == 201, body
    run = wait_run(body["run"], {"succeeded", "failed"}, timeout=90)
    assert run.state == "failed"
    first, second = AgentTask.objects.filter(node__run=run).order_by("ordinal")
    assert second.retry_of_id == first.pk
    assert "could not build the api" in Attempt.objects.get(task=first).turn.final_reply


def test_cancel_interrupts_a_stop_ignoring_agent_and_ends_cancelled(bridge):
    api = bridge["api"]
    issue = create_issue(api)
    status, body = api.call("POST", "/runs", {"issue": issue["id"], "mode": "direct",
                                              "input": {"prompt": "@ignore-stop\n@grandchild 120\n@sleep 120"}})
    run_id = body["run"]
    wait_until(lambda: Attempt.objects.filter(task__node__run_id=run_id, state="running").exists(), timeout=30,
               message="the attempt to run")
    attempt_turn = Attempt.objects.get(task__node__run_id=run_id).turn
    grandchild_pid = int(output_value(attempt_turn, "grandchild_pid"))
    agent_pid = Turn.objects.get(pk=attempt_turn.pk).pid
    status, answer = api.call("POST", f"/runs/{run_id}/cancel", {"reason": "not needed"})
    assert status == 200 and answer["interrupted_turns"]
    run = wait_run(run_id, {"cancelled"}, timeout=30)
    assert all(a.state in {"cancelled", "failed", "succeeded"} for a in Attempt.objects.filter(task__node__run=run))
    turn = Attempt.objects.get(task__node__run=run).turn
    assert turn.stop_state == "confirmed"
    assert not alive(agent_pid) and not alive(grandchild_pid)  # no process left
    assert Issue.objects.get(pk=issue["id"]).status == "in_progress"  # not accepted, nothing rolled back


def test_pause_stops_new_dispatch_while_the_running_attempt_finishes(bridge, ops_admin_user):
    from chorus_site.tokens import token_create
    from tests.e2e.conftest import Api

    _t, raw = token_create(user=ops_admin_user, name="admin")
    status, wf = Api(bridge["portal"], raw).call("POST", "/workflows", {"name": "two-steps", "spec": {"nodes": [
        {"key": "first", "type": "agent", "prompt": "@sleep 4\n@outcome succeeded"},
        {"key": "second", "type": "agent", "depends_on": ["first"], "prompt": "@outcome succeeded"}]}})
    issue = create_issue(bridge["api"])
    status, body = bridge["api"].call("POST", "/runs", {"issue": issue["id"], "mode": "declared",
                                                        "workflow_revision": wf["revision"]})
    run_id = body["run"]
    wait_until(lambda: Attempt.objects.filter(task__node__run_id=run_id, state="running").exists(), timeout=30,
               message="the first attempt to run")
    status, paused = bridge["api"].call("POST", f"/runs/{run_id}/pause", {})
    assert status == 200 and paused["state"] == "paused"
    first = wait_until(lambda: Attempt.objects.filter(task__node__run_id=run_id, state="succeeded").first(),
                       timeout=30, message="the running attempt to finish while paused")
    assert first.task.node.key == "first"
    run = Run.objects.get(pk=run_id)
    assert run.state == "paused"
    assert not AgentTask.objects.filter(node__run=run, node__key="second").exists()  # nothing new dispatched
    status, resumed = bridge["api"].call("POST", f"/runs/{run_id}/resume", {})
    assert status == 200
    assert wait_run(run_id, {"succeeded", "failed"}, timeout=60).state == "succeeded"


def test_killing_the_daemon_mid_attempt_makes_attempt_2_which_succeeds(bridge):
    from sessions_app.models import Connection
    from tests.e2e.conftest import wait_online

    api = bridge["api"]
    issue = create_issue(api)
    status, body = api.call("POST", "/runs", {
        "issue": issue["id"], "mode": "direct", "target": {"connection": str(bridge["connection"].pk)},
        "input": {"prompt": "@sleep 6\n@outcome succeeded\n@reply done after the outage"}})
    run_id = body["run"]
    wait_until(lambda: Attempt.objects.filter(task__node__run_id=run_id, state="running").exists(), timeout=30,
               message="attempt 1 to run")
    bridge["daemon"].kill()
    wait_until(lambda: Connection.objects.get(pk=bridge["connection"].pk).status == "offline", timeout=30,
               message="the connection to go offline")
    bridge["daemon"].start()  # it stops what its killed predecessor left and reports it
    wait_online(bridge["connection"])
    run = wait_run(run_id, {"succeeded", "failed"}, timeout=120)
    assert run.state == "succeeded"
    first, second = Attempt.objects.filter(task__node__run=run).order_by("number")
    assert (first.state, first.failure_code) == ("failed", "infrastructure")
    assert second.state == "succeeded" and second.task_id == first.task_id
    assert second.session_id == first.session_id  # same task, same connection: the same session
    assert AgentTask.objects.filter(node__run=run).count() == 1
    # The troubleshooting record names both attempts with their session and connection.
    status, record = api.call("GET", f"/runs/{run.pk}/troubleshooting")
    assert status == 200, record
    listed = {a["id"]: a for node in record["nodes"] for task in node["tasks"] for a in task["attempts"]}
    assert set(listed) == {str(first.pk), str(second.pk)}
    for attempt in (first, second):
        row = listed[str(attempt.pk)]
        assert row["session"]["id"] == str(attempt.session_id)
        assert row["connection"]["id"] == str(attempt.connection_id)


def test_a_declared_run_with_a_tolerated_failure_is_partial_succeeded(bridge, ops_admin_user):
    from chorus_site.tokens import token_create
    from tests.e2e.conftest import Api

    _t, raw = token_create(user=ops_admin_user, name="admin")
    status, wf = Api(bridge["portal"], raw).call("POST", "/workflows", {"name": "partial", "spec": {"nodes": [
        {"key": "docs", "type": "agent", "prompt": "@outcome succeeded\n@reply docs done"},
        {"key": "lint", "type": "agent", "prompt": "@outcome failed\n@reply 3 warnings", "continue_on_failure": True},
        {"key": "report", "type": "agent", "depends_on": ["docs", "lint"], "prompt": "@outcome succeeded"},
    ]}})
    assert status == 201, wf
    issue = create_issue(bridge["api"])
    status, body = bridge["api"].call("POST", "/runs", {"issue": issue["id"], "mode": "declared",
                                                        "workflow_revision": wf["revision"]})
    run = wait_run(body["run"], {"succeeded", "partial_succeeded", "failed"}, timeout=90)
    assert run.state == "partial_succeeded"
    assert Issue.objects.get(pk=issue["id"]).status == "in_review"


def test_adaptive_lead_adds_members_through_its_task_token(bridge):
    api = bridge["api"]
    issue = create_issue(api)
    lead_prompt = ("@member docs @outcome succeeded\n@member tests @outcome succeeded\n"
                   "@outcome succeeded\n@reply team assembled")
    status, body = api.call("POST", "/runs", {"issue": issue["id"], "mode": "adaptive",
                                              "input": {"prompt": lead_prompt}})
    assert status == 201, body
    run = wait_run(body["run"], {"succeeded", "failed"}, timeout=90)
    assert run.state == "succeeded"
    keys = sorted(run.nodes.values_list("key", flat=True))
    assert keys == ["lead", "member:docs", "member:tests"]
    assert AgentTask.objects.get(node__run=run, node__key="lead").leader is True
    assert all(n.state == "succeeded" for n in run.nodes.all())


def test_subrun_node_finishes_with_the_child_runs_result(bridge, ops_admin_user):
    from chorus_site.tokens import token_create
    from tests.e2e.conftest import Api

    _t, raw = token_create(user=ops_admin_user, name="admin")
    admin_api = Api(bridge["portal"], raw)
    status, child = admin_api.call("POST", "/workflows", {"name": "child", "spec": {"nodes": [
        {"key": "inner", "type": "agent", "prompt": "@outcome succeeded\n@reply inner done"}]}})
    assert status == 201, child
    status, parent = admin_api.call("POST", "/workflows", {"name": "parent", "spec": {"nodes": [
        {"key": "sub", "type": "subrun", "revision": child["revision"]},
        {"key": "after", "type": "agent", "depends_on": ["sub"], "prompt": "@outcome succeeded"}]}})
    assert status == 201, parent
    issue = create_issue(bridge["api"])
    status, body = bridge["api"].call("POST", "/runs", {"issue": issue["id"], "mode": "declared",
                                                        "workflow_revision": parent["revision"]})
    run = wait_run(body["run"], {"succeeded", "failed"}, timeout=90)
    assert run.state == "succeeded"
    child_run = Run.objects.get(parent_run=run)
    assert child_run.mode == "subrun" and child_run.state == "succeeded"
    assert child_run.parent_node.key == "sub"

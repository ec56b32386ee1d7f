"""Demo users and data: every page of the admin worth looking at (idempotent).

Users: one per role of SPEC §7, passwords (re)set and printed on every run.
Data: created once through the services, so every object has its event timeline.
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from chorus_site.permissions import ADMIN, DIAGNOSTICS, OPERATOR, VIEWER
from executions import services as ex
from executions.workflows import workflow_create
from executions.models import AgentTask, Approval, Attempt, Run, RunNode, WorkflowDefinition, WorkflowRevision
from sessions_app import services as ss
from sessions_app.models import BackendSetting, Connection

DEMO_USERS = [("viewer", VIEWER), ("operator", OPERATOR), ("diagnostics", DIAGNOSTICS), ("admin", ADMIN)]
CANARY = "sk-ant-demo0000SECRET0000canary0000key"  # shows redaction at work; not a real key


def demo_workspace() -> Path:
    """The local daemon's directory, a git repository of its own with one commit.

    It lies under var/, which the project's own checkout ignores: without a repository here git
    would answer for the project's and report every change of the agent as nothing.
    """
    path = Path(settings.DATA_DIR) / "demo-workspace"
    path.mkdir(parents=True, exist_ok=True)
    if not (path / ".git").exists():
        git = ["git", "-C", str(path), "-c", "user.name=Chorus demo", "-c", "user.email=demo@chorus.invalid"]
        subprocess.run([*git, "init", "-q"], check=True)
        readme = path / "README.md"
        if not readme.exists():
            readme.write_text("# Demo workspace\n\nThe scripted agent of `make run` works here.\n")
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "Demo workspace"], check=True)
    return path


class Command(BaseCommand):
    help = "Create demo users (one per ops role) and demo data; safe to run again."

    def add_arguments(self, parser):
        parser.add_argument("--users-only", action="store_true", help="only (re)set the demo users")
        parser.add_argument("--quiet-logins", action="store_true", help="do not print the logins")

    def handle(self, *args, **options):
        logins = self._users()
        if not options["users_only"]:
            if Connection.objects.filter(name="laptop-alice").exists():
                self.stdout.write("Demo data already present; left as it is.")
            else:
                with transaction.atomic():
                    self._data()
                self.stdout.write(self.style.SUCCESS("Demo data created."))
        if not options["quiet_logins"]:
            self.stdout.write("\nDemo logins (passwords are new on every run):")
            for username, role, password in logins:
                self.stdout.write(f"  {username:<12} {password:<24} role {role}")

    # ------------------------------------------------------------ users
    def _users(self):
        User = get_user_model()
        logins = []
        for username, role in DEMO_USERS:
            user, _ = User.objects.get_or_create(username=username, defaults={"is_staff": True})
            password = f"{username}-{secrets.token_urlsafe(9)}"
            user.set_password(password)
            user.is_staff = True
            user.is_active = True
            user.save()
            user.groups.set([Group.objects.get(name=role)])
            logins.append((username, role, password))
        return logins

    # ------------------------------------------------------------ data
    def _data(self):
        demo_dir = str(demo_workspace())
        now = timezone.now()
        alice, _ = ss.connection_register(name="laptop-alice", host="alice-mbp.local", backend="scripted",
                                          cwds=[demo_dir, "/srv/repos"])
        ss.connection_set_status(connection_id=alice.pk, status="online", last_heartbeat_at=now,
                                 daemon_version="0.1.0")
        build, _ = ss.connection_register(name="build-box", host="build-01.internal", backend="claude_code",
                                          cwds=["/srv/build"])
        ss.connection_set_status(connection_id=build.pk, status="online", last_heartbeat_at=now,
                                 daemon_version="0.1.0")
        ss.connection_set_status(connection_id=build.pk, status="offline")
        ci, _ = ss.connection_register(name="ci-runner", host="ci-7.internal", backend="codex", cwds=["/work"])
        ss.connection_set_status(connection_id=ci.pk, status="online", last_heartbeat_at=now, daemon_version="0.1.0")
        kiro, _ = ss.connection_register(name="kiro-host", host="kiro.internal", backend="kiro", cwds=["/home/kiro"])
        ss.connection_set_status(connection_id=kiro.pk, status="draining", last_heartbeat_at=now)
        # An example stall threshold per backend (sessions_app/stalls.py): Claude Code's long tool calls
        # get 20 minutes instead of the site's 10.
        BackendSetting.objects.get_or_create(backend="claude_code", defaults={"stall_threshold_s": 1200})

        def session(conn, cwd, key, title, backend_id=None):
            s = ss.session_create(connection=conn, cwd=cwd, idea_key=key, title=title, backend_session_id=backend_id,
                                  provider="scripted" if conn.backend == "scripted" else "anthropic",
                                  model="scripted-1" if conn.backend == "scripted" else "claude-sonnet")
            return s

        def turn(s, path, prompt, trigger="human_instruction", **final):
            t = ss.turn_create(session=s, trigger=trigger, prompt=prompt)
            for status in path[:-1]:
                ss.turn_set_status(turn_id=t.pk, status=status)
            last = path[-1] if path else None
            if last:
                t = ss.turn_set_status(turn_id=t.pk, status=last, **final)
            if final.get("final_reply"):
                ss.transcript_append(session_id=s.pk, role="user", text=prompt, turn_id=t.pk)
                ss.transcript_append(session_id=s.pk, role="assistant", text=final["final_reply"], turn_id=t.pk)
            return t

        s1 = session(alice, demo_dir, "idea:readme-refresh", "Refresh the README", "scripted-7f3a9c")
        turn(s1, ["running", "ended"], "Update the install section.", final_reply="Updated README.md install steps.",
             changes={"git_status": [" M README.md"], "diff_stat": "1 file changed, 12 insertions(+), 4 deletions(-)"},
             usage={"input": 1200, "output": 340})
        ss.session_add_usage(session_id=s1.pk, usage={"input": 1200, "output": 340})
        stopped = turn(s1, ["running"], "@sleep 600\nLong refactor")
        command = ss.command_create(connection_id=alice.pk, action="interrupt", turn_id=stopped.pk)
        ss.turn_set_stop_state(turn_id=stopped.pk, stop_state="requested")
        for state in ("delivered", "acked", "done"):
            ss.command_set_state(command_id=command.pk, state=state)
        ss.turn_set_stop_state(turn_id=stopped.pk, stop_state="signalled")
        ss.turn_set_status(turn_id=stopped.pk, status="interrupted", reason="user", stop_state="confirmed")
        turn(s1, ["running"], "@sleep 30\nNow add a changelog entry.", trigger="resume")

        s2 = session(build, "/srv/build/api", "idea:flaky-test", "Fix the flaky payments test", "5b1e-claude-session")
        turn(s2, ["running", "interrupted"], "Run the payments suite and fix the flake.", reason="crash",
             wake_error={"kind": "exited_nonzero", "source": "claude_code", "exit_code": 1,
                         "summary": "claude exited with code 1 while running the tests",
                         "details": f"Traceback (most recent call last):\n  File \"run.py\", line 3\n"
                                    f"ANTHROPIC_API_KEY={CANARY}\nError: authentication failed"})
        turn(s2, ["running", "interrupted"], "Retry after reconnect.", reason="offline")

        s3 = session(ci, "/work/svc", "idea:dep-bump", "Bump dependencies", "codex-thread-42")
        turn(s3, ["running", "requires_action"], "@require-approval Upgrade django to 5.2?",
             requires_action={"kind": "confirmation", "items": [{"id": "1", "text": "Upgrade django to 5.2?"}]})

        s4 = session(alice, "/srv/repos/web", "idea:invalid-path", "Docs site build")
        turn(s4, ["interrupted"], "Build the docs", reason="invalid_path",
             wake_error={"kind": "invalid_path", "source": "daemon", "summary": "cwd /srv/repos/web does not exist"})
        turn(s4, ["running", "interrupted"], "Build again with the dsh limit", reason="timeout",
             wake_error={"kind": "timeout", "source": "scripted", "summary": "turn exceeded its 30 min limit"})
        turn(s4, ["running", "interrupted"], "Stop for maintenance", reason="shutdown")

        s5 = session(kiro, "/home/kiro/app", "idea:queue", "Queue demo")
        turn(s5, ["running", "ended"], "First task", final_reply="Done.")
        busy = turn(s5, ["running"], "@sleep 120\nSecond task")
        first_pending = ss.turn_create(session=s5, trigger="human_instruction", prompt="Third task")
        merged = ss.turn_create(session=s5, trigger="human_instruction", prompt="Fourth task (merged)")
        ss.turn_set_status(turn_id=merged.pk, status="merged", merged_into=first_pending)
        del busy

        self._executions(alice, s1)

    def _executions(self, conn, session):
        issue = ex.issue_create(title="Add rate limiting to the public API", body="Limit to 100 req/min per token.",
                                acceptance_criteria="429 after 100 requests in a minute; documented.")
        ex.comment_add(issue_id=issue.pk, body="Please cover the admin API too.", author="operator")
        # Something to run for real on the local daemon (make run): a declared workflow of scripted agents.
        workflow_create(name="scripted-demo", description="Plan, write and check a file with the scripted agent.",
                        spec={"nodes": [
                            {"key": "plan", "type": "agent",
                             "prompt": "@sleep 3\n@reply Plan: write demo.txt.\n@outcome succeeded"},
                            {"key": "write", "type": "agent", "depends_on": ["plan"],
                             "prompt": "@write demo.txt Written for: {{ issue.title }}\n@sleep 3\n"
                                       "@reply Wrote demo.txt.\n@outcome succeeded"},
                            {"key": "check", "type": "agent", "depends_on": ["write"], "retry": {"max_task_retries": 1},
                             "prompt": "@sleep 2\n@reply demo.txt looks right.\n@outcome succeeded"},
                        ]})
        ex.issue_create(title="Try a declared run", body="Start a run of this issue from its page: mode declared, "
                        "workflow scripted-demo r1, then watch the task map.",
                        acceptance_criteria="demo.txt exists in the demo workspace")
        issue2 = ex.issue_create(title="Nightly dependency audit", completion_policy="automatic")
        wf = WorkflowDefinition.objects.create(name="build-test-review", description="Build, test, then review.")
        rev = WorkflowRevision.objects.create(workflow=wf, number=1, spec={"nodes": [
            {"key": "build", "type": "agent", "prompt": "Build {{ issue.title }}", "depends_on": []},
            {"key": "test", "type": "agent", "prompt": "Test it", "depends_on": ["build"],
             "retry": {"max_task_retries": 1}},
            {"key": "review", "type": "approval", "depends_on": ["test"]},
        ]})

        def run(states_path, mode="direct", issue_obj=issue, **kw):
            r = Run.objects.create(issue=issue_obj, mode=mode, workflow_revision=rev if mode == "declared" else None,
                                   input={"prompt": "Implement it"}, target={"connection": str(conn.pk)}, **kw)
            for state in states_path:
                extra = {}
                if state == "waiting":
                    extra = offline_wait
                if state == "failed":
                    extra = {"failure_code": "agent_failed", "failure_message": "the test node failed twice"}
                ex.run_set_state(run_id=r.pk, state=state, **extra)
            return r

        # What the engine itself would hold: a waiting node, task and run name the same reason, so
        # the periodic tick of waiting runs (runs_tick_waiting) recomputes the same reason.
        offline_wait = {"wait_reason": "host_offline",
                        "wait_detail": {"connection": str(conn.pk), "unblock": "restore the daemon"}}

        def node(r, key, path, type="agent"):
            n = RunNode.objects.create(run=r, key=key, type=type)
            for state in path:
                wait = offline_wait if type == "agent" else {
                    "wait_reason": "approval", "wait_detail": {"unblock": "decide the approval (inbox or API)"}}
                ex.node_set_state(node_id=n.pk, state=state, **(wait if state == "waiting" else {}))
            return n

        def task(n, path, ordinal=1, retry_of=None):
            t = AgentTask.objects.create(node=n, ordinal=ordinal, retry_of=retry_of)
            for status in path:
                ex.task_set_status(task_id=t.pk, status=status,
                                   **({"wait_reason": "host_offline"} if status == "waiting" else {}))
            return t

        def attempt(t, number, path, **kw):
            a = Attempt.objects.create(task=t, number=number, connection=conn, session=session, backend="scripted",
                                       cwd=session.cwd, **kw)
            for state in path:
                ex.attempt_set_state(attempt_id=a.pk, state=state)
            AgentTask.objects.filter(pk=t.pk).update(current_attempt=a)
            return a

        ok_path = ["assigned", "preparing", "running", "succeeded"]
        # succeeded, with an infrastructure retry (attempt 1 lost its connection)
        r = run(["running", "succeeded"])
        n = node(r, "main", ["ready", "running", "succeeded"])
        t = task(n, ["dispatched", "running", "completed"])
        attempt(t, 1, ["assigned", "preparing", "running", "failed"], failure_code="connection_lost",
                failure_message="daemon heartbeat lost")
        attempt(t, 2, ok_path, outcome={"intent": "succeeded", "summary": "rate limiter added"})
        ex.artifact_add(issue_id=issue.pk, run_id=r.pk, kind="diff", name="rate-limit.diff",
                        content="+ RATE_LIMIT = 100\n")

        # failed, with a policy retry (task 2 retry_of task 1), then a rerun that is running
        failed = run(["running", "failed"], mode="declared")
        node(failed, "build", ["ready", "running", "succeeded"])
        tn = node(failed, "test", ["ready", "running", "failed"])
        t1 = task(tn, ["dispatched", "running", "failed"])
        attempt(t1, 1, ["assigned", "preparing", "running", "failed"], failure_code="agent_failed",
                failure_message="outcome failed: 3 tests still red", outcome={"intent": "failed"})
        t2 = task(tn, ["dispatched", "running", "failed"], ordinal=2, retry_of=t1)
        attempt(t2, 1, ["assigned", "preparing", "running", "failed"], failure_code="agent_failed",
                failure_message="outcome failed: 1 test still red", outcome={"intent": "failed"})
        node(failed, "review", ["skipped"], type="approval")
        rerun = run(["running"], mode="declared", rerun_of=failed, trigger="rerun")
        rn = node(rerun, "build", ["ready", "running"])
        attempt(task(rn, ["dispatched", "running"]), 1, ["assigned", "preparing", "running"])

        partial = run(["running", "partial_succeeded"], issue_obj=issue2)
        node(partial, "scan", ["ready", "running", "succeeded"])
        node(partial, "report", ["ready", "running", "failed"])
        run([])  # planned
        waiting = run(["running", "waiting"])
        wn = node(waiting, "main", ["ready", "waiting"])
        attempt(task(wn, ["dispatched", "waiting"]), 1, ["assigned", "preparing", "running", "waiting"])
        review = node(rerun, "review", ["ready", "waiting"], type="approval")
        Approval.objects.create(node=review, prompt="Ship the rate limiter?")
        run(["running", "paused"])
        cancelling = run(["running", "cancelling"])
        cn = node(cancelling, "main", ["ready", "running"])
        attempt(task(cn, ["dispatched", "running"]), 1, ["assigned", "preparing", "running", "cancel_requested"])
        run(["running", "cancelling", "cancelled"])
        # Issues with runs under way are in progress, as starting a run makes them (engine.run_start).
        for worked_on in (issue, issue2):
            for status in ("todo", "in_progress"):
                ex.issue_set_status(issue_id=worked_on.pk, status=status)

"""The scripted agent's stall directives (issue 12): ``@silent`` prints nothing while it waits;
``@wait-child`` waits, printing nothing, on a child whose command line carries the extra words."""

from __future__ import annotations

import psutil

from tests.agents.test_scripted_agent import home, run, wait_until, workdir  # noqa: F401 — fixtures


def test_silent_prints_nothing_then_goes_on(run):  # noqa: F811
    agent = run("@silent 0.5\n@reply after the silence")
    assert agent.wait() == 0
    kinds = [o["type"] for o in agent.objects()]
    assert kinds == ["session", "progress", "text", "final", "usage"]  # nothing while silent
    assert agent.objects()[-2]["text"] == "after the silence"


def test_wait_child_waits_silently_on_a_child_with_its_command_line(run):  # noqa: F811
    agent = run("@wait-child 30 --tool=bash\n@reply done")
    child = wait_until(lambda: next((p for p in psutil.Process(agent.pid).children()
                                     if "--tool=bash" in " ".join(p.cmdline())), None), message="the child")
    assert "time.sleep(30" in " ".join(child.cmdline())
    assert [o["type"] for o in agent.objects()] == ["session", "progress"]  # silent while it waits
    child.kill()  # the tool returns: the agent goes on
    assert agent.wait() == 0
    assert agent.objects()[-2]["text"] == "done"

"""What an agent is told (SPEC §6.1, §6.4): node prompts and the context a fresh session starts from."""

from __future__ import annotations

import re

from .models import Run, RunNode

_TEMPLATE = re.compile(r"\{\{\s*(input|issue)\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def node_prompt(run: Run, node: RunNode) -> str:
    """The issue's title, body and acceptance criteria, then the node's prompt (§6.1)."""
    issue = run.issue
    values = {"input": run.input, "issue": {"title": issue.title, "body": issue.body,
                                            "acceptance_criteria": issue.acceptance_criteria, "id": str(issue.pk)}}
    template = node.config.get("prompt") or run.input.get("prompt", "")
    body = _TEMPLATE.sub(lambda m: str(values[m.group(1)].get(m.group(2), "")), template)
    parts = [f"Issue: {issue.title}", issue.body, f"Acceptance criteria: {issue.acceptance_criteria}"
             if issue.acceptance_criteria else "", body]
    return "\n\n".join(p for p in parts if p)


def fresh_context(run: Run) -> str:
    """A fresh session's first prompt is rebuilt from the issue, its comments and its artifacts —
    never from process memory (§6.4)."""
    issue = run.issue
    lines = ["You continue work another agent could not finish (its machine is unavailable). Start from what "
             "is recorded below, not from memory."]
    comments = list(issue.comments.order_by("id")[:30])
    if comments:
        lines.append("Comments on the issue:")
        lines += [f"- [{c.type}] {c.author}: {c.body[:500]}" for c in comments]
    artifacts = list(issue.artifacts.order_by("id")[:30])
    if artifacts:
        lines.append("Artifacts: " + ", ".join(f"{a.name} ({a.kind}, sha256 {a.sha256[:12]})" for a in artifacts))
    return "\n".join(lines)




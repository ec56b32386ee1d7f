"""Workflow definitions and their immutable revisions, validated with clear 400s (SPEC §3.2)."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Max

from chorus_site.audit import actor_name
from chorus_site.errors import ApplicationError
from chorus_site.events import event_append

from . import states
from .models import WorkflowDefinition, WorkflowRevision

MAX_NODES = 200


def _bad(message: str, **detail):
    raise ApplicationError("bad_request", message, detail)


def workflow_validate(spec) -> dict:
    """A normalised copy of ``spec`` or 400 naming the first problem."""
    if not isinstance(spec, dict) or not isinstance(spec.get("nodes"), list) or not spec["nodes"]:
        _bad("a workflow is {\"nodes\": [...]} with at least one node")
    if len(spec["nodes"]) > MAX_NODES:
        _bad(f"at most {MAX_NODES} nodes")
    nodes, keys = [], set()
    for index, raw in enumerate(spec["nodes"]):
        if not isinstance(raw, dict):
            _bad(f"node {index} is not an object", node=index)
        key = raw.get("key")
        if not isinstance(key, str) or not key.strip() or len(key) > 100:
            _bad(f"node {index} needs a key (1–100 characters)", node=index)
        if key in keys:
            _bad(f"duplicate node key {key!r}", node=key)
        keys.add(key)
        kind = raw.get("type", "agent")
        if kind not in states.NODE_TYPES:
            _bad(f"node {key!r} has unknown type {kind!r}", node=key, allowed=states.NODE_TYPES)
        depends_on = raw.get("depends_on", [])
        if not isinstance(depends_on, list) or not all(isinstance(d, str) for d in depends_on):
            _bad(f"node {key!r}: depends_on must be a list of node keys", node=key)
        retry = raw.get("retry", {}) or {}
        retries = retry.get("max_task_retries", 0) if isinstance(retry, dict) else None
        if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= 10:
            _bad(f"node {key!r}: retry.max_task_retries must be an integer from 0 to 10", node=key)
        if kind == "agent" and not isinstance(raw.get("prompt", ""), str):
            _bad(f"node {key!r}: prompt must be text", node=key)
        if kind == "subrun" and not raw.get("revision"):
            _bad(f"subrun node {key!r} must name a workflow revision", node=key)
        nodes.append({**raw, "key": key, "type": kind, "depends_on": depends_on,
                      "retry": {"max_task_retries": retries},
                      "continue_on_failure": bool(raw.get("continue_on_failure", False))})
    for node in nodes:
        missing = [d for d in node["depends_on"] if d not in keys]
        if missing:
            _bad(f"node {node['key']!r} depends on unknown nodes {missing}", node=node["key"], missing=missing)
    _check_acyclic(nodes)
    return {**spec, "nodes": nodes}


def _check_acyclic(nodes: list[dict]) -> None:
    graph = {n["key"]: n["depends_on"] for n in nodes}
    done, visiting = set(), []

    def visit(key):
        if key in done:
            return
        if key in visiting:
            cycle = visiting[visiting.index(key):] + [key]
            _bad(f"dependency cycle: {' → '.join(cycle)}", cycle=cycle)
        visiting.append(key)
        for dep in graph[key]:
            visit(dep)
        visiting.pop()
        done.add(key)

    for key in graph:
        visit(key)


def workflow_create(*, name: str, spec: dict, description: str = "", actor=None) -> WorkflowRevision:
    spec = workflow_validate(spec)
    with transaction.atomic():
        if WorkflowDefinition.objects.filter(name=name).exists():
            raise ApplicationError("conflict", f"a workflow named {name!r} exists; add a revision to it instead")
        workflow = WorkflowDefinition.objects.create(name=name, description=description)
        return _revision(workflow, spec, actor)


def workflow_revise(*, workflow_id, spec: dict, actor=None) -> WorkflowRevision:
    spec = workflow_validate(spec)
    with transaction.atomic():
        workflow = WorkflowDefinition.objects.select_for_update(no_key=True).filter(pk=workflow_id).first()
        if workflow is None:
            raise ApplicationError("not_found", "not found")
        return _revision(workflow, spec, actor)


def _revision(workflow, spec, actor) -> WorkflowRevision:
    number = (workflow.revisions.aggregate(m=Max("number"))["m"] or 0) + 1
    revision = WorkflowRevision.objects.create(workflow=workflow, number=number, spec=spec)
    event_append(stream=f"workflow:{workflow.pk}", kind="workflow.revision", actor=actor_name(actor),
                 data={"id": str(revision.pk), "number": number})
    return revision

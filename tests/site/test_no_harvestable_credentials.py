"""A viewer can obtain no credential from any admin page or API route (issue 8, items 1 and 5).

The attempt's task token goes to the daemon on the wire only (never into ControlCommand.payload),
a one-time connection key is never kept in an idempotency record (a replay says it was withheld),
and the admin shows command payloads and idempotency answers redacted.
"""

from __future__ import annotations

import json
import re

import pytest
from django.contrib import admin
from django.test import Client
from django.urls import NoReverseMatch, reverse

from chorus_site.api import api
from chorus_site.models import IdempotencyRecord
from chorus_site.tokens import token_create
from executions.task_tokens import attempt_for_task_token, task_token_for
from sessions_app import actions, bridge
from sessions_app.models import Connection, ControlCommand
from tests import factories

pytestmark = pytest.mark.django_db

TASK_TOKEN = re.compile(r"cht_[A-Za-z0-9_:\-.]{8,}")
CONNECTION_KEY = re.compile(r"chk_[A-Za-z0-9]+_[A-Za-z0-9_\-]{8,}")


def _usable(candidate: str) -> bool:
    if candidate.startswith("cht_"):
        return attempt_for_task_token(candidate) is not None
    return bridge.connection_authenticate(candidate) is not None


def _world(ops_admin_user):
    """An attempt dispatched to a daemon, plus a connection registered with an Idempotency-Key."""
    connection = factories.make_connection(status="online")
    session = factories.make_session(connection=connection)
    _run, _node, _task, attempt = factories.make_run_graph(connection=connection)
    answer = actions.turn_enqueue(session_id=session.pk, trigger="task_assigned", prompt="work on it",
                                  attempt_id=attempt.pk)
    command = ControlCommand.objects.get(turn_id=answer["turn"])
    _token, raw = token_create(user=ops_admin_user, name="admin")
    registered = Client().post("/api/v1/connections", data=json.dumps({"name": "harvest", "backend": "scripted",
                                                                        "cwds": ["/srv/work"]}),
                               content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}",
                               HTTP_IDEMPOTENCY_KEY="register-harvest")
    assert registered.status_code == 201, registered.content
    return {"connection": connection, "session": session, "attempt": attempt, "command": command,
            "turn": answer["turn"], "key": registered.json()["key"], "key_connection": registered.json()["id"],
            "admin_token": raw}


def test_the_task_token_is_delivered_on_the_wire_but_never_stored(ops_admin_user):
    world = _world(ops_admin_user)
    stored = json.dumps(ControlCommand.objects.get(pk=world["command"].pk).payload)
    assert "cht_" not in stored and "CHORUS_TASK_TOKEN" not in stored
    delivered = [c for c in bridge.commands_to_deliver(connection_id=world["connection"].pk)
                 if c["id"] == str(world["command"].pk)]
    env = delivered[0]["payload"]["env"]
    assert attempt_for_task_token(env["CHORUS_TASK_TOKEN"]).pk == world["attempt"].pk
    assert env["CHORUS_ATTEMPT_ID"] == str(world["attempt"].pk)
    # Delivering does not write it either.
    assert "cht_" not in json.dumps(list(ControlCommand.objects.values_list("payload", "result")))


def test_an_idempotent_replay_of_a_registration_does_not_carry_the_key(ops_admin_user):
    world = _world(ops_admin_user)
    assert bridge.connection_authenticate(world["key"]) is not None
    assert world["key"] not in json.dumps(list(IdempotencyRecord.objects.values_list("response_body", flat=True)))
    replay = Client().post("/api/v1/connections", data=json.dumps({"name": "harvest", "backend": "scripted",
                                                                   "cwds": ["/srv/work"]}),
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {world['admin_token']}",
                           HTTP_IDEMPOTENCY_KEY="register-harvest")
    assert replay.status_code == 201
    body = replay.json()
    assert body["id"] == world["key_connection"] and body["key"] is None and body["withheld"] == ["key"]
    assert "rotate" in body["message"]
    assert Connection.objects.filter(name="harvest").count() == 1


def _admin_pages(client) -> list[str]:
    """Every changelist the user may open, and the detail page of up to three of its rows."""
    urls = ["/admin/"]
    for model in admin.site._registry:
        meta = model._meta
        try:
            changelist = reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist")
        except NoReverseMatch:
            continue
        if client.get(changelist).status_code != 200:
            continue
        urls.append(changelist)
        for pk in model.objects.order_by("-pk").values_list("pk", flat=True)[:3]:
            urls.append(reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[pk]))
    return urls


def _api_get_routes(world) -> list[str]:
    ids = {"connection_id": world["connection"].pk, "session_id": world["session"].pk, "turn_id": world["turn"],
           "run_id": world["attempt"].task.node.run_id, "issue_id": world["attempt"].task.node.run.issue_id,
           "task_id": world["attempt"].task_id, "attempt_id": world["attempt"].pk}
    urls = []
    for path, operations in api.get_openapi_schema()["paths"].items():
        if "get" not in operations or path.endswith("/events/stream"):
            continue  # the SSE streams are covered by tests/streams
        names = re.findall(r"{(\w+)}", path)
        if all(name in ids for name in names):
            urls.append(path.format(**{name: ids[name] for name in names}))
    return urls


@pytest.mark.parametrize("persona", ["viewer", "operator", "diagnostics_reader"])
def test_no_page_or_route_yields_a_usable_credential(persona, personas, ops_admin_user):
    world = _world(ops_admin_user)
    # A command row written before this fix still holds a token: the admin shows it redacted.
    legacy = ControlCommand.objects.create(
        connection=world["connection"], action="start_turn", turn_id=world["turn"],
        payload={"env": {"CHORUS_TASK_TOKEN": task_token_for(world["attempt"])}})
    user = personas[persona]
    client = Client()
    client.force_login(user)
    pages = _admin_pages(client)
    assert reverse("admin:sessions_app_controlcommand_change", args=[legacy.pk]) in pages
    _token, raw = token_create(user=user, name="crawler")
    routes = _api_get_routes(world)
    assert len(routes) > 15
    seen = []
    for url in pages:
        response = client.get(url)
        assert response.status_code == 200, url
        seen.append((url, response.content.decode()))
    for url in routes:
        response = Client().get(url, HTTP_AUTHORIZATION=f"Bearer {raw}")
        assert response.status_code < 500, url
        seen.append((url, response.content.decode()))
    for url, text in seen:
        assert world["key"] not in text, url
        for candidate in TASK_TOKEN.findall(text) + CONNECTION_KEY.findall(text):
            assert not _usable(candidate), f"{persona} harvested a credential from {url}"


def test_the_admin_shows_command_payloads_and_idempotency_answers_redacted(ops_admin_user):
    world = _world(ops_admin_user)
    token = task_token_for(world["attempt"])
    legacy = ControlCommand.objects.create(connection=world["connection"], action="start_turn",
                                           payload={"env": {"CHORUS_TASK_TOKEN": token}, "cwd": "/srv/work"})
    record = IdempotencyRecord.objects.create(scope="user:0", route="connections.register", key="old",
                                              request_hash="x", state="done", response_status=201,
                                              response_body={"id": "1", "key": world["key"]})
    client = Client()
    client.force_login(ops_admin_user)
    page = client.get(reverse("admin:sessions_app_controlcommand_change", args=[legacy.pk])).content.decode()
    assert token not in page and "/srv/work" in page and "[REDACTED]" in page
    page = client.get(reverse("admin:chorus_site_idempotencyrecord_change", args=[record.pk])).content.decode()
    assert world["key"] not in page and "[REDACTED]" in page

"""Secrets stored by older versions are scrubbed by migrate (issue 8 items 1 and 5; chorus_site/scrub.py).

Rows written before the task token went on the wire only (``ControlCommand.payload.env``) and
before replays withheld one-time keys (an idempotency record of a connection registration) still
hold them in clear; ``migrate`` removes them and leaves everything else as it was.
"""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command

from chorus_site.models import IdempotencyRecord
from chorus_site.scrub import stored_secrets_scrub
from executions.task_tokens import attempt_for_task_token, task_token_for
from sessions_app import actions, bridge
from sessions_app.models import ControlCommand
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def legacy_rows():
    connection = factories.make_connection(status="online")
    other = factories.make_connection()
    session = factories.make_session(connection=connection)
    _run, _node, _task, attempt = factories.make_run_graph(connection=connection)
    answer = actions.turn_enqueue(session_id=session.pk, trigger="task_assigned", prompt="rotate the API key",
                                  attempt_id=attempt.pk)
    command = ControlCommand.objects.get(turn_id=answer["turn"])
    token = task_token_for(attempt)
    # As an older version stored it: the token in the payload's environment.
    ControlCommand.objects.filter(pk=command.pk).update(
        payload={**command.payload, "env": {**command.payload.get("env", {}), "CHORUS_TASK_TOKEN": token}})
    plain = ControlCommand.objects.create(connection=connection, action="probe", payload={"note": "token rotation"})
    registered = IdempotencyRecord.objects.create(
        scope="user:1", route="connections.register", key="old-registration", request_hash="x", state="done",
        response_status=201, response_body={"id": str(other.pk), "name": other.name, "key": other.plain_key})
    unrelated = IdempotencyRecord.objects.create(
        scope="user:1", route="issues.create", key="old-issue", request_hash="y", state="done", response_status=201,
        response_body={"id": "1", "title": "Rotate the key and the token"})
    return {"command": command, "token": token, "attempt": attempt, "plain": plain, "registered": registered,
            "unrelated": unrelated, "other": other, "connection": connection}


def test_migrate_scrubs_stored_task_tokens_and_one_time_keys(legacy_rows):
    rows = legacy_rows
    before = ControlCommand.objects.get(pk=rows["command"].pk).payload
    assert before["env"]["CHORUS_TASK_TOKEN"] == rows["token"]
    plain_before = ControlCommand.objects.get(pk=rows["plain"].pk).payload

    call_command("migrate", verbosity=0)

    payload = ControlCommand.objects.get(pk=rows["command"].pk).payload
    assert "cht_" not in json.dumps(payload) and "CHORUS_TASK_TOKEN" not in payload.get("env", {})
    # Everything else of the command is as it was; the daemon still gets the token, on the wire.
    assert {k: v for k, v in payload.items() if k != "env"} == {k: v for k, v in before.items() if k != "env"}
    assert payload["prompt"] == "rotate the API key"
    delivered = [c for c in bridge.commands_to_deliver(connection_id=rows["connection"].pk)
                 if c["id"] == str(rows["command"].pk)]
    assert attempt_for_task_token(delivered[0]["payload"]["env"]["CHORUS_TASK_TOKEN"]).pk == rows["attempt"].pk
    assert ControlCommand.objects.get(pk=rows["plain"].pk).payload == plain_before

    body = IdempotencyRecord.objects.get(pk=rows["registered"].pk).response_body
    assert rows["other"].plain_key not in json.dumps(body)
    assert body["key"] is None and body["withheld"] == ["key"] and "rotate" in body["message"]
    assert body["id"] == str(rows["other"].pk) and body["name"] == rows["other"].name
    assert IdempotencyRecord.objects.get(pk=rows["unrelated"].pk).response_body == rows["unrelated"].response_body
    assert bridge.connection_authenticate(rows["other"].plain_key) is not None  # scrubbing revokes nothing


def test_a_second_scrub_finds_nothing(legacy_rows):
    assert stored_secrets_scrub() == {"commands": 1, "idempotency_records": 1}
    assert stored_secrets_scrub() == {"commands": 0, "idempotency_records": 0}


def test_the_command_scrubs_too(legacy_rows, capsys):
    call_command("chorus_scrub_secrets")
    assert "scrubbed 1 command(s), 1 idempotency record(s)" in capsys.readouterr().out
    assert "cht_" not in json.dumps(list(ControlCommand.objects.values_list("payload", flat=True)))

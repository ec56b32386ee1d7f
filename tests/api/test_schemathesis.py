"""R5: schemathesis against the OpenAPI finds no server error (issue 8).

The schema is the API's own (/api/v1/openapi.json, the same document ``api.get_openapi_schema``
gives); every operation is called in-process through Django's WSGI application with bodies,
query strings and headers that hypothesis generates from it, as a viewer and as an operator (and
with the task token / connection key where an operation declares them), a bounded number of
examples each.  Path ids are those of real objects, so generated bodies reach the actions and the
database instead of stopping at a 404.  Checks: no 5xx, and every answer's status is one the
operation declares (the common §8 errors are declared on every operation).
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from django.utils import timezone
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import status_code_conformance

from chorus_site.api import api
from chorus_site.tokens import token_create
from executions import services as execution_services
from executions.task_tokens import task_token_for
from sessions_app.models import Connection
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)  # the WSGI app closes the connection after each request

EXAMPLES = 4  # per operation, credential and mode (positive, negative): the module stays around a minute on this machine
# SSE streams answer until the client goes away; tests/api/test_sse.py covers them.
SKIPPED = ("/events/stream",)


@pytest.fixture
def world(viewer, operator):
    connection = factories.make_connection(cwds=["/srv/work"], status="online")
    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now())
    session = factories.make_session(connection=connection, cwd="/srv/work/app")
    turn = factories.make_turn(session=session, status="running")
    run, node, task, attempt = factories.make_run_graph(connection=connection)
    approval = factories.make_approval(node=node)
    artifact = execution_services.artifact_add(issue_id=run.issue_id, run_id=run.pk, kind="report", name="r.txt",
                                               content="report")
    from executions import workflows
    revision = workflows.workflow_create(name=factories.unique("wf"), spec={"nodes": [
        {"key": "main", "type": "agent", "prompt": "do it"}]}, actor=operator)
    ids = {"connection_id": connection.pk, "session_id": session.pk, "turn_id": turn.pk, "issue_id": run.issue_id,
           "run_id": run.pk, "task_id": task.pk, "attempt_id": attempt.pk, "approval_id": approval.pk,
           "workflow_id": revision.workflow_id, "artifact_id": artifact.pk}
    return {
        "ids": {name: str(value) for name, value in ids.items()},
        "credentials": {"viewer": token_create(user=viewer)[1], "operator": token_create(user=operator)[1]},
        "TaskTokenAuth": task_token_for(attempt),
        "ConnectionKeyAuth": connection.plain_key,
    }


def _credentials(operation, world) -> dict[str, str]:
    schemes = {name for requirement in operation.definition.raw.get("security", ()) for name in requirement}
    credentials = dict(world["credentials"])
    for scheme in ("TaskTokenAuth", "ConnectionKeyAuth"):
        if scheme in schemes:
            credentials[scheme] = world[scheme]
    return credentials


def test_schemathesis_finds_no_server_error(world):
    schema = schemathesis.openapi.from_dict(api.get_openapi_schema())
    app = get_wsgi_application()
    failures: list[str] = []
    calls = 0
    statuses: dict[int, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if any(part in operation.path for part in SKIPPED):
            continue
        fixed_ids = {p["name"]: world["ids"][p["name"]] for p in operation.definition.raw.get("parameters", ())
                     if p["in"] == "path" and p["name"] in world["ids"]}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(mode, path_parameters=fixed_ids or None)
            for who, credential in _credentials(operation, world).items():

                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=strategy)
                def run(case):
                    nonlocal calls
                    response = case.call(app=app, headers={"Authorization": f"Bearer {credential}"})
                    calls += 1
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    case.validate_response(response, checks=[not_a_server_error, status_code_conformance])

                try:
                    run()
                except BaseException as exc:  # schemathesis' FailureGroup too: every operation is tried, all reported
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    failures.append(f"{operation.method.upper()} {operation.path} {mode} as {who}: {str(exc)[:600]}")
    print(f"schemathesis: {calls} calls, answers {dict(sorted(statuses.items()))}")
    assert calls > 0
    assert failures == [], "\n\n".join(failures)

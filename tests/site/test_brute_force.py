"""Brute-force protection (issue 8 item 8): admin login lockout, API and daemon-key throttling.

The admin login locks a username out from one address after AXES_FAILURE_LIMIT failures (also
for the right password); failed credential checks on the API (tokens, task tokens, connection
keys) are counted per address and then answered 429 with Retry-After and the §8 error body;
every authenticated caller is also limited to CHORUS_API_RATE requests.
"""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.test import Client, override_settings

from chorus_site.tokens import token_create
from tests import factories
from tests.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def _login(username, password, ip="10.0.0.1"):
    client = Client(REMOTE_ADDR=ip)
    response = client.post("/admin/login/?next=/admin/", {"username": username, "password": password})
    return client, response


def _logged_in(client) -> bool:
    return client.get("/admin/").status_code == 200


def test_admin_login_locks_out_after_the_failure_limit_per_username_and_address(viewer):
    statuses = [_login(viewer.username, "wrong")[1].status_code for _ in range(settings.AXES_FAILURE_LIMIT)]
    assert statuses == [200] * (settings.AXES_FAILURE_LIMIT - 1) + [429]  # the form again, then locked
    client, response = _login(viewer.username, PASSWORD)
    assert response.status_code == 429 and not _logged_in(client)
    # The lockout is per username and address: the same user elsewhere, and others here, still log in.
    client, _ = _login(viewer.username, PASSWORD, ip="10.0.0.2")
    assert _logged_in(client)
    other = factories.make_user(username="someone-else")
    client, _ = _login(other.username, PASSWORD)
    assert _logged_in(client)


def test_a_successful_login_resets_the_failure_count(viewer):
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        _login(viewer.username, "wrong")
    client, _ = _login(viewer.username, PASSWORD)
    assert _logged_in(client)
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        _login(viewer.username, "wrong")
    client, _ = _login(viewer.username, PASSWORD)
    assert _logged_in(client)


def _get(path, token, ip="10.0.0.1"):
    return Client(REMOTE_ADDR=ip).get(path, HTTP_AUTHORIZATION=f"Bearer {token}")


def _assert_throttled(response):
    assert response.status_code == 429
    assert int(response["Retry-After"]) >= 1
    body = response.json()
    assert body["error"]["code"] == "throttled" and body["error"]["message"] and "detail" in body["error"]


def test_wrong_bearer_secrets_are_throttled_per_address_even_for_the_right_token(viewer):
    token, raw = token_create(user=viewer, name="real")
    statuses = [_get("/api/v1/sessions", f"cho_{token.prefix}_wrong-secret-{n}").status_code for n in range(300)]
    assert statuses[0] == 401
    assert 429 in statuses
    first = statuses.index(429)
    assert set(statuses[:first]) == {401} and set(statuses[first:]) == {429}
    _assert_throttled(_get("/api/v1/sessions", raw))  # guessing cannot go on with a lucky hit
    assert _get("/api/v1/sessions", raw, ip="10.0.0.9").status_code == 200  # another address is not blocked


def test_a_forged_forwarded_for_header_does_not_dodge_the_counter(viewer):
    statuses = [Client(REMOTE_ADDR="10.0.0.7").get("/api/v1/sessions", HTTP_AUTHORIZATION="Bearer cho_abc_wrong",
                                                   HTTP_X_FORWARDED_FOR=f"192.0.2.{n}").status_code
                for n in range(30)]
    assert statuses[-1] == 429


def test_many_different_wrong_credentials_from_one_address_are_throttled(viewer):
    _token, raw = token_create(user=viewer, name="real")
    statuses = [_get("/api/v1/sessions", f"cho_guess{n}_secret{n}", ip="10.0.0.6").status_code for n in range(300)]
    assert statuses[0] == 401 and statuses[-1] == 429
    _assert_throttled(_get("/api/v1/sessions", raw, ip="10.0.0.6"))


def test_wrong_task_tokens_and_connection_keys_are_throttled_too():
    connection = factories.make_connection()
    for n in range(300):
        response = Client(REMOTE_ADDR="10.0.0.3").post(
            "/api/v1/daemon/snapshot", data=json.dumps({"running": []}), content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer chk_{connection.key_prefix}_wrong{n}")
        if response.status_code == 429:
            break
        assert response.status_code == 401
    _assert_throttled(response)
    for n in range(300):
        response = Client(REMOTE_ADDR="10.0.0.4").post(
            "/api/v1/attempts/00000000-0000-0000-0000-000000000000/outcome",
            data=json.dumps({"intent": "succeeded"}), content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer cht_forged{n}")
        if response.status_code == 429:
            break
        assert response.status_code == 401
    _assert_throttled(response)


@pytest.mark.django_db(transaction=True)  # the SSE view's database_sync_to_async closes the connection it used
def test_the_sse_route_counts_wrong_tokens():
    for n in range(300):
        response = _get("/api/v1/sessions/00000000-0000-0000-0000-000000000000/events/stream", f"cho_x_y{n}",
                        ip="10.0.0.5")
        if response.status_code == 429:
            break
        assert response.status_code == 401
    _assert_throttled(response)


def test_each_api_caller_is_rate_limited(viewer):
    _token, raw = token_create(user=viewer, name="busy")
    with override_settings(CHORUS_API_RATE="5/min"):
        statuses = [_get("/api/v1/sessions", raw).status_code for _ in range(6)]
        assert statuses == [200] * 5 + [429]
        _assert_throttled(_get("/api/v1/sessions", raw))

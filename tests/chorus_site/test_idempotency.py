"""Idempotency-Key handling (SPEC §8): replay, mismatch, refusals, concurrency, key rules, 24 h."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.db import connection as db_connection
from django.utils import timezone

from chorus_site.errors import ApplicationError
from chorus_site.events import event_append
from chorus_site.idempotency import idempotency_purge_expired, idempotent_call
from chorus_site.models import Event, IdempotencyRecord
from tests.factories import make_user

ROUTE = "POST /api/v1/runs/{id}/cancel"


class Action:
    """An action with a side effect in the database (one event per call) and a call counter."""

    def __init__(self, answer=(201, {"id": "r-1", "state": "cancelling"}), refuse: ApplicationError | None = None,
                 before=None):
        self.answer = answer
        self.refuse = refuse
        self.before = before
        self.calls = 0
        self.stream = f"run:{uuid.uuid4()}"
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            self.calls += 1
        if self.before is not None:
            self.before()
        event_append(stream=self.stream, kind="side.effect", broadcast=False)
        if self.refuse is not None:
            raise self.refuse
        return self.answer

    @property
    def effects(self) -> int:
        return Event.objects.filter(stream=self.stream).count()


def call(user, key, body, action, route=ROUTE):
    return idempotent_call(user=user, route=route, key=key, body=body, action=action)


@pytest.fixture
def user(db):
    return make_user()


# ---------------------------------------------------------------- replay and mismatch
@pytest.mark.django_db
def test_without_a_key_every_call_acts(user):
    action = Action()
    assert call(user, None, {"a": 1}, action) == (201, action.answer[1], False)
    assert call(user, None, {"a": 1}, action) == (201, action.answer[1], False)
    assert (action.calls, action.effects) == (2, 2)
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
def test_same_key_and_body_replays_without_acting(user):
    action = Action()
    first = call(user, "k-1", {"reason": "stop", "n": 1}, action)
    second = call(user, "k-1", {"n": 1, "reason": "stop"}, action)  # same body, other key order
    third = call(user, "k-1", {"reason": "stop", "n": 1}, action)
    assert first == (201, {"id": "r-1", "state": "cancelling"}, False)
    assert second == third == (201, {"id": "r-1", "state": "cancelling"}, True)
    assert (action.calls, action.effects) == (1, 1)
    record = IdempotencyRecord.objects.get()
    assert (record.key, record.route, record.user_id, record.state) == ("k-1", ROUTE, user.pk, "done")
    assert (record.response_status, record.response_body) == (201, {"id": "r-1", "state": "cancelling"})


@pytest.mark.django_db
def test_same_key_with_another_body_is_a_mismatch(user):
    action = Action()
    call(user, "k-2", {"reason": "stop"}, action)
    with pytest.raises(ApplicationError) as refused:
        call(user, "k-2", {"reason": "something else"}, action)
    assert (refused.value.code, refused.value.status) == ("idempotency_mismatch", 409)
    assert (action.calls, action.effects) == (1, 1)
    # The first answer is still replayed for the first body.
    assert call(user, "k-2", {"reason": "stop"}, action)[2] is True


@pytest.mark.django_db
def test_keys_are_scoped_by_user_and_route(user):
    other_user = make_user()
    action = Action()
    call(user, "shared", {"x": 1}, action)
    assert call(other_user, "shared", {"x": 1}, action)[2] is False
    assert call(user, "shared", {"x": 1}, action, route="POST /api/v1/runs/{id}/pause")[2] is False
    assert (action.calls, action.effects) == (3, 3)
    assert IdempotencyRecord.objects.count() == 3


# ---------------------------------------------------------------- refusals
@pytest.mark.django_db
def test_refusals_are_recorded_and_replayed(user):
    refusal = ApplicationError("invalid_transition", "run cannot go from succeeded to cancelling",
                               {"from": "succeeded", "to": "cancelling"})
    action = Action(refuse=refusal)
    first = call(user, "k-3", {}, action)
    assert first == (409, refusal.as_body(), False)
    # The refused action's own writes were rolled back; the answer was kept.
    assert action.effects == 0
    action.refuse = None  # even if acting would now succeed, the key answers as it first did
    assert call(user, "k-3", {}, action) == (409, refusal.as_body(), True)
    assert action.calls == 1
    assert action.effects == 0


@pytest.mark.django_db
def test_an_unexpected_error_records_nothing_so_a_retry_acts(user):
    def boom():
        raise RuntimeError("database went away")

    action = Action(before=boom)
    with pytest.raises(RuntimeError):
        call(user, "k-4", {"a": 1}, action)
    assert not IdempotencyRecord.objects.exists()
    assert action.effects == 0
    action.before = None
    assert call(user, "k-4", {"a": 1}, action) == (201, action.answer[1], False)
    assert (action.calls, action.effects) == (2, 1)


@pytest.mark.django_db
def test_the_actions_own_integrity_error_surfaces_as_itself(user):
    """Issue 7 item 3: only the record insert is guarded; a unique violation inside the action is the
    action's error (not 409 idempotency_in_progress), and nothing is recorded, so a retry acts."""
    from django.contrib.auth import get_user_model
    from django.db import IntegrityError

    def duplicate_username():
        get_user_model().objects.create(username=user.username)

    action = Action(before=duplicate_username)
    with pytest.raises(IntegrityError):
        call(user, "k-ie", {"a": 1}, action)
    assert not IdempotencyRecord.objects.exists()
    assert action.effects == 0
    action.before = None
    assert call(user, "k-ie", {"a": 1}, action) == (201, action.answer[1], False)


@pytest.mark.django_db
def test_refusals_are_decided_again_when_not_recorded(user):
    """Daemon reports: a refused report retried later is decided on the state then, not replayed."""
    refusal = ApplicationError("invalid_transition", "turn already ended")
    action = Action(refuse=refusal)

    def daemon_call():
        return idempotent_call(user=None, scope="connection:c1", route="daemon.advance", key="r-1", body={},
                               action=action, record_refusals=False)

    assert daemon_call() == (409, refusal.as_body(), False)
    assert not IdempotencyRecord.objects.exists()
    action.refuse = None
    assert daemon_call() == (201, action.answer[1], False)
    assert daemon_call() == (201, action.answer[1], True)
    assert (action.calls, action.effects) == (2, 1)


# ---------------------------------------------------------------- key rules
@pytest.mark.django_db
@pytest.mark.parametrize("key", ["", "x" * 256, "line\nbreak", "tab\there", "\x00"])
def test_invalid_keys_are_refused_without_acting(user, key):
    action = Action()
    with pytest.raises(ApplicationError) as refused:
        call(user, key, {}, action)
    assert (refused.value.code, refused.value.status) == ("bad_request", 400)
    assert action.calls == 0
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("key", ["k", "x" * 255, "0d9f6c2e-2d4c-4c7b-a1f0-8f9a0d6f6b1e", "key with spaces"])
def test_valid_keys(user, key):
    action = Action()
    assert call(user, key, {}, action)[2] is False
    assert call(user, key, {}, action)[2] is True
    assert action.calls == 1


# ---------------------------------------------------------------- 24 hours
@pytest.mark.django_db
def test_records_older_than_24_hours_are_treated_as_absent(user):
    action = Action()
    call(user, "k-5", {"a": 1}, action)
    IdempotencyRecord.objects.update(created_at=timezone.now() - timedelta(hours=24, minutes=1))
    # Another body would be a mismatch within 24 h; after, the key is free again.
    assert call(user, "k-5", {"a": 2}, action) == (201, action.answer[1], False)
    assert (action.calls, action.effects) == (2, 2)
    record = IdempotencyRecord.objects.get()
    assert record.created_at > timezone.now() - timedelta(minutes=1)


@pytest.mark.django_db
def test_records_younger_than_24_hours_still_replay(user):
    action = Action()
    call(user, "k-6", {"a": 1}, action)
    IdempotencyRecord.objects.update(created_at=timezone.now() - timedelta(hours=23, minutes=50))
    assert call(user, "k-6", {"a": 1}, action)[2] is True
    assert action.calls == 1


@pytest.mark.django_db
def test_purge_removes_only_expired_records(user):
    action = Action()
    call(user, "old", {}, action)
    call(user, "new", {}, action)
    IdempotencyRecord.objects.filter(key="old").update(created_at=timezone.now() - timedelta(hours=25))
    assert idempotency_purge_expired() == 1
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["new"]


@pytest.mark.django_db
def test_a_key_without_a_user_also_replays():
    action = Action()
    call(None, "k-anon", {"a": 1}, action)
    assert call(None, "k-anon", {"a": 1}, action)[2] is True
    assert action.calls == 1


# ---------------------------------------------------------------- concurrent duplicates (PostgreSQL)
def _lock_waiters() -> int:
    with db_connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("refuse", [False, True], ids=["success", "refusal"])
def test_concurrent_duplicates_act_once_and_get_the_same_answer(refuse):
    user = make_user()
    duplicates = 6
    observed = {"waiters": 0}

    def hold_until_duplicates_wait():
        # The first caller holds its uncommitted record until every duplicate blocks on it
        # (deadline 30 s: CI machines are busy), so the race is real rather than scheduling luck.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            observed["waiters"] = _lock_waiters()
            if observed["waiters"] >= duplicates - 1:
                return
            time.sleep(0.01)

    refusal = ApplicationError("invalid_transition", "refused") if refuse else None
    action = Action(refuse=refusal, before=hold_until_duplicates_wait)
    barrier = threading.Barrier(duplicates)
    results: list = [None] * duplicates

    def worker(index):
        try:
            barrier.wait(timeout=30)
            results[index] = call(user, "race-key", {"reason": "stop"}, action)
        except Exception as error:  # noqa: BLE001 - reported to the test
            results[index] = repr(error)
        finally:
            db_connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(duplicates)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()

    assert action.calls == 1, results
    # At least one duplicate must really have blocked on the first call (all of them, usually;
    # on a loaded machine a straggler may arrive after the holding window).
    assert observed["waiters"] >= 1, "no duplicate ever waited on the first call"
    assert all(isinstance(r, tuple) for r in results), results
    first_status, first_body, _ = results[0]
    assert all((status, body) == (first_status, first_body) for status, body, _ in results)
    assert first_status == (409 if refuse else 201)
    assert sorted(replayed for _, _, replayed in results) == [False] + [True] * (duplicates - 1)
    assert action.effects == (0 if refuse else 1)
    assert IdempotencyRecord.objects.count() == 1

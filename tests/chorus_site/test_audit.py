"""Audit entries (SPEC §3.3): one row per action, reason redacted."""

from __future__ import annotations

import pytest

from chorus_site.audit import actor_name, audit_entries_for, audit_record
from chorus_site.models import AuditEntry
from tests.factories import make_user

SECRET = "ghp_" + "Zq8xW2vK9mL4pR7tY1uE6sD3fG5hJ0kAb1c2"


@pytest.mark.django_db
def test_audit_record_stores_one_row_with_the_reason_redacted(operator):
    entry = audit_record(actor=operator, action="turn.interrupt", target="turn:123", outcome="dispatched",
                         client="api", reason=f"runaway agent, rotated token {SECRET}", idempotency_key="k-1")
    assert AuditEntry.objects.count() == 1
    stored = AuditEntry.objects.get(pk=entry.pk)
    assert (stored.actor, stored.action, stored.target, stored.outcome, stored.client, stored.idempotency_key) == (
        operator.username, "turn.interrupt", "turn:123", "dispatched", "api", "k-1")
    assert SECRET not in stored.reason
    assert stored.reason.startswith("runaway agent, rotated token ")
    assert stored.at is not None


@pytest.mark.django_db
def test_audit_record_defaults():
    entry = audit_record(actor=None, action="events.purge", target="events", outcome="x" * 500)
    stored = AuditEntry.objects.get(pk=entry.pk)
    assert (stored.actor, stored.client, stored.reason, stored.idempotency_key) == ("system", "system", "", "")
    assert stored.outcome == "x" * 200


@pytest.mark.django_db
def test_audit_record_accepts_a_plain_actor_name():
    entry = audit_record(actor="cli", action="token.create", target="apitoken:1", outcome="created")
    assert AuditEntry.objects.get(pk=entry.pk).actor == "cli"


@pytest.mark.django_db
def test_audit_entries_for_a_target_newest_first(viewer):
    first = audit_record(actor=viewer, action="diagnostics.view", target="turn:1", outcome="shown")
    audit_record(actor=viewer, action="diagnostics.view", target="turn:2", outcome="shown")
    last = audit_record(actor=viewer, action="diagnostics.view", target="turn:1", outcome="shown")
    assert [e.pk for e in audit_entries_for("turn:1")] == [last.pk, first.pk]


@pytest.mark.django_db
def test_actor_name():
    assert actor_name(None) == "system"
    assert actor_name(make_user(username="alice")) == "alice"

"""Audit entries: exactly one per operator action and per raw-diagnostics view (SPEC §3.3)."""

from __future__ import annotations

from .models import AuditEntry
from .redaction import redact


def actor_name(user) -> str:
    if user is None:
        return "system"
    return getattr(user, "get_username", lambda: str(user))() or "anonymous"


def audit_record(
    *, actor, action: str, target: str, outcome: str, client: str = "system", reason: str | None = None,
    idempotency_key: str | None = None,
) -> AuditEntry:
    return AuditEntry.objects.create(
        actor=actor if isinstance(actor, str) else actor_name(actor),
        action=action,
        target=target,
        outcome=outcome[:200],
        client=client,
        reason=redact(reason or "") or "",
        idempotency_key=idempotency_key or "",
    )


def audit_entries_for(target: str):
    return AuditEntry.objects.filter(target=target).order_by("-id")

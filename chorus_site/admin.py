"""Platform records in the admin: events, audit entries, API tokens, idempotency records."""

from django.contrib import admin, messages

from .admin_base import DistinctValuesFilter, OpsAdmin
from .audit import audit_record
from .models import ApiToken, AuditEntry, Event, IdempotencyRecord
from .tokens import token_revoke


class EventKindFilter(DistinctValuesFilter):
    title = "kind"
    parameter_name = "kind"
    field_name = "kind"


@admin.register(Event)
class EventAdmin(OpsAdmin):
    list_display = ["id", "stream", "seq", "kind", "actor", "at"]
    list_filter = [EventKindFilter]
    search_fields = ["stream__exact"]  # an exact, indexed match: no UPPER() scan


@admin.register(AuditEntry)
class AuditEntryAdmin(OpsAdmin):
    list_display = ["at", "actor", "action", "target", "client", "outcome"]
    list_filter = ["client", "action"]
    search_fields = ["=target", "actor"]


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(OpsAdmin):
    list_display = ["key", "user", "route", "state", "response_status", "created_at"]
    list_select_related = ["user"]
    redacted_fields = ("response_body",)  # an answer may have carried a one-time key (SPEC §8)


@admin.register(ApiToken)
class ApiTokenAdmin(OpsAdmin):
    list_display = ["name", "user", "prefix", "created_at", "expires_at", "last_used_at", "revoked"]
    list_filter = ["revoked"]
    list_select_related = ["user"]
    actions = ["revoke"]

    @admin.action(description="Revoke selected tokens", permissions=["change"])
    def revoke(self, request, queryset):
        revoked = 0
        for token in queryset.filter(revoked=False):
            if not token_revoke(prefix=token.prefix):
                continue
            audit_record(actor=request.user, action="token.revoke", target=f"apitoken:{token.pk}",
                         outcome="revoked", client="admin")
            revoked += 1
        messages.success(request, f"Revoked {revoked} token(s); {queryset.count() - revoked} were already revoked.")

    def has_change_permission(self, request, obj=None):
        return request.user.has_perm("chorus_site.change_apitoken")

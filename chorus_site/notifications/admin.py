"""Notification rules (ops_admin adds and edits them; every ops role reads them) and the delivery log."""

from urllib.parse import urlsplit

from django import forms
from django.contrib import admin
from django.core.validators import URLValidator
from django.db import transaction

from chorus_site.admin_base import OpsAdmin
from chorus_site.audit import audit_record

from .models import NotificationDelivery, NotificationRule


def url_shown(url: str) -> str:
    """A webhook URL as every ops role may read it: chat services carry their token in the path (and
    sometimes the query), so only the scheme and host are shown."""
    if not url:
        return "—"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}/…" if parts.scheme else "(set)"


class RuleForm(forms.ModelForm):
    # The HMAC key is write-only: shown as set / not set, kept when left empty.
    webhook_secret = forms.CharField(required=False, widget=forms.PasswordInput(render_value=False),
                                     help_text="leave empty to keep the current secret")
    webhook_url = forms.URLField(required=False, max_length=1000, assume_scheme="https",
                                 validators=[URLValidator(schemes=["http", "https"])],  # a webhook is an HTTP POST
                                 help_text=NotificationRule._meta.get_field("webhook_url").help_text)

    class Meta:
        model = NotificationRule
        fields = "__all__"
        exclude = ["webhook_url", "webhook_secret"]  # declared above (the model's would warn on the scheme)

    def save(self, commit=True):
        # Declared fields (Meta excludes them), so set here: construct_instance skips them.
        self.instance.webhook_url = self.cleaned_data.get("webhook_url") or ""
        self.instance.webhook_secret = self.cleaned_data.get("webhook_secret") or ""
        return super().save(commit)

    def clean_webhook_secret(self):
        value = self.cleaned_data.get("webhook_secret") or ""
        return value or (self.instance.webhook_secret if self.instance.pk else "")


@admin.register(NotificationRule)
class NotificationRuleAdmin(admin.ModelAdmin):
    form = RuleForm
    list_display = ["name", "enabled", "trigger", "wake_error_kind", "connection", "backend", "workflow",
                    "channels", "quiet_period_s"]
    list_filter = ["enabled", "trigger"]
    raw_id_fields = ["connection"]

    @admin.display(description="where")
    def channels(self, obj):
        return ", ".join(c for c, on in (("email", obj.emails()), ("webhook", obj.webhook_url)) if on) or "—"

    @admin.display(description="webhook secret")
    def secret_state(self, obj):
        return "set" if obj.webhook_secret else "not set"

    @admin.display(description="webhook")
    def webhook_shown(self, obj):
        return url_shown(obj.webhook_url)

    def get_readonly_fields(self, request, obj=None):
        if not self.has_change_permission(request, obj):
            hidden = {"webhook_secret", "webhook_url"}
            return [f.name for f in self.model._meta.fields if f.name not in hidden] + ["webhook_shown", "secret_state"]
        return []

    def get_fields(self, request, obj=None):
        fields = super().get_fields(request, obj)
        if not self.has_change_permission(request, obj):
            # a viewer never sees the secret, not even masked, nor the URL's path (often a token)
            fields = [("webhook_shown" if f == "webhook_url" else f) for f in fields if f != "webhook_secret"]
            fields += ["secret_state"]
        return fields

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        # What changed, by field name (as issue.edit): never a value, the secret's least of all.
        outcome = (f"changed {', '.join(form.changed_data)}" if form.changed_data else "unchanged") if change \
            else f"{obj.trigger}, enabled={obj.enabled}"
        audit_record(actor=request.user, action="notification_rule.change" if change else "notification_rule.add",
                     target=f"notification_rule:{obj.pk}", outcome=outcome, client="admin")

    def delete_model(self, request, obj):
        audit_record(actor=request.user, action="notification_rule.delete", target=f"notification_rule:{obj.pk}",
                     outcome="deleted", client="admin")
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        # The changelist's "delete selected" action: audited one by one like delete_model, in the
        # deletion's transaction (no entry for a rule that stayed).
        with transaction.atomic():
            for pk in queryset.values_list("pk", flat=True):
                audit_record(actor=request.user, action="notification_rule.delete",
                             target=f"notification_rule:{pk}", outcome="deleted", client="admin")
            super().delete_queryset(request, queryset)

    def has_delete_permission(self, request, obj=None):
        # A rule with deliveries stays (the log points at it); disable it instead.
        if obj is not None and obj.deliveries.exists():
            return False
        return super().has_delete_permission(request, obj)


@admin.register(NotificationDelivery)
class NotificationDeliveryAdmin(OpsAdmin):
    list_display = ["id", "rule", "channel", "about", "state", "attempts", "short_reason", "created_at",
                    "finished_at"]
    list_filter = ["state", "channel", "rule"]
    list_select_related = ["rule"]
    search_fields = ["about", "subject"]

    @admin.display(description="reason")
    def short_reason(self, obj):
        return obj.reason[:120]

    @admin.display(description="target")
    def target_shown(self, obj):
        return url_shown(obj.target) if obj.channel == NotificationDelivery.WEBHOOK else obj.target

    def get_fields(self, request, obj=None):
        return [("target_shown" if f == "target" else f) for f in super().get_fields(request, obj)]

    def get_readonly_fields(self, request, obj=None):
        return [*super().get_readonly_fields(request, obj), "target_shown"]

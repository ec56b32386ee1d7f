"""Roles (SPEC §7) as Django groups, and the checks every admin page, endpoint and consumer uses."""

from __future__ import annotations

from django.contrib.auth.backends import ModelBackend

OPS_APPS = ("sessions_app", "executions", "notifications")

VIEWER, OPERATOR, DIAGNOSTICS, ADMIN = "ops_viewer", "ops_operator", "ops_diagnostics", "ops_admin"
ROLES = (VIEWER, OPERATOR, DIAGNOSTICS, ADMIN)

VIEW_OPS = "sessions_app.view_session"  # the mark of any ops role
VIEW_DIAGNOSTICS = "sessions_app.view_diagnostics"

# Custom permissions: one per operator action of SPEC §4, declared on the models' Meta.
ACTION_PERMISSIONS = {
    "sessions_app": {
        "turn": [
            ("view_diagnostics", "Can view raw diagnostic details"),
            ("interrupt_turn", "Can interrupt a turn"),
            ("mark_interrupted_turn", "Can mark a stuck turn interrupted"),
            ("answer_turn", "Can answer a turn's required actions"),
        ],
        "session": [
            ("start_session", "Can start a session"),
            ("message_session", "Can send a message to a session"),
            ("resume_session", "Can resume a session"),
            ("handoff_session", "Can hand a session off"),
        ],
        "connection": [("drain_connection", "Can drain or undrain a connection")],
    },
    "executions": {
        "run": [
            ("start_run", "Can start a run"),
            ("pause_run", "Can pause a run"),
            ("resume_run", "Can resume a run"),
            ("cancel_run", "Can cancel a run"),
            ("rerun_run", "Can rerun a run"),
            ("signal_run", "Can signal a run"),
        ],
        "agenttask": [("retry_task", "Can retry a task"), ("cancel_task", "Can cancel a task")],
        "issue": [("accept_issue", "Can accept an issue"), ("reject_issue", "Can reject an issue"),
                  ("reopen_issue", "Can reopen a done issue")],
        "approval": [("decide_approval", "Can decide an approval")],
    },
}

# Not operator actions: raw diagnostics have their own role; draining is for ops_admin (§7).
ADMIN_ONLY_ACTIONS = {"view_diagnostics", "drain_connection"}

_OPERATOR_EXTRA = [("executions", "add_issue"), ("executions", "change_issue"), ("executions", "add_comment"),
                   ("executions", "add_artifact")]


def _role_permissions(Permission, ContentType) -> dict[str, set]:
    ops_types = ContentType.objects.filter(app_label__in=OPS_APPS)
    view = set(Permission.objects.filter(content_type__in=ops_types, codename__startswith="view_")
               .exclude(codename="view_diagnostics"))
    view |= set(Permission.objects.filter(content_type__app_label="chorus_site",
                                          codename__in=["view_event", "view_auditentry"]))
    actions = set()
    for app_label, models in ACTION_PERMISSIONS.items():
        for _model, perms in models.items():
            actions |= set(Permission.objects.filter(
                content_type__app_label=app_label,
                codename__in=[c for c, _ in perms if c not in ADMIN_ONLY_ACTIONS]))
    extra = {Permission.objects.get(content_type__app_label=a, codename=c) for a, c in _OPERATOR_EXTRA}
    diagnostics = set(Permission.objects.filter(content_type__app_label="sessions_app", codename="view_diagnostics"))
    everything = set(Permission.objects.filter(content_type__in=ops_types))
    everything |= set(Permission.objects.filter(content_type__app_label="chorus_site"))
    everything |= set(Permission.objects.filter(content_type__app_label="auth"))
    return {
        VIEWER: view,
        OPERATOR: view | actions | extra,
        DIAGNOSTICS: view | diagnostics,
        ADMIN: everything,
    }


def roles_sync(apps=None) -> None:
    """Create the role groups and (re)assign their permissions; used by the data migration."""
    if apps is None:
        from django.apps import apps as global_apps

        apps = global_apps
    from django.contrib.auth.management import create_permissions

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    ContentType = apps.get_model("contenttypes", "ContentType")
    for role, perms in _role_permissions(Permission, ContentType).items():
        group, _ = Group.objects.get_or_create(name=role)
        group.permissions.set(perms)


def has_ops_role(user) -> bool:
    return bool(user and user.is_authenticated and user.is_active and user.has_perm(VIEW_OPS))


def can_view_diagnostics(user) -> bool:
    return bool(user and user.is_authenticated and user.is_active and user.has_perm(VIEW_DIAGNOSTICS))


# ---------------------------------------------------------------- one query for a user's permissions
def permissions_of(user_id) -> set[str]:
    """Names ("app_label.codename") of the permissions a user holds directly or through a group."""
    from django.contrib.auth.models import Permission
    from django.db.models import F, Q, Value
    from django.db.models.functions import Concat

    return set(Permission.objects.filter(Q(user=user_id) | Q(group__user=user_id)).order_by()
               .annotate(perm=Concat(F("content_type__app_label"), Value("."), F("codename")))
               .values_list("perm", flat=True).distinct())


def permissions_preload(user, names) -> None:
    """Give ``user`` the permission names read with it (chorus_site/tokens.py) as ModelBackend caches
    them (``_perm_cache``, read by ``get_all_permissions``): ``has_perm`` asks the database nothing more."""
    if not user.is_superuser:  # a superuser's has_perm never reads them; its get_all_permissions is every one
        user._perm_cache = set(names or ())


class OneQueryModelBackend(ModelBackend):
    """Django's ModelBackend, reading a user's permissions in one statement instead of two
    (user permissions and group permissions): every API request and admin page checks one."""

    def get_all_permissions(self, user_obj, obj=None):
        if not user_obj.is_active or user_obj.is_anonymous or obj is not None:
            return set()
        if not hasattr(user_obj, "_perm_cache"):
            if user_obj.is_superuser:
                return super().get_all_permissions(user_obj, obj)
            user_obj._perm_cache = permissions_of(user_obj.pk)
        return user_obj._perm_cache

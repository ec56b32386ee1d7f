"""Operator action pages of the admin (SPEC §4): a confirmation page per action, then the service.

Every page says what will be touched and that stopping never undoes work (SPEC §1 rule 1); every
POST calls the same service as the API, which audits it.
"""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse

from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError

from . import actions, selectors
from .models import Connection, Session

NOTHING_UNDONE = ("Stopping never undoes work: files written, commands run and comments posted stay as they are. "
                  "The turn page lists what changed.")


def _require(request, perm):
    if not request.user.has_perm(perm):
        raise PermissionDenied


def _object(admin, request, object_id, perm):
    """The object of an action page, for a user holding ``perm`` (else 403, as the admin does)."""
    _require(request, perm)
    obj = admin.get_object(request, object_id)
    if obj is None:
        raise PermissionDenied
    return obj


def _page(admin, request, obj, *, title, action_label, touched, fields=(), extra=None, danger=False, values=None):
    """``fields``: (name, label, kind); ``values`` refill the form after a refusal, so nothing typed is lost."""
    values = values or {}
    fields = [(name, label, kind, values.get(name, "")) for name, label, kind in fields]
    context = {
        **admin.admin_site.each_context(request), "opts": admin.model._meta, "original": obj, "title": title,
        "action_label": action_label, "touched": touched, "fields": fields, "nothing_undone": NOTHING_UNDONE,
        "reason": values.get("reason", ""),
        "danger": danger, **(extra or {}),
    }
    return TemplateResponse(request, "admin/chorus/action_confirm.html", context)


def _done(request, url, answer: dict, success: str):
    changed = answer.get("changed", True)
    messages.success(request, success if changed else "Nothing to do: that already holds.")
    return HttpResponseRedirect(url)


def _refused(request, url, error: ApplicationError):
    messages.error(request, f"Refused ({error.code}): {error.message}")
    return HttpResponseRedirect(url)


def _turn_url(turn):
    return reverse("admin:sessions_app_turn_change", args=[turn.pk])


def _session_url(session):
    return reverse("admin:sessions_app_session_change", args=[session.pk])


# ---------------------------------------------------------------- turn actions
def turn_interrupt_view(admin, request, object_id):
    turn = _object(admin, request, object_id, "sessions_app.interrupt_turn")
    # The connection that runs the turn (the session may have moved since), and where it was started.
    runner = selectors.turn_runner_connection(turn)
    start = turn.commands.filter(action__in=["start_turn", "resume"]).order_by("-id").first()
    cwd = (start.payload or {}).get("cwd") if start else turn.session.cwd
    if request.method == "POST":
        try:
            answer = actions.turn_interrupt(actor=request.user, turn_id=turn.pk, client="admin",
                                            reason=request.POST.get("reason") or None)
        except ApplicationError as error:
            return _refused(request, _turn_url(turn), error)
        text = ("Settled at once: the turn never started." if answer.get("settled")
                else "Stop requested: the daemon asks the agent to stop, then kills its process tree after "
                     f"{runner.sigint_timeout_s} s. Progress shows on the turn.")
        return _done(request, _turn_url(turn), answer, text)
    return _page(admin, request, turn, title=f"Interrupt turn #{turn.seq}?", action_label="Interrupt",
                 danger=True, touched=[
                     f"Turn #{turn.seq} of session “{turn.session}” ({turn.status_label})",
                     f"The agent process on {runner.name} in {cwd}: asked to stop, "
                     f"then its whole process tree is killed after {runner.sigint_timeout_s} s",
                 ])


def turn_mark_interrupted_view(admin, request, object_id):
    turn = _object(admin, request, object_id, "sessions_app.mark_interrupted_turn")
    if request.method == "POST":
        reason = request.POST.get("reason") or None
        try:
            evidence = actions.turn_gather_evidence(turn_id=turn.pk)
            answer = actions.turn_mark_interrupted(actor=request.user, turn_id=turn.pk, evidence=evidence,
                                                   client="admin", reason=reason)
        except ApplicationError as error:
            audit_record(actor=request.user, action="turn.mark_interrupted", target=f"turn:{turn.pk}",
                         outcome=f"refused: {error.code}", client="admin", reason=reason)
            if error.code == "process_alive":
                messages.error(request, "The daemon still holds a live process for this turn, so it is not stuck. "
                                        "Use Interrupt to stop it.")
                return HttpResponseRedirect(_turn_url(turn))
            return _refused(request, _turn_url(turn), error)
        basis = (answer.get("evidence") or {}).get("basis", "")
        return _done(request, _turn_url(turn), answer, f"The turn is cleared as interrupted (evidence: {basis}).")
    return _page(admin, request, turn, title=f"Clear stuck turn #{turn.seq}?", action_label="Clear stuck turn",
                 touched=[
                     f"Turn #{turn.seq} shows {turn.status_label} — use this when its process is gone.",
                     "The portal checks first: connection offline, stale heartbeat, absent from the daemon's "
                     "latest snapshot, or the daemon answering a probe with “not held”. The evidence is kept "
                     "on the turn.",
                     "If the daemon still holds the process, nothing changes and you are pointed to Interrupt.",
                 ])


# ---------------------------------------------------------------- session actions
def session_resume_view(admin, request, object_id):
    session = _object(admin, request, object_id, "sessions_app.resume_session")
    if request.method == "POST":
        try:
            answer = actions.session_resume(actor=request.user, session_id=session.pk, client="admin",
                                            context=request.POST.get("context", ""),
                                            reason=request.POST.get("reason") or None)
        except ApplicationError as error:
            return _refused(request, reverse("admin:sessions_app_session_resume", args=[session.pk]), error)
        return _done(request, _session_url(session), answer,
                     "Resume turn created on the original connection and directory.")
    preflight = selectors.resume_preflight(session)
    return _page(admin, request, session, title=f"Resume “{session}”?", action_label="Resume",
                 touched=[f"A new turn (trigger resume) in {session.cwd} on {session.connection.name}, continuing "
                          f"the agent's own session {session.backend_session_id or '(id not known yet)'}"],
                 fields=[("context", "Added context or correction for the agent", "textarea")],
                 extra={"preflight": preflight, "preflight_changes": selectors.changes_view(preflight["files_changed_since"]),
                        "blocked": None if preflight["resumable"] else preflight["refusal"]})


def session_handoff_view(admin, request, object_id):
    session = _object(admin, request, object_id, "sessions_app.handoff_session")
    if request.method == "POST":
        try:
            answer = actions.session_handoff(
                actor=request.user, session_id=session.pk, client="admin", context=request.POST.get("context", ""),
                connection_id=request.POST.get("connection") or None, cwd=request.POST.get("cwd") or None,
                reason=request.POST.get("reason") or None)
        except ApplicationError as error:
            return _refused(request, reverse("admin:sessions_app_session_handoff", args=[session.pk]), error)
        new = Session.objects.get(pk=answer["session"])
        return _done(request, _session_url(new), answer, "Handed off: this new session carries the old one's context.")
    return _page(admin, request, session, title=f"Hand off “{session}” to a new session?", action_label="Hand off",
                 touched=[f"Session “{session}” is ended (its history stays).",
                          "A new session starts with a first prompt built from the old transcript tail, the last "
                          "turn's diagnostics summary and changes, and your context. Both link to each other."],
                 fields=[("context", "Context for the new session", "textarea"),
                         ("connection", "Connection (default: the same)", "connection"),
                         ("cwd", f"Directory (default: {session.cwd})", "text")],
                 extra={"connections": Connection.objects.order_by("name")})


def session_message_view(admin, request, object_id):
    session = _object(admin, request, object_id, "sessions_app.message_session")
    if request.method != "POST":
        raise PermissionDenied
    try:
        answer = actions.session_message(actor=request.user, session_id=session.pk, client="admin",
                                         prompt=request.POST.get("prompt", ""))
    except ApplicationError as error:
        return _refused(request, _session_url(session), error)
    return _done(request, _session_url(session), answer,
                 "Queued: it starts when the running turn ends." if answer.get("queued") else "Sent to the daemon.")


def connection_start_view(admin, request, object_id):
    connection = _object(admin, request, object_id, "sessions_app.start_session")
    values = {"cwd": connection.cwds[0] if connection.cwds else ""}
    if request.method == "POST":
        values = request.POST
        try:
            answer = actions.session_start(
                actor=request.user, connection_id=connection.pk, cwd=request.POST.get("cwd", ""),
                prompt=request.POST.get("prompt", ""), idea_key=request.POST.get("idea_key") or None,
                title=request.POST.get("title", ""), acknowledge_changes=bool(request.POST.get("acknowledge_changes")),
                client="admin", reason=request.POST.get("reason") or None)
        except ApplicationError as error:
            if error.code == "changes_unacknowledged":
                messages.warning(request, f"The last turn in this directory was interrupted and reported changes: "
                                          f"{error.detail.get('changes') or 'none listed'}. Tick the acknowledgement "
                                          "to start anyway.")
            else:
                messages.error(request, f"Refused ({error.code}): {error.message}")
        else:
            return _done(request, _session_url(Session.objects.get(pk=answer["session"])), answer,
                         "Session started.")
    return _page(admin, request, connection, title=f"Start work on {connection.name}", action_label="Start",
                 touched=[f"A new turn of a session on {connection.name} ({connection.backend}); an existing active "
                          "session with the same idea key continues (and moves here if its directory differs)."],
                 fields=[("cwd", "Directory", "cwd"), ("prompt", "Instruction", "textarea"),
                         ("title", "Title", "text"), ("idea_key", "Idea key (optional)", "text"),
                         ("acknowledge_changes", "I have seen the changes of the last interrupted turn here",
                          "checkbox")],
                 extra={"cwds": connection.cwds}, values=values)


def bulk_turns(admin, request, queryset, *, perm, label, run):
    """Changelist bulk action with a confirmation page; reports what succeeded and what was refused."""
    _require(request, perm)
    turns = list(queryset.select_related("session__connection")[:200])
    if request.POST.get("confirmed") != "yes":
        context = {**admin.admin_site.each_context(request), "opts": admin.model._meta, "title": f"{label}?",
                   "turns": turns, "action": request.POST.get("action"), "label": label,
                   "nothing_undone": NOTHING_UNDONE}
        return TemplateResponse(request, "admin/chorus/bulk_turns_confirm.html", context)
    done, unchanged, refused = 0, 0, []
    for turn in turns:
        try:
            answer = run(turn)
        except ApplicationError as error:
            refused.append(f"#{turn.seq} of {turn.session}: {error.message}")
            continue
        if answer.get("changed", True):
            done += 1
        else:
            unchanged += 1
    messages.success(request, f"{label}: {done} done, {unchanged} already so, {len(refused)} refused.")
    for line in refused[:20]:
        messages.warning(request, line)
    return None


"""Troubleshooting record of a session (SPEC §9), and the export rules the run record shares.

A record is plain JSON (strings, numbers, lists, dicts) so it can be answered as JSON, rendered as
Markdown, or attached to a bug report as it is. Redacted by default (§7): every string is passed
through ``redact`` again (storage already masked agent output; what operators typed was never
masked), JSON blobs through ``redact_data``, and prompts and final replies shrink to a short
redacted preview. An unredacted record shows the stored values as they are — storage masking is
never undone — and only ``ops_diagnostics`` may ask for one, or for the captured error details.

sessions_app never imports executions: what a session's turns did for runs is added by a context
provider that executions registers at app start (``on_session_record``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from django.core.serializers.json import DjangoJSONEncoder
from django.http import HttpResponse, JsonResponse
from django.utils import timezone

from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError
from chorus_site.models import EventStream
from chorus_site.permissions import can_view_diagnostics
from chorus_site.redaction import redact, redact_data

from .models import Connection, Session, Turn

PREVIEW_CHARS = 200
SESSION_TURN_LIMIT = 200
FORMATS = ("json", "md")

# Strings the walker leaves alone: ids and timestamps carry no secret and are many.
_PLAIN = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?"
)

_session_context_providers: list[Callable[[Session, list[Turn]], dict]] = []


def on_session_record(provider: Callable[[Session, list[Turn]], dict]) -> None:
    """Register ``provider(session, turns) -> {section: rows}``, merged into ``record["work"]``."""
    if provider not in _session_context_providers:
        _session_context_providers.append(provider)


# ---------------------------------------------------------------- building blocks
def iso(value) -> str | None:
    return value.isoformat() if value else None


def sid(value) -> str | None:
    return str(value) if value else None


def blob(value, *, redacted: bool):
    """A JSON field of the database: keys named like secrets have their values masked too."""
    return redact_data(value) if redacted else value


def text_out(text: str | None, *, redacted: bool) -> dict:
    """A prompt or reply: whole when unredacted, else a redacted preview of PREVIEW_CHARS."""
    text = text or ""
    if not redacted:
        return {"text": text, "chars": len(text), "truncated": False}
    masked = redact(text) or ""  # mask first: a cut could split a secret past recognition
    cut = len(masked) > PREVIEW_CHARS
    return {"text": masked[:PREVIEW_CHARS] + ("…" if cut else ""), "chars": len(text), "truncated": cut}


def redact_strings(value):
    if isinstance(value, str):
        return value if _PLAIN.fullmatch(value) else redact(value)
    if isinstance(value, list):
        return [redact_strings(item) for item in value]
    if isinstance(value, dict):
        return {key: redact_strings(item) for key, item in value.items()}
    return value


def stream_cursors(names) -> dict[str, int]:
    """The last event id (cursor) of each stream; 0 for a stream without events."""
    names = list(dict.fromkeys(names))
    found = dict(EventStream.objects.filter(name__in=names).values_list("name", "last_event_id"))
    return {name: found.get(name, 0) for name in names}


def connection_out(c: Connection | None) -> dict | None:
    if c is None:
        return None
    return {"id": str(c.id), "name": c.name, "host": c.host, "backend": c.backend, "status": c.status,
            "daemon_version": c.daemon_version, "last_heartbeat_at": iso(c.last_heartbeat_at)}


def session_out(s: Session, cursors: dict[str, int]) -> dict:
    return {
        "id": str(s.id), "idea_key": s.idea_key, "title": s.title, "status": s.status, "cwd": s.cwd,
        "backend": s.backend, "backend_session_id": s.backend_session_id, "provider": s.provider, "model": s.model,
        "connection_id": sid(s.connection_id), "handoff_from": sid(s.handoff_from_id),
        "tokens": {"input": s.tokens_input, "output": s.tokens_output, "cache_read": s.tokens_cache_read,
                   "cache_write": s.tokens_cache_write},
        "created_at": iso(s.created_at), "last_turn_at": iso(s.last_turn_at),
        "event_cursor": cursors.get(s.stream, 0),
    }


def wake_error_out(wake_error: dict | None, *, include_details: bool) -> dict | None:
    if not wake_error:
        return None
    return {
        "summary": wake_error.get("summary") or "", "kind": wake_error.get("kind") or "",
        "source": wake_error.get("source") or "", "exit_code": wake_error.get("exit_code"),
        "signal": wake_error.get("signal"),
        "details": (wake_error.get("details") or "") if include_details else None,
        "details_withheld": not include_details,
    }


def turn_out(t: Turn, *, redacted: bool, include_details: bool) -> dict:
    requires = t.requires_action or {}
    return {
        "id": str(t.id), "session_id": str(t.session_id), "seq": t.seq, "trigger": t.trigger, "status": t.status,
        "interrupted_reason": t.interrupted_reason, "stop_state": t.stop_state,
        "wake_error": wake_error_out(t.wake_error, include_details=include_details),
        "attempt_id": sid(t.attempt_id), "merged_into": sid(t.merged_into_id),
        "prompt": text_out(t.prompt, redacted=redacted), "final_reply": text_out(t.final_reply, redacted=redacted),
        "requires_action": ({"kind": requires.get("kind"), "items": len(requires.get("items") or [])}
                            if requires else None),
        "usage": blob(t.usage, redacted=redacted), "changes": blob(t.changes, redacted=redacted),
        "background_processes": blob(t.background_processes, redacted=redacted),
        "created_at": iso(t.created_at), "started_at": iso(t.started_at), "ended_at": iso(t.ended_at),
    }


def record_header(kind: str, *, redacted: bool, include_details: bool) -> dict:
    return {"kind": kind, "generated_at": iso(timezone.now()), "redacted": redacted,
            "details_included": include_details}


def record_finish(record: dict) -> dict:
    return redact_strings(record) if record["redacted"] else record


# ---------------------------------------------------------------- the session record
def session_record(session: Session, *, redacted: bool = True, include_details: bool = False,
                   turn_limit: int = SESSION_TURN_LIMIT) -> dict:
    session = Session.objects.select_related("connection").get(pk=session.pk)
    total = session.turns.count()
    turns = list(reversed(session.turns.order_by("-seq")[:turn_limit]))
    try:
        handoff_to = sid(session.handoff_to.id)
    except Session.DoesNotExist:
        handoff_to = None
    cursors = stream_cursors([session.stream])
    record = record_header("session", redacted=redacted, include_details=include_details)
    record.update({
        "session": session_out(session, cursors) | {"handoff_to": handoff_to},
        "connection": connection_out(session.connection),
        "event_cursors": cursors,
        "turns_total": total, "turns_omitted": max(total - len(turns), 0),
        "turns": [turn_out(t, redacted=redacted, include_details=include_details) for t in turns],
        "work": {},
    })
    for provider in _session_context_providers:
        record["work"].update(provider(session, turns))
    return record_finish(record)


# ---------------------------------------------------------------- Markdown
def md_cell(value) -> str:
    if value is None or value == "" or value == {} or value == []:
        return "–"
    if isinstance(value, (dict, list)):
        # Readable, not JSON: json.dumps would print a multi-line summary with a literal "\n".
        value = _md_plain(value)
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _md_plain(value) -> str:
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_md_plain(v)}" for k, v in value.items() if v not in (None, "", [], {}))
    if isinstance(value, list):
        return ", ".join(_md_plain(v) for v in value)
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, cls=DjangoJSONEncoder).strip('"')


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(md_cell(v) for v in row) + " |" for row in rows]
    return lines + [""]


def md_block(text: str) -> list[str]:
    """A fenced block longer than any backtick run inside, so captured output cannot close it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, text, fence, ""]


def md_header(record: dict, title: str) -> list[str]:
    return [f"# {title}", "",
            f"Generated {record['generated_at']} · "
            + ("redacted (secrets masked, prompts and replies cut to a preview)" if record["redacted"]
               else "**unredacted** (stored values; handle as confidential)")
            + " · diagnostic details " + ("included" if record["details_included"] else "withheld"), ""]


def md_wake_error(label: str, wake_error: dict | None) -> list[str]:
    if not wake_error:
        return []
    lines = [f"- {label}: **{md_cell(wake_error['kind'])}** {md_cell(wake_error['summary'])}"
             f" (exit code {md_cell(wake_error['exit_code'])}, signal {md_cell(wake_error['signal'])},"
             f" source {md_cell(wake_error['source'])})"]
    if wake_error.get("details"):
        lines += ["", *md_block(wake_error["details"])]
    elif wake_error.get("details_withheld"):
        lines.append("  - details withheld (ops_diagnostics, `?details=1`)")
    return lines


def md_text(label: str, text: dict | None) -> list[str]:
    if not text or not text["text"]:
        return []
    note = f" ({text['chars']} chars, preview)" if text["truncated"] else ""
    return [f"- {label}{note}:", "", *md_block(text["text"])]


def session_markdown(record: dict) -> str:
    s, c = record["session"], record["connection"] or {}
    lines = md_header(record, f"Troubleshooting record — session {s['id']}")
    lines += ["## Session", "",
              f"- Portal session: `{s['id']}` ({s['status']}) · idea key `{md_cell(s['idea_key'])}`",
              f"- Backend session: `{md_cell(s['backend_session_id'])}` · backend {s['backend']} · "
              f"provider {md_cell(s['provider'])} · model {md_cell(s['model'])}",
              f"- Connection: {md_cell(c.get('name'))} (`{md_cell(c.get('id'))}`) on host {md_cell(c.get('host'))}"
              f" · cwd `{s['cwd']}`",
              f"- Handoff from {md_cell(s['handoff_from'])} · to {md_cell(s['handoff_to'])}",
              f"- Last event cursor of `session:{s['id']}`: {s['event_cursor']}", ""]
    for section, rows in record["work"].items():
        if rows:
            lines += [f"## {section.replace('_', ' ').capitalize()}", "",
                      *md_table(list(rows[0]), [list(row.values()) for row in rows])]
    lines += [f"## Turns ({record['turns_total']}"
              + (f", oldest {record['turns_omitted']} omitted" if record["turns_omitted"] else "") + ")", ""]
    lines += md_table(
        ["seq", "turn", "trigger", "status", "reason", "stop", "wake error", "attempt", "started", "ended"],
        [[t["seq"], t["id"], t["trigger"], t["status"], t["interrupted_reason"], t["stop_state"],
          (t["wake_error"] or {}).get("summary"), t["attempt_id"], t["started_at"], t["ended_at"]]
         for t in record["turns"]])
    for t in record["turns"]:
        detail = md_wake_error("Wake error", t["wake_error"]) + md_text("Prompt", t["prompt"]) \
            + md_text("Final reply", t["final_reply"])
        if detail:
            lines += [f"### Turn {t['seq']} (`{t['id']}`)", "", *detail, ""]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- export (API and admin)
def export_options(user, *, redacted: bool, details: bool) -> None:
    """Unredacted records and captured details are raw diagnostics: ops_diagnostics only (403)."""
    if (not redacted or details) and not can_view_diagnostics(user):
        raise ApplicationError("forbidden", "unredacted records and diagnostic details are shown only to the "
                                            "ops_diagnostics role", {"redacted": redacted, "details": details})


def export_response(*, user, record: dict, target: str, filename: str, fmt: str, markdown: Callable[[dict], str],
                    client: str = "api", attachment: bool | None = None) -> HttpResponse:
    """The record as JSON or Markdown; every raw export (unredacted or with details) is audited once."""
    if fmt not in FORMATS:
        raise ApplicationError("bad_request", f"format must be one of {', '.join(FORMATS)}", {"allowed": FORMATS})
    if not record["redacted"] or record["details_included"]:
        outcome = ", ".join(part for part, on in (("unredacted", not record["redacted"]),
                                                   ("with details", record["details_included"])) if on)
        audit_record(actor=user, action="troubleshooting.export", target=target, outcome=f"exported {outcome}",
                     client=client)
    if fmt == "md":
        response = HttpResponse(markdown(record), content_type="text/markdown; charset=utf-8")
        attachment = True if attachment is None else attachment
    else:
        response = JsonResponse(record, encoder=DjangoJSONEncoder, json_dumps_params={"indent": 2})
    if attachment:
        response["Content-Disposition"] = f'attachment; filename="{filename}.{fmt}"'
    response["Cache-Control"] = "private, no-store"
    response["X-Content-Type-Options"] = "nosniff"
    return response

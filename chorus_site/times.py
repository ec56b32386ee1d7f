"""Readable times (issue 11 item 3): "3 min ago", "running for 2 m 14 s", with the absolute time and
its zone on hover.  The page renders the text; /static/chorus/times.js keeps it true as time passes
(the same wording, so nothing jumps) and shows the reader's own time zone on hover.
"""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

from django.utils import timezone
from django.utils.html import format_html

EMPTY = "–"


def format_duration(seconds: float) -> str:
    """``850 ms``, ``14 s``, ``2 m 14 s``, ``1 h 05 m``, ``3 d 4 h``."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))} ms"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} m"
    if minutes:
        return f"{minutes} m {secs} s"
    return f"{secs} s"


def format_relative(value: datetime, now: datetime | None = None) -> str:
    """``12 s ago``, ``3 min ago``, ``5 h ago``, ``2 d ago``, ``in 3 min``; a date after 30 days."""
    now = now or timezone.now()
    seconds = (now - value).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 5:
        return "just now"
    if seconds < 60:
        text = f"{int(seconds)} s"
    elif seconds < 3600:
        text = f"{int(seconds // 60)} min"
    elif seconds < 86400:
        text = f"{int(seconds // 3600)} h"
    elif seconds < 30 * 86400:
        text = f"{int(seconds // 86400)} d"
    else:
        return "on " + absolute(value)[:10]
    return f"in {text}" if future else f"{text} ago"


def absolute(value: datetime) -> str:
    return value.astimezone(dt_timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(value: datetime) -> str:
    return value.astimezone(dt_timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def when_html(value: datetime | None, now: datetime | None = None):
    """A moment: relative text, the absolute time on hover (times.js keeps the text current)."""
    if value is None:
        return EMPTY
    return format_html('<time class="chorus-when" datetime="{}" title="{}">{}</time>', iso(value), absolute(value),
                       format_relative(value, now))


def duration_html(start: datetime | None, end: datetime | None, now: datetime | None = None):
    """How long something took; still under way (no end): a timer that ticks (times.js)."""
    if start is None:
        return EMPTY
    if end is not None:
        return format_html('<span class="chorus-duration" title="{} → {}">{}</span>', absolute(start), absolute(end),
                           format_duration((end - start).total_seconds()))
    elapsed = ((now or timezone.now()) - start).total_seconds()
    return format_html('<time class="chorus-timer" datetime="{}" title="since {}">running for {}</time>', iso(start),
                       absolute(start), format_duration(elapsed))


def parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))

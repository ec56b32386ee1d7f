"""The API's search box (``?q=``) by indexed fields only (issue 9 item 4, SPEC §11 P5).

A value that is a UUID matches ids exactly (primary keys); otherwise substrings of the named
text fields, which PostgreSQL serves from trigram indexes (executions/migrations/0005). A trigram
index cannot narrow a substring shorter than three characters, so shorter values match exact
fields only, never by reading every row.
"""

from __future__ import annotations

from uuid import UUID

from django.db.models import Q

MIN_SUBSTRING = 3


def as_uuid(value: str) -> UUID | None:
    try:
        return UUID(value.strip())
    except (ValueError, AttributeError):
        return None


def contains_any(value: str, *fields: str) -> Q:
    """``field`` contains ``value`` (case-insensitive) for any of ``fields``; matches nothing when
    the value is too short for the indexes."""
    value = value.strip()
    if len(value) < MIN_SUBSTRING:
        return Q(pk__in=[])
    q = Q()
    for field in fields:
        q |= Q(**{f"{field}__icontains": value})
    return q

"""Where secrets survive: every row of every table of the database, as text (issue 8 canary suite)."""

from __future__ import annotations

from django.apps import apps
from django.db import connection


def database_texts() -> dict[str, str]:
    """{table: all its rows as JSON text} for every table of every installed model (PostgreSQL)."""
    out = {}
    tables = sorted({m._meta.db_table for m in apps.get_models(include_auto_created=True)})
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f'SELECT coalesce(string_agg(row_to_json(t)::text, chr(10)), \'\') FROM "{table}" t')
            out[table] = cursor.fetchone()[0]
    return out


def places_found(secrets: dict[str, str], texts: dict[str, str]) -> dict[str, list[str]]:
    """{canary id: [places whose text holds its secret]} for the canaries found anywhere."""
    found = {}
    for cid, secret in secrets.items():
        where = [place for place, text in texts.items() if secret in text]
        if where:
            found[cid] = where
    return found

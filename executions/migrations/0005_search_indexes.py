"""Trigram indexes for the API's search box (issue 9 item 4): ``?q=`` on sessions, issues and runs
matches substrings (``UPPER(col) LIKE UPPER('%q%')``, Django's icontains) through these instead of
reading every row — 1 s per search at 1M rows before.

PostgreSQL only (pg_trgm); SQLite (embedded mode) searches its small tables by scanning. The
sessions' indexes are created here too, in one place with the others (sessions_app's own next
migration number is being taken by parallel work); the expressions are exactly the ones Django's
icontains writes, or the planner would not use them.
"""

from django.db import migrations

INDEXES = [
    ("chorus_search_session_title", "sessions_app_session", 'UPPER(("title")::text)'),
    ("chorus_search_session_idea_key", "sessions_app_session", 'UPPER(("idea_key")::text)'),
    ("chorus_search_session_cwd", "sessions_app_session", 'UPPER(("cwd")::text)'),
    ("chorus_search_issue_title", "executions_issue", 'UPPER(("title")::text)'),
    ("chorus_search_issue_body", "executions_issue", 'UPPER("body")'),
    ("chorus_search_run_failure_message", "executions_run", 'UPPER("failure_message")'),
]


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    for name, table, expression in INDEXES:
        schema_editor.execute(f'CREATE INDEX IF NOT EXISTS {name} ON "{table}" USING gin ({expression} gin_trgm_ops)')


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, _table, _expression in INDEXES:
        schema_editor.execute(f"DROP INDEX IF EXISTS {name}")


class Migration(migrations.Migration):

    dependencies = [
        ("executions", "0004_issue_reopen_permission"),
        ("sessions_app", "0003_connection_daemon_socket"),
    ]

    operations = [migrations.RunPython(create, drop)]

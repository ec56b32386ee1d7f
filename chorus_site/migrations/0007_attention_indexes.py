"""Partial indexes behind the dashboard's needs-attention counts and the list filters they link to
(issue 11; sessions_app/attention.py, executions/attention.py).  Without them, at 1M turns, "failed
in the last 24 h" read every interrupted turn (0.75 s) and "stop unconfirmed" the whole table
(0.2 s); with them each is a short range of a small index.

Written as SQL here, beside the dashboard that needs them, rather than in the apps' Meta: the apps'
own next migration numbers are being taken by parallel work (as executions' 0005 explains for its
search indexes).  Partial indexes work alike on PostgreSQL and SQLite.
"""

from django.db import migrations

INDEXES = [
    ("turn_interrupted_ended_idx", "sessions_app_turn", "ended_at", "status = 'interrupted'"),
    ("turn_stop_unconfirmed_idx", "sessions_app_turn", "id", "stop_state = 'unconfirmed'"),
    ("turn_active_connection_idx", "sessions_app_turn", "connection_id", "status IN ('running', 'requires_action')"),
    ("run_failed_completed_idx", "executions_run", "completed_at", "state = 'failed'"),
]


class Migration(migrations.Migration):

    dependencies = [
        ("chorus_site", "0006_portal_presence"),
        ("sessions_app", "0002_turn_connection"),
        ("executions", "0001_initial"),
    ]

    operations = [
        migrations.RunSQL(
            sql=[f'CREATE INDEX IF NOT EXISTS {name} ON "{table}" ("{column}") WHERE {where}'
                 for name, table, column, where in INDEXES],
            reverse_sql=[f"DROP INDEX IF EXISTS {name}" for name, *_ in INDEXES],
        ),
    ]

from django.db import migrations


def resync_roles(apps, schema_editor):
    # Reopening a done issue is an operator action (issue 7 item 15): ops_operator gets reopen_issue.
    from chorus_site.permissions import roles_sync

    roles_sync(apps)


class Migration(migrations.Migration):
    dependencies = [("chorus_site", "0004_roles_resync"), ("executions", "0004_issue_reopen_permission")]

    operations = [migrations.RunPython(resync_roles, migrations.RunPython.noop)]

from django.db import migrations


def resync_roles(apps, schema_editor):
    # Draining connections became an ops_admin-only action (SPEC §7).
    from chorus_site.permissions import roles_sync

    roles_sync(apps)


class Migration(migrations.Migration):
    dependencies = [("chorus_site", "0003_idempotency_scope"), ("executions", "0002_attempt_backend_choices")]

    operations = [migrations.RunPython(resync_roles, migrations.RunPython.noop)]

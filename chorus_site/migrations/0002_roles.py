from django.db import migrations


def create_roles(apps, schema_editor):
    from chorus_site.permissions import roles_sync

    roles_sync(apps)


def remove_roles(apps, schema_editor):
    from chorus_site.permissions import ROLES

    apps.get_model("auth", "Group").objects.filter(name__in=ROLES).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("chorus_site", "0001_initial"),
        ("sessions_app", "0001_initial"),
        ("executions", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(create_roles, remove_roles)]

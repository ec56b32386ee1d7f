from django.db import migrations, models


def forget_records(apps, schema_editor):
    # Idempotency records live 24 h; dropping them on upgrade only means a retry within that
    # window acts again, which is preferable to guessing the scope of old rows.
    apps.get_model("chorus_site", "IdempotencyRecord").objects.all().delete()


class Migration(migrations.Migration):
    dependencies = [("chorus_site", "0002_roles")]

    operations = [
        migrations.RunPython(forget_records, migrations.RunPython.noop),
        migrations.RemoveConstraint(model_name="idempotencyrecord", name="idempotency_user_route_key_unique"),
        migrations.AddField(
            model_name="idempotencyrecord", name="scope", field=models.CharField(max_length=64, default=""),
            preserve_default=False,
        ),
        migrations.AddConstraint(
            model_name="idempotencyrecord",
            constraint=models.UniqueConstraint(fields=["scope", "route", "key"],
                                               name="idempotency_scope_route_key_unique"),
        ),
    ]

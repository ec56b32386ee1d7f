import django.db.models.deletion
from django.db import migrations, models


def backfill(apps, schema_editor):
    # A turn already sent runs on the connection its start command went to.
    Turn = apps.get_model("sessions_app", "Turn")
    ControlCommand = apps.get_model("sessions_app", "ControlCommand")
    starts = (ControlCommand.objects.filter(action__in=["start_turn", "resume"]).exclude(turn=None)
              .order_by("id").values_list("turn_id", "connection_id"))
    for turn_id, connection_id in starts:
        Turn.objects.filter(pk=turn_id).update(connection_id=connection_id)


class Migration(migrations.Migration):

    dependencies = [
        ("sessions_app", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="turn",
            name="connection",
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT,
                                    related_name="turns", to="sessions_app.connection"),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]

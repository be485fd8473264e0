from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0013_dispatch_sent_again"),
    ]

    operations = [
        migrations.AlterField(
            model_name="dispatchjob",
            name="dispatched_by",
            field=models.BigIntegerField(
                blank=True,
                help_text="The job whose end made the room this one was dispatched into "
                "(negative: the number drawn by a dispatch that was not an end's; empty for "
                "an enqueue's), so that the step, sent again after its reply was lost, "
                "publishes it.",
                null=True,
            ),
        ),
    ]

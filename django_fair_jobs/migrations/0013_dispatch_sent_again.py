from typing import Any

from django.db import migrations, models

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "98151763deac7826be9210ae3e6cfce89231286e17a9e6135082a934674cbbcf"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # An end sent again after a lost reply returns what its first try dispatched: the
    # dispatch keeps the job whose end made the room (dispatched_by), and the ends take
    # p_again. New arguments make new signatures, so the old ones are dropped first.
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP FUNCTION IF EXISTS fair_jobs_dispatch(text, integer),"
        " fair_jobs_dispatch_end(bigint, uuid, text, double precision, boolean, integer),"
        " fair_jobs_dispatch_end_many(bigint[], uuid, integer)"
    )
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0012_dispatch_message"),
    ]

    operations = [
        migrations.AddField(
            model_name="dispatchjob",
            name="dispatched_by",
            field=models.BigIntegerField(
                blank=True,
                help_text="The job whose end made the room this one was dispatched into, so "
                "that the end, sent again after its reply was lost, publishes it.",
                null=True,
            ),
        ),
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

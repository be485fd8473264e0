from typing import Any

from django.db import migrations, models

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "3f1f20f6de806b69352282484e4339b897b693446c76595cd8640c0dfa626406"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # An enqueue's dispatch keeps the number the enqueue drew (p_by), so that the enqueue
    # sent again after a lost reply finds every job that dispatch took. A new argument
    # makes a new signature, so the old one is dropped first.
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP FUNCTION IF EXISTS fair_jobs_enqueue(text, text, text, text, text,"
        " double precision, timestamptz, double precision, integer, smallint, boolean)"
    )
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0014_dispatched_by_a_dispatch"),
    ]

    operations = [
        migrations.AlterField(
            model_name="dispatchjob",
            name="dispatched_by",
            field=models.BigIntegerField(
                blank=True,
                help_text="The job whose end made the room this one was dispatched into "
                "(negative: the number drawn by a dispatch or an enqueue; empty for a bulk "
                "enqueue's), so that the step, sent again after its reply was lost, "
                "publishes it.",
                null=True,
            ),
        ),
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

from typing import Any

import django.db.models.functions.datetime
from django.db import migrations, models

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "e1e58eb0cbc18af0be19a363f1461161097c8e9a8ce3266b6a67c8a145e50c6f"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # An enqueue stores the number it drew as its receipt, which outlives its job's row
    # and whose key makes a second try wait for the first, instead of keeping it on the row.
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0016_enqueued_by"),
    ]

    operations = [
        migrations.CreateModel(
            name="DispatchReceipt",
            fields=[
                ("drawn", models.BigIntegerField(primary_key=True, serialize=False)),
                (
                    "stored_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "verbose_name": "enqueue receipt",
                "db_table": "fair_jobs_dispatchreceipt",
            },
        ),
        migrations.AlterModelOptions(
            name="dispatchjob",
            options={"verbose_name": "dispatch job"},
        ),
        migrations.RemoveField(
            model_name="dispatchjob",
            name="enqueued_by",
        ),
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

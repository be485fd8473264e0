from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "49c8b303a308866597cba40f60319b71b7c4976869e8c4396cf3ba2bf1e80e08"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # The job's row keeps its message (built at delay()) instead of a signature; the
    # functions that return it are dropped and installed again, the others replaced.
    if schema_editor.connection.vendor != "postgresql":
        return
    # PostgreSQL changes a function's result columns (now job_message) only by dropping
    # it first.
    schema_editor.execute(
        "DROP FUNCTION IF EXISTS fair_jobs_dispatch(text, integer),"
        " fair_jobs_enqueue(text, text, text, text, text, double precision,"
        " timestamp with time zone, double precision, integer, smallint, boolean),"
        " fair_jobs_enqueue_many(text[], text[], text[], text[], text[], double precision[],"
        " timestamp with time zone[], double precision[], integer[], smallint[]),"
        " fair_jobs_dispatch_end(bigint, uuid, text, double precision, boolean, integer),"
        " fair_jobs_dispatch_end_many(bigint[], uuid, integer)"
    )
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0011_dispatch_end_many"),
    ]

    # Rows stored before this migration hold a signature, not a message: it runs on an
    # unreleased schema only (no shipped version stored either), so it is not reversible.
    operations = [
        migrations.RenameField("dispatchjob", "signature", "message"),
        migrations.RunPython(install_functions),
    ]

from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "c7307318ff24d796dba846df6e59206a2e61f652b180cb913b55169837b84e56"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # An enqueue's first try inserts its receipt plainly (a number taken raises instead of
    # leaving the job unstored); only a try sent again looks for an earlier receipt. A new
    # argument (p_again) makes a new signature, so the old one is dropped first.
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP FUNCTION IF EXISTS fair_jobs_enqueue(text, text, text, text, text,"
        " double precision, timestamptz, double precision, integer, smallint, boolean, bigint)"
    )
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0017_enqueue_receipts"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

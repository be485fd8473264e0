# An end whose room goes to its own line says both in one update of the line: the
# dispatch takes the ended line and its count of jobs ended (new arguments, a new
# signature, so the old one is dropped first).
from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "e8da397ab1553beb68b3a38f6c94e6a1f6ce17325cbf347440bce4db03314527"


def install(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS fair_jobs_dispatch(text, integer, bigint)")
    install_functions(apps, schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0024_dispatch_enqueue_reads_vt_once"),
    ]

    operations = [
        migrations.RunPython(install, migrations.RunPython.noop),
    ]

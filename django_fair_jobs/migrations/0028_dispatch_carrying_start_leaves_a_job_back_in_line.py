# A start carrying ends whose job went back to its line after fair_jobs_dispatch_lock_lines
# looked (and took no line) leaves the job there and drops its copy, instead of taking the
# line and then waiting for the ended jobs' lines out of order (a new argument, a new
# signature, so the old one is dropped first).
from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "d458949931189b8943b378c9d735412e7d8617c76ade8e9746a318eb0998364c"


def install(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS fair_jobs_dispatch_start(bigint, uuid)")
    install_functions(apps, schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0027_field_help_texts"),
    ]

    operations = [
        migrations.RunPython(install, migrations.RunPython.noop),
    ]

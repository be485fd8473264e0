# The ended line its caller found first is dispatched into without the selection, which
# locked the index's first line for nothing (a WAL record and a row marked); the line's
# tenant slot is read on its own, once for either way of choosing.
from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "27ebefa9d924b13009d0af34eb8264d47796c04e25074c78cc465f2176ebb9f9"


def install(apps: Any, schema_editor: Any) -> None:
    install_functions(apps, schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0025_dispatch_end_and_next_one_update"),
    ]

    operations = [
        migrations.RunPython(install, migrations.RunPython.noop),
    ]

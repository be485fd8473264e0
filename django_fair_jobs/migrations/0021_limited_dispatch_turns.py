from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "1eda57c12af61e3718f984635c68ce08c8d192f1898bf1f80a1f2b5b4f4ba7ac"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # The dispatches of a queue with a limit take turns (a transaction's advisory lock
    # keyed by the queue), so that two at once never both fill the room the limit leaves.
    # Same signatures: installed in place.
    if schema_editor.connection.vendor != "postgresql":
        return
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0020_start_lines_in_order"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

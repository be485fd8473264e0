from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "b39cdbad14e569996cd51c61c4bf53fe959651a40e18d15cd602ad46d4313a5b"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # A start of a job back in its line that carries ends (or the heartbeat's confirmation
    # of such a start) takes every line it writes in order first: a new function,
    # fair_jobs_dispatch_lock_lines, which the statements call before the start.
    if schema_editor.connection.vendor != "postgresql":
        return
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0019_enqueue_older_leads"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

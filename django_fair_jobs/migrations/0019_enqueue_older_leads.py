from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "79360491566a04a2274cfdd42daa0468406bac67673011ad3a73974b83fb6509"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # An enqueue whose job is older than its line's head (two enqueues of one tenant that
    # commit in the other order than their ids) makes it the head, as the due step and an
    # end that puts a job back do. Same signatures: installed in place.
    if schema_editor.connection.vendor != "postgresql":
        return
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0018_first_receipt_plain"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

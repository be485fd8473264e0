from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "3a1b1990ba27d993f74adb6b4e2ec041d451b0360e65d598fcca859f154ad43f"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # Two fixes of the dispatch protocol, same signatures, so installed in place: a limited
    # queue's room counts the jobs in flight that hold no place (started before their
    # fence, or their place released before their end is flushed); a start carrying ends
    # takes only the rows of the ends still in flight before the lines.
    if schema_editor.connection.vendor != "postgresql":
        return
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0019_dispatch_review_fixes"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

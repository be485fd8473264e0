from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "db981863becfcb7114dea8f462ca4382507a7ae76432d6535ec3254537d20e01"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # The room and the virtual time in PL/pgSQL (their plans kept for the session), and a
    # dispatch that moves a line on in one statement; the signatures are unchanged, so
    # CREATE OR REPLACE installs them over 0009's. Other databases use the ORM store.
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0009_dispatch_lock_order"),
    ]

    # Going back leaves these functions in place: 0009's have the same signatures and
    # the same results, and 0009's own reverse drops them.
    operations = [migrations.RunPython(install_functions, migrations.RunPython.noop)]

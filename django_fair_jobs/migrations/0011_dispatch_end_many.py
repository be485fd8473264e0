from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "0edc10339b19b0f0debf5ffa72ec75a23673a11705a881f5b647b67359bf66f7"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # Adds fair_jobs_dispatch_end_many (a process's ends flushed in one statement); the
    # other functions are installed again unchanged. Other databases use the ORM store.
    install_dispatch_functions(schema_editor)


def drop_end_many(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP FUNCTION IF EXISTS fair_jobs_dispatch_end_many(bigint[], uuid, integer)"
    )


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0010_dispatch_plans_kept"),
    ]

    # Going back drops the one function 0010 did not have; the others are 0010's.
    operations = [migrations.RunPython(install_functions, drop_end_many)]

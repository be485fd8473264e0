from typing import Any

from django.db import migrations

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "942771a8d621fedbc4b7c802c8227163bec8998cd919fda75501403549f3f070"


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

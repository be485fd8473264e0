from typing import Any

from django.db import migrations, models

from django_fair_jobs.sql import install_dispatch_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "c48a191ec7fe77d85770b2247d250312903acd48865cbeee6c101f8b894ff6e4"


def install_functions(apps: Any, schema_editor: Any) -> None:
    # An enqueue keeps the number it drew on its job's row (enqueued_by), so that, sent
    # again after a lost reply, it tells its own row from another with the same task id.
    install_dispatch_functions(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0015_enqueue_sent_again"),
    ]

    operations = [
        migrations.AddField(
            model_name="dispatchjob",
            name="enqueued_by",
            field=models.BigIntegerField(
                blank=True,
                help_text="The negative number drawn by the delay() that stored this job "
                "(empty for a bulk enqueue's or a job stored inside the caller's "
                "transaction), so that its enqueue, sent again after its reply was lost, "
                "finds it whatever its task id.",
                null=True,
            ),
        ),
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

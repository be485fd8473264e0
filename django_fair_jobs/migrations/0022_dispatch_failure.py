# Why a dispatched job ended failed, recorded on its row (failure): explain told a failed
# publish from a worker's rejection of an unregistered task by the count of failed
# publishes, which an outage also raises. fair_jobs_dispatch_end takes the outcome
# 'unregistered' (same signature, installed in place).
from django.db import migrations, models

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "9667df3983173895f9a2ed94560e34b433624da055477445add65ebf478682af"


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0021_dispatch_line_free"),
    ]

    operations = [
        migrations.AddField(
            model_name="dispatchjob",
            name="failure",
            field=models.CharField(
                blank=True,
                choices=[
                    ("", ""),
                    ("publish", "its message could not be published"),
                    ("unregistered", "its task was not registered on the worker"),
                ],
                db_default="",
                help_text="Why it ended failed: 'publish' (its message could not be "
                "published) or 'unregistered' (the worker that received it had no task of "
                "its name).",
                max_length=16,
            ),
        ),
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

# Three fixes of the dispatch protocol, same signatures, so installed in place: an enqueue
# whose job is older than its line's head makes it the head; a start of a job back in its
# line that carries ends takes every line in order first (the new
# fair_jobs_dispatch_lock_lines); the dispatches of a limited queue take turns.
from django.db import migrations

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "1eda57c12af61e3718f984635c68ce08c8d192f1898bf1f80a1f2b5b4f4ba7ac"


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0018_first_receipt_plain"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

# An enqueue reads the queue's virtual time only for a line that was empty (the one that
# re-enters at it), not behind a head; the recount finds a line's oldest waiting job once.
# The functions only (installed in place).
from django.db import migrations

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "28378eff875cd12665ac847ff6fb3b657b4ccad7d7923d1c42ea6aeb97b42c77"


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0023_dispatch_next_by_head"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

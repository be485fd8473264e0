# Two fixes of the dispatch protocol, same signatures, so installed in place: a limited
# queue's room counts the jobs in flight that hold no place (started before their fence,
# or their place released before their end is flushed), each lease once; a start carrying
# ends takes only the rows of the ends still in flight before the lines.
from django.db import migrations

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "3a1b1990ba27d993f74adb6b4e2ec041d451b0360e65d598fcca859f154ad43f"


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0019_dispatch_review_fixes"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

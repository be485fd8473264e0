# One rule for whether a line may be chosen (fair_jobs_dispatch_free), kept by every step
# that moves a line's head other than by a dispatch: a line blocked at its old head's cap
# stayed blocked when its new head's task had another cap (or none), until the next end
# of the tenant's jobs; a tenant's first line under its full tenant slot is made blocked;
# the answers of an end sent again come oldest first. Same signatures, installed in place.
from django.db import migrations

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "23f8b878955434a68c93a5970e7a4a1e1c6347765f60bfd841527b637305c946"


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0020_dispatch_limited_room"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

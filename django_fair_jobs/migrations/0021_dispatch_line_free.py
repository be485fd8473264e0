# One rule for whether a line may be chosen (fair_jobs_dispatch_free), kept by every step
# that moves a line's head other than by a dispatch: a line blocked at its old head's cap
# stayed blocked when its new head's task had another cap (or none), until the next end
# of the tenant's jobs. Same signatures, so installed in place.
from django.db import migrations

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "91a6b84fd92f16eb6a8dfe20a183d7360aeb32695fa807e63db9683b7a40a107"


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0020_dispatch_limited_room"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

# A line is empty when it has no head, whatever its count of jobs waiting says: the
# selection's index takes the lines with a head instead of those whose count is above 0,
# and the steps that join a job to its line make it the head of a line that has none. An
# enqueue behind a line's head then changes no column an index names, so PostgreSQL
# updates the line in place (HOT), with no index entry. The functions name the head, and
# the recount sets right a head that drifted, as it does the counts (installed in place).
import django.db.models.expressions
import django.db.models.functions.math
from django.db import migrations, models

from django_fair_jobs.sql import install_functions

# The digest of the functions block this migration installs (tests/dispatch/test_functions.py).
FUNCTIONS_DIGEST = "7462e13b9c066d3f523441562551497157653f805f6c7b37c4f505c6d10af8e6"


class Migration(migrations.Migration):
    dependencies = [
        ("fair_jobs", "0022_dispatch_failure"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="dispatchtenant",
            name="fair_jobs_dispatch_next",
        ),
        migrations.AddIndex(
            model_name="dispatchtenant",
            index=models.Index(
                models.F("queue"),
                django.db.models.functions.math.Floor(
                    django.db.models.expressions.CombinedExpression(
                        models.F("in_flight"), "/", models.F("weight")
                    )
                ),
                models.F("pass_value"),
                models.F("head_id"),
                condition=models.Q(("blocked", False), ("head_id__isnull", False)),
                name="fair_jobs_dispatch_next",
            ),
        ),
        migrations.RunPython(install_functions, migrations.RunPython.noop),
    ]

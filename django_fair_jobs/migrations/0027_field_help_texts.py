# Field help texts that say what the code does (no schema change): a tenant slot's empty
# max_jobs under fair dispatch, the limit a rerouted job brings, deferrals that postpone,
# and the limit history's maintenance source.

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('fair_jobs', '0026_dispatch_ended_line_chosen_without_selection'),
    ]

    operations = [
        migrations.AlterField(
            model_name='limitchange',
            name='source',
            field=models.CharField(help_text='admin, command, python or maintenance (a boost that ended).', max_length=32),
        ),
        migrations.AlterField(
            model_name='queuelimit',
            name='deferred_total',
            field=models.PositiveBigIntegerField(default=0, editable=False, help_text='Jobs ever deferred (parked or postponed) because the queue was at a limit.'),
        ),
        migrations.AlterField(
            model_name='tenantqueueslot',
            name='default_max_jobs',
            field=models.PositiveIntegerField(default=1, editable=False, help_text="The limit the last acquiring job brought (a rerouting rule's max_jobs for a job it rerouted, else its task's fair_max_jobs, else the default setting); used when max_jobs is empty."),
        ),
        migrations.AlterField(
            model_name='tenantqueueslot',
            name='max_jobs',
            field=models.PositiveIntegerField(blank=True, help_text="Override of the task's limit for this tenant. Empty: the task's fair_max_jobs (without one: FAIR_JOBS_DEFAULT_MAX_JOBS on tenant slots, no cap under fair dispatch). 0 pauses the tenant on this queue.", null=True, validators=[django.core.validators.MinValueValidator(0)]),
        ),
    ]

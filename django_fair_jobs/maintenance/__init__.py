"""What keeps the rows true while workers come and go (layer 6): each worker process's
threads (:mod:`~django_fair_jobs.maintenance.threads`: heartbeat, maintenance loop, due
poll), the maintenance pass they run (:mod:`~django_fair_jobs.maintenance.passes`: each
room's upkeep, once per interval across the cluster) and the rows that pace it
(:mod:`~django_fair_jobs.maintenance.store`).

The worker signals start and stop the threads (:func:`start_process`, :func:`shutdown`);
``manage.py fair_jobs_reap`` and the admin run a pass by hand (:func:`run_maintenance`).
"""

from __future__ import annotations

from django_fair_jobs.maintenance.passes import MaintenanceReport as MaintenanceReport
from django_fair_jobs.maintenance.passes import (
    dispatch_into_new_capacity as dispatch_into_new_capacity,
)
from django_fair_jobs.maintenance.passes import maybe_run_maintenance as maybe_run_maintenance
from django_fair_jobs.maintenance.passes import run_maintenance as run_maintenance
from django_fair_jobs.maintenance.store import claim_maintenance as claim_maintenance
from django_fair_jobs.maintenance.store import count_reaped as count_reaped
from django_fair_jobs.maintenance.threads import dispatch_due as dispatch_due
from django_fair_jobs.maintenance.threads import shutdown as shutdown
from django_fair_jobs.maintenance.threads import start_process as start_process

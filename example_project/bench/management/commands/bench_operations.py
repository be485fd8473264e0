"""``manage.py bench_operations``: what the operations views cost as the data grows.

Needs the database only. Two figures, each a ratio of a large case to a small one in the
same run (1.00x: the cost does not grow with the data):

1. **Dashboard**: one :func:`django_fair_jobs.status.snapshot` (the dashboard's, the
   status command's and the exporter's read) per active tenant, at 100 and at 10,000
   tenants, each with a parked job.
2. **Explain**: one :func:`django_fair_jobs.explain` of the last job parked on a slot, with
   10 and with 100,000 jobs parked ahead of it (its place in line is a count on an index).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connection

from bench.timing import median_seconds
from django_fair_jobs import explain
from django_fair_jobs.models import ParkedJob, TenantQueueSlot
from django_fair_jobs.status import snapshot


def _fill(tenants: int, parked_per_first: int) -> str:
    """Fresh rows: ``tenants`` slots with one parked job each, and ``parked_per_first``
    parked on the first slot; returns the task id of the first slot's last parked job."""
    ParkedJob.objects.all().delete()
    TenantQueueSlot.objects.all().delete()
    slots = TenantQueueSlot.objects.bulk_create(
        [TenantQueueSlot(tenant=f"t{i:05d}", queue="bench.ops", max_jobs=1, current_jobs=0,
                         parked_jobs=1) for i in range(tenants)],
        batch_size=5000,
    )  # fmt: skip
    rows = [ParkedJob(slot=s, task_id=f"p-{s.pk}", task_name="bench", signature="{}",
                      default_max_jobs=1) for s in slots]  # fmt: skip
    rows += [ParkedJob(slot=slots[0], task_id=f"q-{i}", task_name="bench", signature="{}",
                       default_max_jobs=1) for i in range(parked_per_first)]  # fmt: skip
    ParkedJob.objects.bulk_create(rows, batch_size=5000)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE fair_jobs_parkedjob; ANALYZE fair_jobs_tenantqueueslot")
    return f"q-{parked_per_first - 1}"


class Command(BaseCommand):
    help = "Measure the dashboard's and explain's cost against the data's size (ratios)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--repeat", type=int, default=5, help="Timed calls per case.")

    def handle(self, *args: Any, **options: Any) -> None:
        repeat = options["repeat"]
        if TenantQueueSlot.objects.exists() or ParkedJob.objects.exists():
            self.stderr.write("This replaces every slot and parked row: use a bench database.")
        try:
            per_tenant = {}
            for tenants in (100, 10_000):
                _fill(tenants, 1)
                seconds = median_seconds(snapshot, repeat)
                per_tenant[tenants] = seconds / tenants
                self.stdout.write(
                    f"Dashboard snapshot, {tenants} tenants: {seconds * 1e3:.1f} ms "
                    f"({per_tenant[tenants] * 1e6:.0f} us per tenant)"
                )
            self.stdout.write(
                f"Dashboard per tenant, 10,000 vs 100 tenants: "
                f"{per_tenant[10_000] / per_tenant[100]:.2f}x"
            )
            explained = {}
            for ahead in (10, 100_000):
                last = _fill(100, ahead)
                state = explain(last)
                assert state.state == "parked", state
                explained[ahead] = median_seconds(lambda last=last: explain(last), repeat)  # type: ignore[misc]
                self.stdout.write(
                    f"Explain a parked job, {ahead} ahead: {explained[ahead] * 1e3:.2f} ms"
                )
            self.stdout.write(
                f"Explain, 100,000 vs 10 ahead: {explained[100_000] / explained[10]:.2f}x"
            )
        finally:
            ParkedJob.objects.all().delete()
            TenantQueueSlot.objects.all().delete()

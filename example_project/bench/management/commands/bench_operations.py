"""``manage.py bench_operations``: what the operations views cost as the data grows.

Needs the database only. Two figures, each a ratio of a large case to a small one in the
same run (1.00x: the cost does not grow with the data):

1. **Dashboard**: one :func:`django_fair_jobs.status.snapshot` (the dashboard's, the
   status command's and the exporter's read) per active tenant, at 100 and at 10,000
   tenants, each with a parked job.
2. **Explain**: one :func:`django_fair_jobs.explain` of the last job parked on a slot, with
   10 and with 100,000 jobs parked ahead of it (its place in line is a count on an index).

And one absolute figure against the target of 0.2 s each: **at scale**, 10,000 tenants
with 100,000 jobs waiting (5 parked and 5 in fair dispatch's line per tenant), the admin
dashboard's view (rendered, as a superuser) and one metrics scrape.
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


def _fill_scale(tenants: int, per_tenant: int) -> None:
    """``tenants`` slots with ``per_tenant`` parked jobs each, and as many jobs waiting in
    each tenant's fair dispatch line."""
    from django_fair_jobs.dispatch.models import WAITING, DispatchJob, DispatchTenant

    _fill(0, 0)
    DispatchJob.objects.all().delete()
    DispatchTenant.objects.all().delete()
    slots = TenantQueueSlot.objects.bulk_create(
        [TenantQueueSlot(tenant=f"t{i:05d}", queue="bench.ops", max_jobs=1, current_jobs=1,
                         parked_jobs=per_tenant) for i in range(tenants)],
        batch_size=5000,
    )  # fmt: skip
    ParkedJob.objects.bulk_create(
        [ParkedJob(slot=s, task_id=f"p-{s.pk}-{n}", task_name="bench", signature="{}",
                   default_max_jobs=1) for s in slots for n in range(per_tenant)],
        batch_size=5000,
    )  # fmt: skip
    jobs = DispatchJob.objects.bulk_create(
        [DispatchJob(queue="bench.lines", tenant=f"t{i:05d}", task_name="bench",
                     task_id=f"d-{i}-{n}", message="{}", state=WAITING)
         for i in range(tenants) for n in range(per_tenant)],
        batch_size=5000,
    )  # fmt: skip
    heads: dict[str, int] = {}
    for job in jobs:
        heads.setdefault(job.tenant, job.pk)
    DispatchTenant.objects.bulk_create(
        [DispatchTenant(queue="bench.lines", tenant=t, waiting=per_tenant, head_id=h)
         for t, h in heads.items()],
        batch_size=5000,
    )  # fmt: skip
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")


def _at_scale(repeat: int) -> tuple[float, float]:
    """Seconds of one dashboard view and of one metrics scrape (medians)."""
    from django.contrib.auth.models import User
    from django.test import RequestFactory
    from prometheus_client import CollectorRegistry, generate_latest

    from django_fair_jobs.admin import DashboardAdmin
    from django_fair_jobs.metrics import FairJobsCollector
    from django_fair_jobs.models import Dashboard

    user = User(username="bench", is_staff=True, is_superuser=True, is_active=True)
    request = RequestFactory().get("/admin/fair_jobs/dashboard/")
    request.user = user
    from django.contrib import admin

    view = DashboardAdmin(Dashboard, admin.site)

    def dashboard() -> None:
        view.changelist_view(request).render()

    registry = CollectorRegistry()
    registry.register(FairJobsCollector())
    return median_seconds(dashboard, repeat), median_seconds(
        lambda: generate_latest(registry), repeat
    )


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
            _fill_scale(10_000, 5)
            view, scrape = _at_scale(repeat)
            self.stdout.write(
                f"At scale (10,000 tenants, 100,000 jobs waiting): dashboard view "
                f"{view:.3f} s, metrics scrape {scrape:.3f} s (target: 0.2 s each)"
            )
        finally:
            from django_fair_jobs.dispatch.models import DispatchJob, DispatchTenant

            ParkedJob.objects.all().delete()
            TenantQueueSlot.objects.all().delete()
            DispatchJob.objects.all().delete()
            DispatchTenant.objects.all().delete()
            from bench.runner import vacuum_library_tables

            vacuum_library_tables()  # the fairness benchmark shares this database

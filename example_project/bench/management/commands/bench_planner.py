"""``manage.py bench_planner``: what the fair planner costs, measured in one run.

Needs the database and the broker (the same services as ``fairbench``). Two figures:

1. **Enqueue**: publishes per second of a planned task (stored in its tenant's virtual
   queue) against a plain task published to a broker queue, in interleaved rounds; the
   ratio is the figure.
2. **Promotion**: the database time per promoted job when one planner run promotes
   10,000 jobs across 1,000 tenants (the broker publish is left out: it is the same for
   every job, planned or not).
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from bench.runner import BenchError, check_services, delete_queue
from django_fair_jobs import FairTask, planner
from django_fair_jobs.models import PlannedJob, PlannerRun, PlannerTenant
from example.celery import app


class Command(BaseCommand):
    help = "Measure the planner's enqueue and promotion cost, as ratios within one run."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--jobs", type=int, default=1000, help="Publishes per round.")
        parser.add_argument("--rounds", type=int, default=3, help="Interleaved rounds.")
        parser.add_argument("--promote", type=int, default=10_000, help="Jobs to promote.")
        parser.add_argument("--tenants", type=int, default=1000, help="Tenants they belong to.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            check_services()
        except BenchError as exc:
            raise CommandError(str(exc)) from None
        task = app.tasks["bench.planner_job"]
        assert isinstance(task, FairTask)
        plain = app.tasks["bench.plain_job"]
        queue = f"bench.planner-cost.{uuid.uuid4().hex[:8]}"
        plan = {"enqueue_interval": 3600, "enqueue_jobs": options["promote"],
                "latency_threshold": 3600}  # fmt: skip
        setattr(task, "fair_plan", plan)  # noqa: B010
        n = options["jobs"]
        kwargs = {"run": "cost", "mode": "cost", "job": 0, "tenant": "t", "enqueued_at": 0.0,
                  "seconds": 0.0, "kind": "sleep"}  # fmt: skip
        try:
            rates: dict[str, list[float]] = {"planned": [], "plain": []}
            for _ in range(options["rounds"]):
                for name, target in (("plain", plain), ("planned", task)):
                    started = time.perf_counter()
                    for i in range(n):
                        target.apply_async(kwargs={**kwargs, "tenant": f"t{i % 50}"}, queue=queue)
                    rates[name].append(n / (time.perf_counter() - started))
                PlannedJob.objects.all().delete()
            planned_rate = statistics.median(rates["planned"])
            plain_rate = statistics.median(rates["plain"])
            self.stdout.write(
                f"Enqueue: planned {planned_rate:.0f}/s, plain publish {plain_rate:.0f}/s: "
                f"{planned_rate / plain_rate:.2f}x"
            )
            total, tenants = options["promote"], options["tenants"]
            task.bulk_enqueue(
                [((), {**kwargs, "tenant": f"t{i % tenants}"}) for i in range(total)],
                queue=queue,
            )
            original = planner._publish
            setattr(planner, "_publish", lambda app, row: None)  # noqa: B010  (database time only)
            try:
                started = time.perf_counter()
                report = planner.run(task, due_only=False)
                elapsed = time.perf_counter() - started
            finally:
                setattr(planner, "_publish", original)  # noqa: B010
            if report is None or report.promoted != total:
                raise CommandError(f"expected {total} promotions, got {report}")
            self.stdout.write(
                f"Promotion: {total} jobs across {len(report.counts)} tenants in one run, "
                f"{elapsed:.2f} s of database time: {elapsed / total * 1e6:.0f} us per job."
            )
        finally:
            PlannedJob.objects.all().delete()
            PlannerTenant.objects.all().delete()
            PlannerRun.objects.all().delete()
            delete_queue(queue)

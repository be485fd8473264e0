"""``manage.py bench_dispatch``: what choosing the next job costs as the lines grow.

Needs PostgreSQL only (no broker: nothing is published). For each case it fills fair
dispatch's tables in SQL (``INSERT ... SELECT generate_series``) with one queue and its
tenants' lines, then measures, through the library's own statements, cycles of the two a
job pays at the moment a worker frees:

1. **dispatch**: ``fair_jobs_dispatch(queue, 1)`` chooses the next job (the selection rule
   in index order) and marks it dispatched;
2. **end**: ``fair_jobs_dispatch_end`` takes it out of flight again. So that the lines keep
   their length through the cycles, the job goes back to its line instead of being deleted
   (the same rows are written either way).

The cases: **small**, 10 tenants and 100 jobs waiting; **large** (the defaults; ``--tenants``
and ``--jobs`` change it), 10,000 tenants and 100,000 jobs waiting. It prints each case's
median per cycle (over ``--cycles`` cycles, after a warm-up), the ratio large / small
(1.00x: the choice costs the same however many wait), and the plan of the selection. The
tables are truncated before each case and at the end, so use a database of its own.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

QUEUE = "bench.dispatch"

TABLES = ("fair_jobs_dispatchjob", "fair_jobs_dispatchtenant", "fair_jobs_dispatchqueue")

FILL = (
    # Room for one job at a time: every cycle dispatches exactly one.
    "INSERT INTO fair_jobs_dispatchqueue (queue, capacity, slack, nodes, updated_at) "
    "VALUES (%(queue)s, 1, 0, 1, now())",
    "INSERT INTO fair_jobs_dispatchjob (queue, tenant, task_name, task_id, message, state, "
    "enqueued_at, publish_failures, republished, on_loss) "
    "SELECT %(queue)s, 'tenant-' || (i %% %(tenants)s), 'bench.dispatch_job', "
    "md5(i::text), '{}', 1, now(), 0, 0, 0 FROM generate_series(1, %(jobs)s) AS i",
    "INSERT INTO fair_jobs_dispatchtenant (queue, tenant, weight, cap, waiting, in_flight, "
    "pass_value, served_pass, head_id, dispatched_total, blocked) "
    "SELECT %(queue)s, tenant, 1.0, NULL, count(*), 0, 0, 0, min(id), 0, false "
    "FROM fair_jobs_dispatchjob GROUP BY tenant",
)

DISPATCH = "SELECT job_id FROM fair_jobs_dispatch(%s, 1)"
END = "SELECT count(*) FROM fair_jobs_dispatch_end(%s, NULL, 'back', 0, false, 0)"
PLAN = (
    "EXPLAIN SELECT t.id FROM fair_jobs_dispatchtenant AS t "
    "WHERE t.queue = %s AND t.head_id IS NOT NULL AND NOT t.blocked "
    "ORDER BY floor(t.in_flight / t.weight), t.pass_value, t.head_id "
    "LIMIT 1 FOR UPDATE SKIP LOCKED"
)


class Command(BaseCommand):
    """Time fair dispatch's choice of the next job with short and with long lines."""

    help = (
        "What choosing the next job costs with 10 tenants / 100 jobs waiting against "
        "10,000 / 100,000 (PostgreSQL; truncates the dispatch tables)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenants", type=int, default=10_000, help="Large case's tenants.")
        parser.add_argument("--jobs", type=int, default=100_000, help="Large case's jobs.")
        parser.add_argument(
            "--cycles", type=int, default=2000, help="Dispatch + end cycles per case."
        )
        parser.add_argument(
            "--replace", action="store_true", help="Truncate the tables even if they hold rows."
        )
        parser.add_argument("--json", type=Path, help="Write the figures to this file.")

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("bench_dispatch needs PostgreSQL: set DATABASE_URL=postgres://...")
        tenants, jobs, cycles = options["tenants"], options["jobs"], options["cycles"]
        if min(tenants, jobs, cycles) < 1 or jobs < tenants:
            raise CommandError("--tenants, --jobs and --cycles must be >= 1, --jobs >= --tenants.")
        call_command("migrate", verbosity=0)
        if not options["replace"] and any(self._count(t) for t in TABLES):
            raise CommandError(
                "The dispatch tables hold rows, and this command truncates them: use a "
                "database of its own, or pass --replace."
            )
        cases = {"small": (min(10, tenants), min(100, jobs)), "large": (tenants, jobs)}
        figures: dict[str, Any] = {}
        try:
            for name, (n_tenants, n_jobs) in cases.items():
                figures[name] = self._case(n_tenants, n_jobs, cycles)
        finally:
            self._truncate()
        figures["ratio"] = figures["large"]["median_us"] / figures["small"]["median_us"]
        self.stdout.write("| case | tenants | jobs waiting | dispatch + end, median | plan |")
        self.stdout.write("|---|---|---|---|---|")
        for name in cases:
            f = figures[name]
            self.stdout.write(
                f"| {name} | {f['tenants']:,} | {f['jobs']:,} | {f['median_us']:.0f} us "
                f"| {'index order' if f['plan_index'] else 'SCAN OR SORT'} |"
            )
        self.stdout.write(f"Large / small: {figures['ratio']:.2f}x")
        if options["json"]:
            options["json"].write_text(json.dumps(figures, indent=2) + "\n")

    def _count(self, table: str) -> int:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {table}")
            return int(cursor.fetchone()[0])

    def _truncate(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "TRUNCATE fair_jobs_dispatchjob, fair_jobs_dispatchtenant, "
                "fair_jobs_dispatchqueue RESTART IDENTITY"
            )

    def _case(self, tenants: int, jobs: int, cycles: int) -> dict[str, Any]:
        self._truncate()
        with connection.cursor() as cursor:
            for statement in FILL:
                cursor.execute(statement, {"queue": QUEUE, "tenants": tenants, "jobs": jobs})
            # As autovacuum would have by then: plans fit the data.
            cursor.execute(
                "ANALYZE fair_jobs_dispatchjob, fair_jobs_dispatchtenant, fair_jobs_dispatchqueue"
            )
            cursor.execute(PLAN, [QUEUE])
            plan = "\n".join(row[0] for row in cursor.fetchall())
            times = []
            warm_up = min(200, cycles)
            for i in range(warm_up + cycles):
                started = time.perf_counter()
                cursor.execute(DISPATCH, [QUEUE])
                row = cursor.fetchone()
                if row is None:
                    raise CommandError("Nothing was dispatched: the lines are empty.")
                cursor.execute(END, [row[0]])
                if i >= warm_up:
                    times.append(time.perf_counter() - started)
            cursor.execute(
                "SELECT sum(waiting), sum(in_flight) FROM fair_jobs_dispatchtenant "
                "WHERE queue = %s",
                [QUEUE],
            )
            waiting, in_flight = cursor.fetchone()
        if (waiting, in_flight) != (jobs, 0):
            raise CommandError(f"The lines changed: {waiting} waiting, {in_flight} in flight.")
        return {
            "tenants": tenants,
            "jobs": jobs,
            "median_us": statistics.median(times) * 1e6,
            "plan_index": "fair_jobs_dispatch_next" in plan and "Sort" not in plan,
        }

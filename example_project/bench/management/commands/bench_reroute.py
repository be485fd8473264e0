"""``manage.py bench_reroute``: what rerouting rules cost a publisher, measured in one run.

Needs PostgreSQL and the broker (the same services as ``fairbench``). Two figures, each
a ratio of two rates measured side by side in interleaved rounds:

1. Publish throughput (``apply_async`` to a real broker queue) of one FairTask with two
   rerouting rules against the same task without rules.
2. The cost of an enqueue whose tenant already has 100,000 enqueues in its window against
   one with 100: the counting statement alone, and the whole publish. The windows are
   filled in SQL with the rows that many recorded enqueues leave (spread evenly over the
   last day), and the command checks that the count sees every one of them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from bench.runner import BenchError, check_services, delete_queue
from django_fair_jobs.models import JobDecision, RerouteCount, TenantWindow, WindowBucket
from django_fair_jobs.reroute import store as reroute_store
from example.celery import app

TASK = "bench.reroute_job"
KEY = f"task:{TASK}"

FILL = """
WITH w AS (
    INSERT INTO fair_jobs_tenantwindow (key, tenant, total, last_second, created_at)
    VALUES (%(key)s, %(tenant)s, %(n)s, %(now)s - 1, now())
    RETURNING id
)
INSERT INTO fair_jobs_windowbucket (window_id, second, cum)
SELECT w.id, s.second, s.cum
  FROM w, (SELECT %(now)s - %(span)s + (i::bigint * %(span)s / %(n)s) AS second, max(i) AS cum
             FROM generate_series(1, %(n)s) AS i GROUP BY 1) AS s
"""


class Command(BaseCommand):
    help = "Measure what rerouting rules cost at publish, as ratios within one run."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--jobs", type=int, default=1000, help="Publishes per round.")
        parser.add_argument("--rounds", type=int, default=5, help="Interleaved rounds.")
        parser.add_argument(
            "--big", type=int, default=100_000, help="Enqueues in the large window."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("bench_reroute needs PostgreSQL: set DATABASE_URL=postgres://...")
        try:
            check_services()
        except BenchError as exc:
            raise CommandError(str(exc)) from None
        call_command("migrate", verbosity=0)
        jobs, rounds, big = options["jobs"], options["rounds"], options["big"]
        queue = f"bench.reroute-cost.{uuid.uuid4().hex[:8]}"
        task = app.tasks[TASK]
        rules = [
            {"queue": f"{queue}.slow", "threshold": 1000, "per": 86_400},
            {"queue": f"{queue}.slow", "threshold": 20, "per": 60},
        ]
        setattr(task, "queue", queue)  # noqa: B010  (the declared queue: counted)
        self._reset()
        try:
            self.stdout.write(f"{rounds} rounds of {jobs} publishes to {queue}")
            without, with_rules = self._compare(
                rounds,
                lambda i: self._publish(task, None, f"plain-{i}", jobs, queue),
                lambda i: self._publish(task, rules, f"ruled-{i}", jobs, queue),
            )
            self._report("publish with 2 rules vs without", with_rules, without)

            small, large = "w100", f"w{big}"
            self._fill(small, 100)
            self._fill(large, big)
            windows = [(86_400, 10**9, "slow"), (3_600, 10**9, "slower")]
            record_small, record_large = self._compare(
                rounds,
                lambda i: self._record(small, windows, jobs * 3),
                lambda i: self._record(large, windows, jobs * 3),
            )
            self._report(
                f"counting statement, {big:,} vs 100 in the window", record_large, record_small
            )
            publish_small, publish_large = self._compare(
                rounds,
                lambda i: self._publish(task, rules, small, jobs, queue),
                lambda i: self._publish(task, rules, large, jobs, queue),
            )
            self._report(
                f"whole publish, {big:,} vs 100 in the window", publish_large, publish_small
            )
        finally:
            setattr(task, "fair_reroute", None)  # noqa: B010
            for name in (queue, f"{queue}.slow"):
                delete_queue(name)
            self._reset()

    def _reset(self) -> None:
        WindowBucket.objects.all().delete()
        TenantWindow.objects.all().delete()
        RerouteCount.objects.all().delete()
        JobDecision.objects.filter(mechanism="reroute", task_name=TASK).delete()

    def _compare(
        self, rounds: int, first: Callable[[int], float], second: Callable[[int], float]
    ) -> tuple[list[float], list[float]]:
        """Run both ``rounds`` times, alternating which goes first; return their rates."""
        a: list[float] = []
        b: list[float] = []
        for i in range(rounds):
            if i % 2:
                b.append(second(i))
                a.append(first(i))
            else:
                a.append(first(i))
                b.append(second(i))
        return a, b

    def _report(self, label: str, measured: list[float], reference: list[float]) -> None:
        ratios = sorted(m / r for m, r in zip(measured, reference, strict=True))
        median = ratios[len(ratios) // 2]
        self.stdout.write(
            f"{label}: {median:.2f}x (median of {len(ratios)} rounds; "
            f"{sum(measured) / len(measured):,.0f} vs {sum(reference) / len(reference):,.0f}/s; "
            f"ratios {', '.join(f'{r:.2f}' for r in ratios)})"
        )

    def _publish(self, task: Any, rules: Any, tenant: str, jobs: int, queue: str) -> float:
        setattr(task, "fair_reroute", rules)  # noqa: B010
        kwargs = {
            "run": "cost", "mode": "cost", "job": 0, "tenant": tenant,
            "enqueued_at": 0.0, "seconds": 0.0, "kind": "sleep",
        }  # fmt: skip
        started = time.perf_counter()
        for _ in range(jobs):
            task.apply_async(kwargs=kwargs, queue=queue)
        return jobs / (time.perf_counter() - started)

    def _fill(self, tenant: str, events: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT floor(extract(epoch FROM now()))::bigint")
            now = int(cursor.fetchone()[0])
            cursor.execute(
                FILL, {"key": KEY, "tenant": tenant, "n": events, "now": now, "span": 86_000}
            )
        # The count must see every one of them, or the comparison means nothing.
        seen = reroute_store.record(
            key=KEY, tenant=tenant, task_name=TASK, rules=[(86_400, 10**9, "x")]
        ).counts[0]
        if seen != events + 1:
            raise CommandError(f"filled {events} enqueues for {tenant} but counted {seen - 1}")

    def _record(self, tenant: str, windows: list[tuple[int, int, str]], n: int) -> float:
        record = reroute_store.record
        started = time.perf_counter()
        for _ in range(n):
            record(key=KEY, tenant=tenant, task_name=TASK, rules=windows)
        return n / (time.perf_counter() - started)

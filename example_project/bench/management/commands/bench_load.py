"""``manage.py bench_load``: what the library's operations cost when its tables are large.

Needs PostgreSQL only (no broker: nothing is published). It fills the library's tables twice,
in SQL (``INSERT ... SELECT generate_series``), with rows shaped as the library leaves them,
and measures the same operations in both, through the library's own functions:

* a **small** case: 10 tenants, 1,000 rows of window data, 100 parked and 100 pending jobs;
* a **large** case (the defaults; ``--tenants``, ``--window-rows`` and ``--jobs`` scale it
  down): 10,000 tenants, each with a tenant slot held by a running job (10,000 leases),
  1,000,000 window buckets, 100,000 parked jobs and 100,000 planned jobs pending.

Every tenant has a rerouting window; nine in ten are idle (their last enqueue older than
``FAIR_JOBS_REROUTE_MAX_WINDOW``), the others have buckets spread over twice the
maximum window. Figures, each a median over ``--repeat`` calls, and the ratio large / small
(1.00x: the cost does not grow with the data):

1. acquire + release of a tenant slot (the manager's statements, one tenant after another);
2. park + wake: park a job on a full slot, release the holder, wake the job, start it;
3. an enqueue counted by two rerouting rules (the window statement) on an active window;
4. a planned enqueue (the row in the tenant's virtual queue);
5. one planner run promoting a batch (``--batch``) of jobs; the broker publish is left out
   (it is the same for every job, planned or not), so this is the database's part;
6. the admin changelist of every fair_jobs model, rendered through ``django.test.Client`` as
   a superuser: time, queries, and the rows shown against ``list_per_page``;
7. one maintenance pass (``run_maintenance``), and pruning (``windows.prune``): window rows
   before and after, which must be bounded by the active windows whatever the idle data.

The tables are truncated before each case and at the end, so use a database of its own.
``--json PATH`` writes every figure.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import cycle
from pathlib import Path
from typing import Any

from django.apps import apps
from django.conf import settings
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, reset_queries
from django.test import Client
from django.test.utils import CaptureQueriesContext, override_settings
from django.urls import reverse
from kombu.utils.json import dumps

from bench.tasks import planner_job
from bench.timing import median_seconds
from django_fair_jobs import identity, planner
from django_fair_jobs.admin import DASHBOARD_TENANTS
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.leases.types import Grant
from django_fair_jobs.maintenance import run_maintenance
from django_fair_jobs.models import (
    PlannedJob,
    SlotLease,
    TenantWindow,
    WindowBucket,
)
from django_fair_jobs.reroute import prune
from django_fair_jobs.reroute import store as reroute_store
from django_fair_jobs.slots import store as slot_store

QUEUE = "bench.load"
SLOTS_TASK = "bench.slots_job"
REROUTE_TASK = "bench.reroute_job"
PLANNED_TASK = "bench.planner_job"
WINDOW_KEY = f"task:{REROUTE_TASK}"
RULES = [(86_400, 10**9, f"{QUEUE}.slow"), (3_600, 10**9, f"{QUEUE}.slower")]
"""Two rules that never match: the count is what is measured, not a reroute."""

SMALL = {"tenants": 10, "window_rows": 1_000, "jobs": 100}
IDLE_EVERY = 10
"""One window in ``IDLE_EVERY`` is active; the others are idle and pruned whole."""

KWARGS = {"run": "load", "mode": "load", "job": 0, "enqueued_at": 0.0, "seconds": 0.0,
          "kind": "sleep"}  # fmt: skip


def _signature(task: str, task_id: str) -> str:
    """What a parked or planned row stores: the job's Celery signature in kombu's JSON,
    with ``task_id`` as a placeholder that the fill replaces per row."""
    kwargs = {**KWARGS, "tenant": "tenant-000000"}
    options = {"task_id": task_id, "queue": QUEUE, "headers": {"fair_deferrals": 1}}
    sig: dict[str, Any] = {"task": task, "args": [], "kwargs": kwargs, "options": options,
           "subtask_type": None, "immutable": False}  # fmt: skip
    return dumps(sig)


TENANT = "'tenant-' || lpad(({})::text, 6, '0')"

FILL = [
    # Tenant slots, each held by one running job of a live process (limit 1), so the jobs
    # parked on them wait as they would in production.
    f"""
    INSERT INTO fair_jobs_tenantqueueslot
           (tenant, queue, max_jobs, default_max_jobs, current_jobs, parked_jobs,
            deferred_total, created_at, updated_at)
    SELECT {TENANT.format("i")}, %(queue)s, NULL, 1, 1, 0, 0, now(), now()
      FROM generate_series(1, %(tenants)s) AS i
    """,
    """
    INSERT INTO fair_jobs_slotlease (slot_id, task_id, token, process_id, acquired_at)
    SELECT id, 'running-' || id, gen_random_uuid(), %(process_id)s, now()
      FROM fair_jobs_tenantqueueslot
    """,
    # Parked jobs, round-robin over the tenants, oldest first.
    """
    INSERT INTO fair_jobs_parkedjob
           (slot_id, task_id, task_name, signature, default_max_jobs, parked_at, wake_count)
    SELECT s.first + i %% %(tenants)s, 'parked-' || i, %(slots_task)s,
           replace(%(parked_signature)s, '__ID__', 'parked-' || i), 1,
           now() - make_interval(secs => (%(jobs)s - i) * 0.001), 0
      FROM generate_series(0, %(jobs)s - 1) AS i,
           (SELECT min(id) AS first FROM fair_jobs_tenantqueueslot) AS s
    """,
    """
    UPDATE fair_jobs_tenantqueueslot AS s SET parked_jobs = p.n, deferred_total = p.n
      FROM (SELECT slot_id, count(*) AS n FROM fair_jobs_parkedjob GROUP BY slot_id) AS p
     WHERE s.id = p.slot_id
    """,
    # Rerouting windows: one per tenant; every IDLE_EVERY-th is active (its last enqueue a
    # second ago), the others idle for twice the maximum window. Each has the same number
    # of buckets (cum: the running total), spread over twice the maximum window.
    f"""
    INSERT INTO fair_jobs_tenantwindow (key, tenant, total, last_second, created_at)
    SELECT %(key)s, {TENANT.format("i")}, %(buckets)s * 10,
           CASE WHEN i %% %(idle_every)s = 0 THEN %(now)s - 1
                ELSE %(now)s - 1 - 2 * %(max_window)s END,
           now()
      FROM generate_series(1, %(tenants)s) AS i
    """,
    """
    INSERT INTO fair_jobs_windowbucket (window_id, second, cum)
    SELECT w.id, w.last_second - (%(buckets)s - j) * %(step)s, j * 10
      FROM fair_jobs_tenantwindow AS w, generate_series(1, %(buckets)s) AS j
    """,
    f"""
    INSERT INTO fair_jobs_reroutecount (tenant, task_name, queue, total, first_at, last_at)
    SELECT {TENANT.format("i")}, %(reroute_task)s, %(queue)s || '.slow', 1,
           now() - interval '3 days',
           CASE WHEN i %% %(idle_every)s = 0 THEN now()
                ELSE now() - make_interval(secs => 2 * %(max_window)s) END
      FROM generate_series(1, %(tenants)s) AS i
    """,
    # The planner's virtual queues: pending jobs round-robin over the tenants, and each
    # tenant's standing (as after earlier runs).
    f"""
    INSERT INTO fair_jobs_plannedjob
           (task_name, tenant, queue, task_id, signature, enqueued_at)
    SELECT %(planned_task)s, {TENANT.format("1 + i %% %(tenants)s")}, %(queue)s,
           'planned-' || i, replace(%(planned_signature)s, '__ID__', 'planned-' || i),
           now() - make_interval(secs => (%(jobs)s - i) * 0.001)
      FROM generate_series(0, %(jobs)s - 1) AS i
    """,
    f"""
    INSERT INTO fair_jobs_plannertenant (task_name, tenant, pass_value, paused, promoted_total)
    SELECT %(planned_task)s, {TENANT.format("i")}, 0, false, 0
      FROM generate_series(1, %(tenants)s) AS i
    """,
    # Fair dispatch's lines, one per tenant (their admin page lists them).
    f"""
    INSERT INTO fair_jobs_dispatchtenant
           (queue, tenant, weight, cap, waiting, in_flight, pass_value, served_pass,
            head_id, dispatched_total, blocked)
    SELECT %(queue)s, {TENANT.format("i")}, 1, NULL, 0, 0, 0, 0, NULL, 0, false
      FROM generate_series(1, %(tenants)s) AS i
    """,
    # A waiting job per tenant (the dispatched jobs' admin page lists them).
    f"""
    INSERT INTO fair_jobs_dispatchjob
           (queue, tenant, task_name, task_id, message, state, enqueued_at,
            publish_failures, republished, on_loss)
    SELECT %(queue)s, {TENANT.format("i")}, 'load.dispatched', 'disp-' || i, '{{}}', 1, now(),
           0, 0, 0
      FROM generate_series(1, %(tenants)s) AS i
    """,
    # What the operations pages read too: shadow-mode decisions (one per parked job), one
    # limit change per tenant, a few limited queues.
    f"""
    INSERT INTO fair_jobs_jobdecision
           (at, task_id, task_name, tenant, queue, mechanism, action, enforced, detail)
    SELECT now() - make_interval(secs => (%(jobs)s - i) * 0.001), 'parked-' || i,
           %(slots_task)s, {TENANT.format("1 + i %% %(tenants)s")}, %(queue)s, 'slots',
           'defer', false, '{{}}'::jsonb
      FROM generate_series(0, %(jobs)s - 1) AS i
    """,
    f"""
    INSERT INTO fair_jobs_limitchange
           (at, "user", source, tenant, queue, field, old_value, new_value, note)
    SELECT now() - make_interval(secs => i), 'bench', 'command', {TENANT.format("i")},
           %(queue)s, 'max_jobs', '', '1', ''
      FROM generate_series(1, %(tenants)s) AS i
    """,
    """
    INSERT INTO fair_jobs_queuelimit
           (queue, max_jobs, current_jobs, running, parked_jobs, deferred_total, created_at,
            updated_at)
    SELECT %(queue)s || '.limited-' || i, 4, 0, '{}'::jsonb, 0, 0, now(), now()
      FROM generate_series(1, 10) AS i
    """,
]


@dataclass(frozen=True)
class Case:
    """The size of one case."""

    name: str
    tenants: int
    window_rows: int
    jobs: int

    @property
    def buckets(self) -> int:
        """Window buckets per tenant."""
        return max(self.window_rows // self.tenants, 1)


@dataclass
class Page:
    """One admin changelist as measured."""

    seconds: float
    queries: int
    rows_shown: int
    per_page: int
    result_count: int | None


@dataclass
class Measured:
    """Everything measured in one case."""

    rows: dict[str, int]
    operations: dict[str, float] = field(default_factory=dict)
    """Seconds per operation (a median)."""
    pages: dict[str, Page] = field(default_factory=dict)
    prune: dict[str, int] = field(default_factory=dict)


def _tables() -> list[str]:
    """The library's tables (the dashboard is a proxy, with none of its own)."""
    config = apps.get_app_config("fair_jobs")
    return [m._meta.db_table for m in config.get_models() if not m._meta.proxy]


def _count(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table}")  # a name from our own models
        return int(cursor.fetchone()[0])


class Command(BaseCommand):
    """Measure acquire, park, enqueue, planner, admin and pruning costs, small vs large."""

    help = "Measure the library's operations with large tables against small ones (ratios)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenants", type=int, default=10_000, help="Tenants (large case).")
        parser.add_argument(
            "--window-rows", type=int, default=1_000_000, help="Window buckets (large case)."
        )
        parser.add_argument(
            "--jobs", type=int, default=100_000,
            help="Parked jobs, and as many planned jobs pending (large case).",
        )  # fmt: skip
        parser.add_argument("--repeat", type=int, default=200, help="Timed calls per operation.")
        parser.add_argument("--batch", type=int, default=100, help="Jobs per planner run.")
        parser.add_argument("--json", type=Path, help="Write every figure to this file.")
        parser.add_argument(
            "--replace", action="store_true",
            help="Truncate the library's tables even if they hold rows.",
        )  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("bench_load needs PostgreSQL: set DATABASE_URL=postgres://...")
        call_command("migrate", verbosity=0)
        if not options["replace"] and any(_count(t) for t in _tables()):
            raise CommandError(
                "The library's tables hold rows, and this command truncates them: use a "
                "database of its own, or pass --replace."
            )
        large = Case("large", options["tenants"], options["window_rows"], options["jobs"])
        if min(large.tenants, large.window_rows, large.jobs) < 1:
            raise CommandError("--tenants, --window-rows and --jobs must be at least 1.")
        small = Case("small", *(min(SMALL[k], getattr(large, k)) for k in SMALL))
        self.repeat, self.batch = options["repeat"], options["batch"]
        task = planner_job
        plan = getattr(task, "fair_plan", None)
        publish = planner._publish
        # Promote a batch per run however long the last one waits (nothing starts here),
        # and leave the broker out: the database's part is what grows with the data.
        setattr(task, "fair_plan", {"enqueue_interval": 3600, "enqueue_jobs": self.batch,  # noqa: B010
                                    "latency_threshold": 10**6})  # fmt: skip
        setattr(planner, "_publish", lambda app, row: None)  # noqa: B010
        user = get_user_model()
        admin_user = user.objects.filter(username="bench-load").first() or (
            user.objects.create_superuser("bench-load", "bench-load@example.com", None)
        )
        try:
            results = {case.name: self._case(case, admin_user) for case in (small, large)}
        finally:
            setattr(task, "fair_plan", plan)  # noqa: B010
            setattr(planner, "_publish", publish)  # noqa: B010
            self._truncate()
            admin_user.delete()
        self._report(small, large, results["small"], results["large"], options["json"])

    # --- filling ----------------------------------------------------------------------

    def _truncate(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {', '.join(_tables())} RESTART IDENTITY CASCADE")

    def _fill(self, case: Case) -> uuid.UUID:
        """Fresh rows for ``case``; returns the live process that holds the slots."""
        self._truncate()
        process_id = uuid.uuid4()
        identity.register_process(
            process_id=process_id, node="bench-load@local", hostname="local", pid=0
        )
        max_window = fair_settings.REROUTE_MAX_WINDOW
        with connection.cursor() as cursor:
            cursor.execute("SELECT floor(extract(epoch FROM now()))::bigint")
            now = int(cursor.fetchone()[0])
            params: dict[str, Any] = {
                "tenants": case.tenants, "jobs": case.jobs, "queue": QUEUE,
                "process_id": process_id, "slots_task": SLOTS_TASK,
                "parked_signature": _signature(SLOTS_TASK, "__ID__"),
                "planned_task": PLANNED_TASK,
                "planned_signature": _signature(PLANNED_TASK, "__ID__"),
                "reroute_task": REROUTE_TASK, "key": WINDOW_KEY, "now": now,
                "max_window": max_window, "idle_every": IDLE_EVERY, "buckets": case.buckets,
                "step": max(2 * max_window // case.buckets, 1),
            }  # fmt: skip
            for statement in FILL:
                cursor.execute(statement, params)
            # As autovacuum would have by then: plans fit the data.
            cursor.execute(f"ANALYZE {', '.join(_tables())}")
        return process_id

    # --- measuring --------------------------------------------------------------------

    def _case(self, case: Case, admin_user: Any) -> Measured:
        started = time.perf_counter()
        process_id = self._fill(case)
        rows = {table.removeprefix("fair_jobs_"): _count(table) for table in _tables()}
        self.stdout.write(
            f"{case.name}: {case.tenants:,} tenants, {rows['windowbucket']:,} window rows, "
            f"{rows['parkedjob']:,} parked and {rows['plannedjob']:,} planned jobs "
            f"(filled in {time.perf_counter() - started:.1f} s)"
        )
        measured = Measured(rows)
        ops = measured.operations
        tenants = [f"tenant-{i:06d}" for i in range(1, case.tenants + 1)]
        ops["acquire + release a tenant slot"] = self._acquire_release(tenants, process_id)
        ops["park + wake a job"] = self._park_wake(process_id)
        active = tenants[IDLE_EVERY - 1 :: IDLE_EVERY] or tenants[:1]
        ops["enqueue with 2 rerouting rules (window count)"] = self._per_call(
            cycle(active),
            lambda t: reroute_store.record(
                key=WINDOW_KEY, tenant=t, task_name=REROUTE_TASK, rules=RULES
            ),
        )
        planned = planner_job
        ops["planned enqueue (virtual queue)"] = self._per_call(
            cycle(tenants),
            lambda t: planned.apply_async(kwargs={**KWARGS, "tenant": t}, queue=QUEUE),
        )
        ops[f"planner run promoting {self.batch} jobs"] = self._planner_run(planned)
        identity.beat(process_id)  # the seeded holders stay alive
        measured.pages = self._pages(admin_user)
        identity.beat(process_id)
        measured.prune = self._prune()
        ops["maintenance pass (run_maintenance)"] = median_seconds(run_maintenance, 3)
        if SlotLease.objects.count() != case.tenants:
            raise CommandError("a seeded lease was reaped: the measurement is not valid")
        return measured

    def _per_call(self, items: Iterator[str], action: Callable[[str], Any]) -> float:
        return median_seconds(lambda: action(next(items)), self.repeat)

    def _acquire_release(self, tenants: list[str], process_id: uuid.UUID) -> float:
        """One tenant after another: each slot is held by a running job (limit 1); this job
        brings a limit of 2, so it takes the second place and gives it back."""
        slots = slot_store
        order = cycle(tenants[:: max(len(tenants) // self.repeat, 1)])
        numbers = iter(range(10**9))

        def pair() -> None:
            acquired = slots.try_acquire(
                tenant=next(order), queue=QUEUE, task_id=f"pair-{next(numbers)}", limit=2,
                process_id=process_id, timeout=fair_settings.WORKER_TIMEOUT,
            )  # fmt: skip
            if acquired.grant is None:
                raise CommandError(f"acquire: {acquired.status}")
            slots.release(acquired.grant)

        return median_seconds(pair, self.repeat)

    def _park_wake(self, process_id: uuid.UUID) -> float:
        """The life of a deferred job, on a tenant of its own among the seeded ones: park it
        while the slot is held, release the holder, wake it (a reservation), start it."""
        slots = slot_store
        timeout = fair_settings.WORKER_TIMEOUT
        first = slots.try_acquire(
            tenant="parker", queue=QUEUE, task_id="park-0", limit=1, process_id=process_id,
            timeout=timeout,
        )  # fmt: skip
        holder: list[Grant] = [first.grant] if first.grant is not None else []
        numbers = iter(range(1, 10**9))
        signature = _signature(SLOTS_TASK, "park")

        def cycle_once() -> None:
            task_id = f"park-{next(numbers)}"
            outcome = slots.try_park(
                tenant="parker", queue=QUEUE, task_id=task_id, task_name=SLOTS_TASK, limit=1,
                signature=signature,
            )  # fmt: skip
            parked = slots.release(holder[0])
            slot_id = holder[0].slot_id
            woken = slots.wake_one(slot_id) if parked and slot_id is not None else None
            started = slots.try_acquire(
                tenant="parker", queue=QUEUE, task_id=task_id, limit=1,
                process_id=process_id, timeout=timeout, woken=True,
            )  # fmt: skip
            if outcome != "parked" or woken is None or started.grant is None:
                raise CommandError(f"park + wake: {outcome}, {woken}, {started.status}")
            holder[0] = started.grant

        seconds = median_seconds(cycle_once, self.repeat)
        slots.release(holder[0])
        return seconds

    def _planner_run(self, task: Any) -> float:
        """Median of a few runs, each promoting a batch. Outside the timing, the promoted
        jobs then go back in line, as if they had started and as many new ones arrived: the
        backlog stays the same size from run to run."""
        times = []
        expected = min(self.batch, PlannedJob.objects.filter(promoted_at__isnull=True).count())
        for _ in range(5):
            started = time.perf_counter()
            report = planner.run(task, due_only=False)
            times.append(time.perf_counter() - started)
            if report is None or report.promoted != expected:
                raise CommandError(f"the planner promoted {report}, not {expected}")
            PlannedJob.objects.filter(promoted_at__isnull=False).update(promoted_at=None)
        return statistics.median(times)

    def _pages(self, admin_user: Any) -> dict[str, Page]:
        client = Client()
        client.force_login(admin_user)
        pages: dict[str, Page] = {}
        # The test client's host name, for this process only.
        with override_settings(ALLOWED_HOSTS=[*settings.ALLOWED_HOSTS, "testserver"]):
            for model in admin.site._registry:
                if model._meta.app_label != "fair_jobs":
                    continue
                url = reverse(f"admin:fair_jobs_{model._meta.model_name}_changelist")
                client.get(url)  # warm: templates, the first query plans
                # Each request empties the connection's query log (request_started), so
                # the capture must start from an empty one.
                reset_queries()
                with CaptureQueriesContext(connection) as queries:
                    response = client.get(url)
                if response.status_code != 200:
                    raise CommandError(f"{url}: HTTP {response.status_code}")
                seconds = median_seconds(lambda url=url: client.get(url), 3)  # type: ignore[misc]
                context = getattr(response, "context_data", None) or {}
                listing = context.get("cl")
                if listing is not None:
                    shown, per_page = len(listing.result_list), listing.list_per_page
                    count: int | None = listing.result_count
                else:  # the dashboard: its busiest tenants
                    shown, per_page = len(context["tenants"]), DASHBOARD_TENANTS
                    count = None
                pages[str(model._meta.verbose_name_plural)] = Page(
                    seconds, len(queries.captured_queries), shown, per_page, count
                )
        client.logout()
        return pages

    def _prune(self) -> dict[str, int]:
        before = {"windows": TenantWindow.objects.count(), "buckets": WindowBucket.objects.count()}
        started = time.perf_counter()
        removed = prune()
        elapsed = time.perf_counter() - started
        after = {"windows": TenantWindow.objects.count(), "buckets": WindowBucket.objects.count()}
        started = time.perf_counter()
        again = prune()  # nothing left to prune: the table stays where it is
        steady = time.perf_counter() - started
        return {
            "windows_before": before["windows"], "buckets_before": before["buckets"],
            "windows_pruned": removed, "windows_after": after["windows"],
            "buckets_after": after["buckets"], "pruned_again": again,
            "microseconds": round(elapsed * 1e6), "again_microseconds": round(steady * 1e6),
            "buckets_after_second_pass": WindowBucket.objects.count(),
        }  # fmt: skip

    # --- reporting --------------------------------------------------------------------

    def _report(
        self, small: Case, large: Case, a: Measured, b: Measured, path: Path | None
    ) -> None:
        lines = ["", "| operation | small | large | large / small |", "|---|---|---|---|"]
        figures: list[dict[str, Any]] = []
        for name, s in a.operations.items():
            big = b.operations[name]
            lines.append(f"| {name} | {_time(s)} | {_time(big)} | {big / s:.2f}x |")
            figures.append({"operation": name, "small": s, "large": big, "ratio": big / s})
        for name, page in a.pages.items():
            big_page = b.pages[name]
            label = f"admin: {name}"
            lines.append(
                f"| {label} | {_time(page.seconds)}, {page.queries} queries "
                f"| {_time(big_page.seconds)}, {big_page.queries} queries "
                f"| {big_page.seconds / page.seconds:.2f}x |"
            )
            figures.append({
                "operation": label, "small": page.seconds, "large": big_page.seconds,
                "ratio": big_page.seconds / page.seconds,
                "small_page": asdict(page), "large_page": asdict(big_page),
            })  # fmt: skip
        for label, key in (
            ("prune idle windows (windows.prune)", "microseconds"),
            ("prune again, nothing idle left", "again_microseconds"),
        ):
            s, big = a.prune[key] / 1e6, b.prune[key] / 1e6
            lines.append(f"| {label} | {_time(s)} | {_time(big)} | {big / s:.2f}x |")
            figures.append({"operation": label, "small": s, "large": big, "ratio": big / s})
        self.stdout.write("\n".join(lines))
        self.stdout.write("")
        for case, m in (("small", a), ("large", b)):
            p = m.prune
            self.stdout.write(
                f"Pruning, {case}: {p['windows_before']:,} windows and {p['buckets_before']:,} "
                f"window rows before, {p['windows_after']:,} and {p['buckets_after']:,} after; "
                f"a second pass removed {p['pruned_again']} and left "
                f"{p['buckets_after_second_pass']:,}."
            )
        over = [
            f"{case} {name} ({page.rows_shown} > {page.per_page})"
            for case, m in (("small", a), ("large", b))
            for name, page in m.pages.items()
            if page.rows_shown > page.per_page
        ]
        self.stdout.write(
            "Admin pages over list_per_page: " + (", ".join(over) if over else "none") + "."
        )
        if path is not None:
            path.write_text(
                json.dumps(
                    {
                        "cases": {"small": asdict(small), "large": asdict(large)},
                        "rows": {"small": a.rows, "large": b.rows},
                        "prune": {"small": a.prune, "large": b.prune},
                        "figures": figures,
                    },
                    indent=2,
                )
            )
            self.stdout.write(f"Wrote {path}")


def _time(seconds: float) -> str:
    if seconds >= 0.1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"

"""``manage.py bench_costs``: what each step of a job costs, from Python and inside PostgreSQL.

Needs PostgreSQL (``DATABASE_URL=postgres://...``). For each step the library takes on a
job's path (the slot's acquire and release, rerouting's count, fair dispatch's enqueue,
start and end, the heartbeat), on one warm connection of this process, with no broker:

1. **Statements**: what the step sends, counted with Django's query capture (each one round
   trip once prepared on the connection).
2. **Client time**: wall time per call from Python, the round trip and the commit included,
   with the library's statements prepared (``FAIR_JOBS_PREPARED_STATEMENTS``, the default)
   and without, measured in interleaved rounds.
3. **CPU time**, statements prepared: this thread's (Python, Django, psycopg), and that of
   the PostgreSQL process serving the connection, read from ``/proc`` when the server runs
   on this machine (``-`` otherwise; its clock ticks are 10 ms, a few percent of a round).
4. **Server time**: ``EXPLAIN (ANALYZE)`` of the step's statement in a transaction that is
   rolled back, split into planning (what preparing saves) and execution.

Every figure is the median of the rounds. Tables and rows are the benchmark database's; the
command removes what it made.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import dispatch, identity
from django_fair_jobs.dispatch.models import DispatchJob, DispatchTenant
from django_fair_jobs.dispatch.types import Job
from django_fair_jobs.leases.types import Grant
from django_fair_jobs.models import JobDecision, SlotLease, TenantQueueSlot, TenantWindow
from django_fair_jobs.reroute import store as reroute_store
from django_fair_jobs.reroute.types import Deciding
from django_fair_jobs.slots import store as slot_store
from django_fair_jobs.sql import queries

Explain = Callable[[str, dict[str, Any]], None]
"""Runs one named statement under ``EXPLAIN (ANALYZE)`` and adds up its times."""

QUEUE = "bench.costs"
RULES = [(86_400, 1000, "bench.costs.slow"), (60, 20, "bench.costs.slow")]


class Command(BaseCommand):
    help = "Measure each step of a job: statements, client time, server planning and execution."
    held: Grant | None = None
    """The grant the handoff step hands on from call to call."""
    traded: tuple[str, Grant] | None = None
    """The tenant and grant the trade step releases at its next call."""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--calls", type=int, default=1000, help="Calls per step per round.")
        parser.add_argument("--rounds", type=int, default=3, help="Interleaved rounds.")

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("bench_costs needs PostgreSQL: set DATABASE_URL=postgres://...")
        call_command("migrate", verbosity=0)
        calls, rounds = options["calls"], options["rounds"]
        self.process_id = uuid.uuid4()
        identity.register_process(
            process_id=self.process_id, node="costs@bench", hostname="bench", pid=1,
            queues=[QUEUE], concurrency=10**6,
        )  # fmt: skip
        dispatch.refresh_capacity(slack_per_node=0, timeout=600)
        with connection.cursor() as cursor:
            # Dead rows of earlier runs would make later runs slower than the first.
            cursor.execute(
                "VACUUM ANALYZE fair_jobs_dispatchjob, fair_jobs_dispatchtenant, "
                "fair_jobs_slotlease, fair_jobs_tenantqueueslot, fair_jobs_tenantwindow"
            )
        try:
            self.held = self._acquire("acme-handoff")  # what the handoff step hands on
            self.traded = ("acme-b", self._acquire("acme-b"))  # what the trade releases
            self._measure(calls, rounds)
        finally:
            self._clean()

    def _measure(self, calls: int, rounds: int) -> None:
        steps: list[tuple[str, Callable[[int], Any], Callable[[Explain], None] | None]] = [
            ("slots: acquire + release", self._slot_pair, self._pair_statements),
            (
                "slots: acquire + release, the release asynchronous",
                self._slot_pair_async,
                self._pair_statements,
            ),
            ("slots: hand over to the next job", self._hand_over, self._hand_over_statement),
            (
                "slots: release one tenant's slot and acquire another's, one statement",
                self._trade,
                self._trade_statement,
            ),
            ("reroute: count (2 rules, rerouted)", self._count, self._count_statement),
            ("dispatch: enqueue", self._enqueue, self._enqueue_statement),
            (
                "dispatch: enqueue + start + end, dispatched at once",
                self._start_end,
                self._run_statements,
            ),
            ("heartbeat (an ORM update)", lambda i: identity.beat(self.process_id), None),
        ]
        self.stdout.write(
            "| step | statements | client ms, prepared | client ms, not prepared "
            "| CPU ms, Python | CPU ms, server | server planning ms | server execution ms |"
        )
        self.stdout.write("|---|---|---|---|---|---|---|---|")
        for label, step, statement in steps:
            # With DEBUG on, Django keeps the last 9,000 queries: a full log would count 0.
            connection.queries_log.clear()
            with CaptureQueriesContext(connection) as captured:
                step(0)
            timed: dict[bool, list[Timing]] = {True: [], False: []}
            for r in range(rounds):
                for prepared in (True, False) if r % 2 == 0 else (False, True):
                    timed[prepared].append(self._time(step, calls, prepared))
            server = "| - | - |"
            if statement is not None:
                planning, execution = self._server(statement)
                server = f"| {planning:.3f} | {execution:.3f} |"
            wall = statistics.median(t.wall for t in timed[True])
            unprepared = statistics.median(t.wall for t in timed[False])
            python = statistics.median(t.python for t in timed[True])
            backend = [t.server for t in timed[True] if t.server is not None]
            cpu = f"{statistics.median(backend):.3f}" if backend else "-"
            self.stdout.write(
                f"| {label} | {len(captured)} | {wall:.3f} | {unprepared:.3f} "
                f"| {python:.3f} | {cpu} {server}"
            )

    def _time(self, step: Callable[[int], Any], calls: int, prepared: bool) -> Timing:
        """Milliseconds per call of ``step``, after a warm-up that prepares what it runs."""
        release_async = step == self._slot_pair_async
        with override_settings(
            FAIR_JOBS_PREPARED_STATEMENTS=prepared, FAIR_JOBS_ASYNC_RELEASE=release_async
        ):
            for i in range(20):
                step(i)
            backend = _backend_cpu()
            started, python = time.perf_counter(), time.thread_time()
            for i in range(calls):
                step(i)
            wall, python = time.perf_counter() - started, time.thread_time() - python
            after = _backend_cpu()
        server = None if backend is None or after is None else (after - backend) / calls * 1000
        return Timing(wall / calls * 1000, python / calls * 1000, server)

    def _server(self, statements: Callable[[Explain], None]) -> tuple[float, float]:
        """Median planning and execution times (ms), summed over the step's statements, of
        ``EXPLAIN (ANALYZE)`` of each in a transaction rolled back."""
        plans, runs = [], []
        for _ in range(21):
            times = [0.0, 0.0]

            def explain(name: str, params: dict[str, Any], times: list[float] = times) -> None:
                with connection.cursor() as cursor:
                    cursor.execute("EXPLAIN (ANALYZE, SUMMARY) " + queries()[name], params)
                    lines = [row[0] for row in cursor.fetchall()]
                times[0] += _ms(lines, "Planning Time")
                times[1] += _ms(lines, "Execution Time")

            with transaction.atomic():
                statements(explain)
                transaction.set_rollback(True)
            plans.append(times[0])
            runs.append(times[1])
        return statistics.median(plans), statistics.median(runs)

    # -- the steps -------------------------------------------------------------------------

    def _slot_pair(self, i: int) -> None:
        slot_store.release(self._acquire("acme"))

    def _slot_pair_async(self, i: int) -> None:
        # FAIR_JOBS_ASYNC_RELEASE: the release commits without waiting for the WAL flush.
        slot_store.release(self._acquire("acme"))

    def _hand_over(self, i: int) -> None:
        # The slot handoff (FAIR_JOBS_SLOT_HANDOFF): the release of one job and the
        # acquire of the next of the same tenant, as one statement.
        held = self.held or self._acquire("acme-handoff")
        handed = slot_store.hand_over(held=held, task_id=str(uuid.uuid4()), limit=10**6)
        if handed is None:
            raise CommandError(f"the slot was not handed over: {held}")
        self.held = handed

    def _trade(self, i: int) -> None:
        # The slot handoff when the next job is another tenant's: the release of one and
        # the acquire of the other, as one statement.
        tenant, held = self.traded or ("acme-b", self._acquire("acme-b"))
        other = "acme-a" if tenant == "acme-b" else "acme-b"
        traded = slot_store.try_release_and_acquire(
            held=held, tenant=other, queue=QUEUE, task_id=str(uuid.uuid4()), limit=10**6,
            process_id=self.process_id, timeout=600, woken=False,
        )  # fmt: skip
        if traded is None or traded[0].grant is None or traded[1] is None:
            raise CommandError(f"the slots were not traded: {traded}")
        self.traded = (other, traded[0].grant)

    def _trade_statement(self, explain: Explain) -> None:
        tenant, held = self.traded or ("acme-b", self._acquire("acme-b"))
        explain("release_and_acquire", {
            "held_slot_id": held.slot_id, "held_task_id": held.task_id,
            "held_token": held.token, "tenant": "acme-a" if tenant == "acme-b" else "acme-b",
            "queue": QUEUE, "task_id": str(uuid.uuid4()), "limit": 10**6,
            "process_id": self.process_id, "token": uuid.uuid4(), "timeout": 600,
            "woken": False,
        })  # fmt: skip

    def _acquire(self, tenant: str) -> Grant:
        acquired = slot_store.try_acquire(
            tenant=tenant, queue=QUEUE, task_id=str(uuid.uuid4()), limit=10**6,
            process_id=self.process_id, timeout=600,
        )  # fmt: skip
        if acquired.grant is None:
            raise CommandError(f"the slot was not acquired: {acquired}")
        return acquired.grant

    def _hand_over_statement(self, explain: Explain) -> None:
        held = self.held or self._acquire("acme-handoff")
        explain("hand_over", {
            "slot_id": held.slot_id, "held_task_id": held.task_id, "held_token": held.token,
            "task_id": str(uuid.uuid4()), "token": uuid.uuid4(), "limit": 10**6,
        })  # fmt: skip

    def _pair_statements(self, explain: Explain) -> None:
        task_id, token = str(uuid.uuid4()), uuid.uuid4()
        explain("acquire", {
            "tenant": "acme", "queue": QUEUE, "task_id": task_id, "limit": 10**6,
            "process_id": self.process_id, "token": token, "timeout": 600, "woken": False,
        })  # fmt: skip
        slot_id = SlotLease.objects.get(task_id=task_id).slot_id
        explain(
            "release",
            {"slot_id": slot_id, "task_id": task_id, "token": token, "async_commit": False},
        )

    def _count(self, i: int) -> None:
        reroute_store.record(
            key=f"task:{QUEUE}", tenant="acme", task_name="bench.costs", rules=RULES,
            deciding=Deciding(str(uuid.uuid4()), QUEUE, True),
        )  # fmt: skip

    def _count_statement(self, explain: Explain) -> None:
        explain("record_enqueue", {
            "key": f"task:{QUEUE}", "tenant": "acme", "task_name": "bench.costs", "at": None,
            "pers": [per for per, _, _ in RULES], "thresholds": [t for _, t, _ in RULES],
            "queues": [q for _, _, q in RULES], "task_id": str(uuid.uuid4()),
            "declared": QUEUE, "enforced": True,
        })  # fmt: skip

    def _job(self, tenant: str = "acme") -> Job:
        return Job(
            queue=QUEUE, tenant=tenant, task_name="bench.costs", task_id=str(uuid.uuid4()),
            message="{}", not_before=None, weight=None, cap=None,
        )  # fmt: skip

    def _enqueue(self, i: int) -> None:
        # On a queue no process consumes, for one of 100 tenants: the job waits in its
        # line, as a flood's would; the rows go at the end.
        job = self._job(tenant=f"e{i % 100}")
        dispatch.enqueue(dataclasses.replace(job, queue=QUEUE + ".full"))

    def _enqueue_statement(self, explain: Explain) -> None:
        explain("dispatch_enqueue", self._enqueue_params(QUEUE + ".full"))

    def _enqueue_params(self, queue: str) -> dict[str, Any]:
        job = self._job()
        return {
            "queue": queue, "tenant": job.tenant, "task_name": job.task_name,
            "task_id": job.task_id, "message": job.message, "not_before": None,
            "delay": 0.0, "weight": None, "cap": None, "on_loss": 0, "by": None,
            "again": False,
        }  # fmt: skip

    def _start_end(self, i: int) -> None:
        ready = dispatch.enqueue(self._job(tenant="run"))
        if not ready:
            raise CommandError("the job was not dispatched: no capacity")
        job_id = ready[0].job_id
        dispatch.start(job_id, self.process_id)
        dispatch.end(job_id, self.process_id)

    def _run_statements(self, explain: Explain) -> None:
        params = self._enqueue_params(QUEUE)
        explain("dispatch_enqueue", params)
        job_id = DispatchJob.objects.get(task_id=params["task_id"]).pk
        explain(
            "dispatch_start", {"job": job_id, "process": self.process_id, "async_commit": False}
        )
        explain("dispatch_end", {
            "job": job_id, "process": self.process_id, "outcome": "end", "delay": 0.0,
            "block": False, "max": 100, "again": False,
        })  # fmt: skip

    def _clean(self) -> None:
        SlotLease.objects.filter(process_id=self.process_id).delete()
        TenantQueueSlot.objects.filter(queue=QUEUE).delete()
        TenantWindow.objects.filter(key=f"task:{QUEUE}").delete()
        JobDecision.objects.filter(queue=QUEUE).delete()
        DispatchJob.objects.filter(queue__startswith=QUEUE).delete()
        DispatchTenant.objects.filter(queue__startswith=QUEUE).delete()
        identity.retire_process(self.process_id)


class Timing(NamedTuple):
    """Per call of a step, in milliseconds: the wall time, the CPU time of the calling
    thread (Python, psycopg, the driver), and the CPU time of the database server's
    process for the connection (None when it runs on another machine)."""

    wall: float
    python: float
    server: float | None


def _backend_cpu() -> float | None:
    """CPU seconds used so far by the PostgreSQL process serving Django's connection, read
    from /proc: only when the server runs on this machine (None otherwise)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # utime and stime, the 14th and 15th fields of the line (the 12th and 13th after the
    # process's name), in clock ticks.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ms(lines: list[str], label: str) -> float:
    for line in lines:
        if line.startswith(label):
            return float(line.split(":")[1].split()[0])
    raise CommandError(f"EXPLAIN gave no {label}")

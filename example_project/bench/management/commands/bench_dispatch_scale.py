"""``manage.py bench_dispatch_scale``: how fair dispatch's steps scale with concurrent
sessions, queues and ineligible tenants (PostgreSQL only, no broker: nothing is
published; the tables are truncated, so use a database of its own).

Three figures, each beside its physical limit measured in the same run:

1. **sessions**: 8 and 16 concurrent sessions (processes, each with its own connection) on
   one queue, each ending a job and dispatching the next in one statement
   (``fair_jobs_dispatch_end`` of a dispatched job, which deletes it, lowers its line's
   count and dispatches the next job into its room), for ``--seconds``. Against pgbench
   with as many clients, each updating a row of its own (``UPDATE ... WHERE id =
   :client_id``): jobs per second over pgbench's transactions per second.
2. **queues**: 9 queues, one session each, with and without a tenth queue held busy: the 9
   queues' jobs per second with it over without (over the mean of the runs without it just
   before and just after, as the machine's speed drifts between runs). Three ways to hold
   it, each run on its own: ``busy``, its row and all its lines locked all along by
   transactions of 0.1 s that take them again as each commits (as a busy queue's own steps
   hold them); ``open``, the same locks held by one transaction open for the whole run;
   ``horizon``, a transaction open for the whole run that locks nothing (it only holds
   back PostgreSQL's cleanup of old row versions, the other cost of ``open``).
3. **blocked**: ``--tenants`` tenants on one queue, all eligible, then all but one paused
   by their tenant slot: the median of a dispatch + end cycle (as ``bench_dispatch``
   measures it) with them over without.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

TABLES = "fair_jobs_dispatchjob, fair_jobs_dispatchtenant, fair_jobs_dispatchqueue"

FILL_QUEUE = (
    "INSERT INTO fair_jobs_dispatchqueue (queue, capacity, slack, nodes, updated_at) "
    "VALUES (%(queue)s, %(capacity)s, 0, 1, now())"
)
FILL_JOBS = (
    "INSERT INTO fair_jobs_dispatchjob (queue, tenant, task_name, task_id, message, state, "
    "enqueued_at, publish_failures, republished, on_loss) "
    "SELECT %(queue)s, %(queue)s || '-t' || (i %% %(tenants)s), 'bench', md5(%(queue)s || i), "
    "'{}', 1, now(), 0, 0, 0 FROM generate_series(1, %(jobs)s) AS i"
)
FILL_LINES = (
    "INSERT INTO fair_jobs_dispatchtenant (queue, tenant, weight, cap, waiting, in_flight, "
    "pass_value, served_pass, head_id, dispatched_total, blocked) "
    "SELECT %(queue)s, tenant, 1.0, NULL, count(*), 0, 0, 0, min(id), 0, false "
    "FROM fair_jobs_dispatchjob WHERE queue = %(queue)s GROUP BY tenant"
)
DISPATCH = "SELECT job_id FROM fair_jobs_dispatch(%s, %s)"
END_NEXT = "SELECT job_id FROM fair_jobs_dispatch_end(%s, NULL, 'end', 0, false, 1)"
BACK = "SELECT count(*) FROM fair_jobs_dispatch_end(%s, NULL, 'back', 0, false, 0)"
RAW_UPDATE = "UPDATE bench_rows SET v = v + 1 WHERE id = :client_id + 1;\n"
"""pgbench's script for the physical limit: each client updates a row of its own."""
CYCLE = (
    "SELECT job_id AS job FROM fair_jobs_dispatch('q', 1) \\gset\n"
    "SELECT count(*) FROM fair_jobs_dispatch_end(:job, NULL, 'end', 0, false, 0);\n"
)
"""The same steps from pgbench's C client (a dispatch, then the end of what it chose), so
that the client's cost is pgbench's in both: two statements per job."""


def _dsn() -> str:
    s = connection.settings_dict
    return (
        f"host={s.get('HOST') or '127.0.0.1'} port={s.get('PORT') or 5432} "
        f"dbname={s['NAME']} user={s.get('USER') or 'postgres'}"
    )


def _cycle(dsn: str, queue: str, first: int, seconds: float, out: Any) -> None:
    """One session: end a dispatched job and take the job its end dispatched, again and
    again for ``seconds``; puts how many it ended on ``out``."""
    ended, job = 0, first
    with psycopg.connect(dsn, autocommit=True) as conn:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            row = conn.execute(END_NEXT, [job]).fetchone()
            ended += 1
            if row is None:  # another session's end took the room first: dispatch
                row = conn.execute(DISPATCH, [queue, 1]).fetchone()
                if row is None:
                    break
            job = row[0]
    out.put(ended)


HOLDS = ("busy", "open", "horizon")
"""The ways the tenth queue is held in the queues figure (see the module's docstring)."""

LOCK_QUEUE = "SELECT 1 FROM fair_jobs_dispatchqueue WHERE queue = %s FOR UPDATE"
LOCK_LINES = "SELECT 1 FROM fair_jobs_dispatchtenant WHERE queue = %s FOR UPDATE"


def _hold(dsn: str, queue: str, hold: str, held: Any, stop: Any) -> None:
    """Hold ``queue`` the ``hold`` way until ``stop`` is set; set ``held`` once it is."""
    with psycopg.connect(dsn) as conn:
        while True:
            if hold == "horizon":
                conn.execute("SELECT txid_current()")  # an xid of its own, no lock
            else:
                conn.execute(LOCK_QUEUE, [queue])
                conn.execute(LOCK_LINES, [queue])
            held.set()
            if hold != "busy":
                stop.wait()
            elif not stop.wait(0.1):
                conn.commit()  # and take them again at once
                continue
            conn.rollback()
            return


class Command(BaseCommand):
    """Measure how dispatch scales: sessions, queues, ineligible tenants."""

    help = __doc__.split("\n\n")[0] if __doc__ else ""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seconds", type=float, default=8.0, help="Each timed run.")
        parser.add_argument("--tenants", type=int, default=10_000, help="Blocked case.")
        parser.add_argument("--json", type=Path, help="Write the figures to this file.")

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "postgresql":
            raise CommandError(
                "bench_dispatch_scale needs PostgreSQL (DATABASE_URL=postgres://...)."
            )
        call_command("migrate", verbosity=0)
        seconds = options["seconds"]
        figures: dict[str, Any] = {"sessions": {}, "queues": {}, "blocked": {}}
        try:
            for clients in (8, 16):
                jobs = self._sessions(["q"], clients, seconds)
                raw = self._pgbench(clients, seconds, RAW_UPDATE)
                self._fill(["q"], clients, 64, 200_000)
                cycle = self._pgbench(clients, seconds, CYCLE)
                figures["sessions"][clients] = {
                    "jobs_s": jobs, "pgbench_tps": raw, "ratio": jobs / raw,
                    "pgbench_cycle_tps": cycle, "cycle_ratio": cycle / raw,
                }  # fmt: skip
            names = [f"q{i}" for i in range(9)]
            # Each held run between two runs alone, against their mean: from one run of a
            # few seconds to the next, this machine's speed drifts by up to a fifth.
            alone = [self._sessions(names, 1, seconds)]
            figures["queues"] = {}
            for hold in HOLDS:
                held = self._sessions(names, 1, seconds, busy="q9", hold=hold)
                alone.append(self._sessions(names, 1, seconds))
                around = statistics.mean(alone[-2:])
                figures["queues"][hold] = {
                    "jobs_s": held,
                    "alone_s": around,
                    "ratio": held / around,
                }
            figures["queues"]["jobs_s"] = statistics.mean(alone)
            figures["blocked"] = self._blocked(options["tenants"])
        finally:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"TRUNCATE {TABLES}, fair_jobs_tenantqueueslot RESTART IDENTITY CASCADE"
                )
        for clients, f in figures["sessions"].items():
            self.stdout.write(
                f"{clients} sessions, one queue: {f['jobs_s']:.0f} jobs/s; pgbench, rows of "
                f"their own: {f['pgbench_tps']:.0f} tps; ratio {f['ratio']:.2f}x; the same "
                f"steps driven by pgbench: {f['pgbench_cycle_tps']:.0f} jobs/s, "
                f"{f['cycle_ratio']:.2f}x"
            )
        q = figures["queues"]
        self.stdout.write(
            f"9 queues: {q['jobs_s']:.0f} jobs/s; with a tenth held "
            + "; ".join(f"{h}: {q[h]['jobs_s']:.0f} jobs/s, {q[h]['ratio']:.2f}x" for h in HOLDS)
        )
        b = figures["blocked"]
        self.stdout.write(
            f"{b['tenants']:,} tenants: a dispatch + end {b['eligible_us']:.0f} us all eligible, "
            f"{b['blocked_us']:.0f} us with all but one paused; ratio {b['ratio']:.2f}x"
        )
        if options["json"]:
            options["json"].write_text(json.dumps(figures, indent=2) + "\n")

    def _fill(self, queues: list[str], capacity: int, tenants: int, jobs: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {TABLES}, fair_jobs_tenantqueueslot RESTART IDENTITY CASCADE")
            for queue in queues:
                params: dict[str, str | int] = {
                    "queue": queue, "capacity": capacity, "tenants": tenants, "jobs": jobs,
                }  # fmt: skip
                for statement in (FILL_QUEUE, FILL_JOBS, FILL_LINES):
                    cursor.execute(statement, params)
            cursor.execute(f"ANALYZE {TABLES}")

    def _sessions(
        self,
        queues: list[str],
        per_queue: int,
        seconds: float,
        busy: str | None = None,
        hold: str = "busy",
    ) -> float:
        """Jobs per second of ``per_queue`` sessions on each of ``queues``, with ``busy``
        held all along the ``hold`` way (see the module's docstring), if given."""
        self._fill(queues + ([busy] if busy else []), per_queue, 64, 60_000 // len(queues) + 4000)
        firsts: dict[str, list[int]] = {}
        with connection.cursor() as cursor:
            for queue in queues:
                cursor.execute(DISPATCH, [queue, per_queue])
                firsts[queue] = [row[0] for row in cursor.fetchall()]
        connection.close()  # not inherited by the forked sessions
        context = multiprocessing.get_context("fork")
        stop = context.Event()
        holder = None
        if busy:
            held = context.Event()
            holder = context.Process(target=_hold, args=(_dsn(), busy, hold, held, stop))
            holder.start()
            held.wait(30)
        out = context.Queue()
        procs = [
            context.Process(target=_cycle, args=(_dsn(), q, job, seconds, out))
            for q in queues
            for job in firsts[q]
        ]
        for p in procs:
            p.start()
        total = sum(int(out.get(timeout=seconds + 60)) for _ in procs)
        for p in procs:
            p.join()
        stop.set()
        if holder is not None:
            holder.join(30)
        return total / seconds

    def _pgbench(self, clients: int, seconds: float, script_text: str) -> float:
        """pgbench's transactions per second running ``script_text``, with ``clients``
        clients on the same server (``bench_rows`` holds a row per client)."""
        s = connection.settings_dict
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS bench_rows")
            cursor.execute("CREATE TABLE bench_rows (id int PRIMARY KEY, v bigint NOT NULL)")
            cursor.execute("INSERT INTO bench_rows SELECT i, 0 FROM generate_series(1, 64) AS i")
        try:
            with tempfile.NamedTemporaryFile("w", suffix=".sql") as script:
                script.write(script_text)
                script.flush()
                done = subprocess.run(
                    ["pgbench", "-n", "-h", s.get("HOST") or "127.0.0.1",
                     "-p", str(s.get("PORT") or 5432), "-U", s.get("USER") or "postgres",
                     "-c", str(clients), "-j", "2", "-T", str(int(seconds)), "-f", script.name,
                     s["NAME"]],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
        finally:
            with connection.cursor() as cursor:
                cursor.execute("DROP TABLE IF EXISTS bench_rows")
        for line in done.stdout.splitlines():
            if line.startswith("tps ="):
                return float(line.split()[2])  # "tps = 1234.5 (without initial ...)"
        raise CommandError(f"pgbench gave no tps: {done.stdout}{done.stderr}")

    def _blocked(self, tenants: int) -> dict[str, Any]:
        """Median dispatch + end cycle with every tenant eligible, then with all but one
        paused by its tenant slot (as an operator pauses them)."""
        timings = {}
        for case in ("eligible", "blocked"):
            self._fill(["b"], 1, tenants, tenants * 2)
            with connection.cursor() as cursor:
                if case == "blocked":
                    cursor.execute(
                        "INSERT INTO fair_jobs_tenantqueueslot (tenant, queue, max_jobs, "
                        "default_max_jobs, current_jobs, parked_jobs, deferred_total, "
                        "created_at, updated_at) SELECT tenant, 'b', 0, 1, 0, 0, 0, now(), now() "
                        "FROM fair_jobs_dispatchtenant WHERE queue = 'b' AND tenant <> 'b-t0'"
                    )
                times = []
                for i in range(1200):
                    started = time.perf_counter()
                    cursor.execute(DISPATCH, ["b", 1])
                    (job,) = cursor.fetchone()
                    cursor.execute(BACK, [job])
                    if i >= 200:  # after the first pass has blocked the paused lines
                        times.append(time.perf_counter() - started)
            timings[case] = statistics.median(times) * 1e6
        return {
            "tenants": tenants,
            "eligible_us": timings["eligible"],
            "blocked_us": timings["blocked"],
            "ratio": timings["blocked"] / timings["eligible"],
        }

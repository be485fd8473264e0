"""``manage.py bench_dispatch_wal``: what fair dispatch writes to PostgreSQL's write-ahead
log per job, step by step (PostgreSQL only, no broker: nothing is published). It uses a
queue of its own (``walbench``) and removes its rows and receipts when it ends, whatever
happens; run it on an otherwise idle server, since the log is the whole server's (the
autovacuum's writes during the run count too), as a user that may ``CHECKPOINT``
(superuser, or ``pg_checkpoint`` from PostgreSQL 15).

One session runs ``--jobs`` jobs through the steps a worker's jobs take in a busy queue:
each ``delay()``'s enqueue (``fair_jobs_enqueue``, with its receipt; the queue is full, so
the job waits in its line), then the start of the oldest dispatched job carrying the end
of the job started before it (``dispatch_start_ending``: the start, the end, and the next
job dispatched into the room it left). Every job stores one real message, built once as
``delay()`` builds it for the benchmark's task. Printed per step: the bytes of WAL it
wrote (from ``pg_current_wal_insert_lsn()`` around it) and, over the whole run, the row
updates of each dispatch table and how many of them were HOT (no new index entries: from
``pg_stat_user_tables``). With ``--waldump PATH`` (PostgreSQL's ``pg_waldump`` of the
server's version, run on the server's own machine as a user that may read its data
directory), also the WAL's records by kind over the run (``--stats=record``), per job.
"""

from __future__ import annotations

import subprocess
import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from bench.pgstats import row_updates
from django_fair_jobs import dispatch
from django_fair_jobs.dispatch.message import build
from django_fair_jobs.dispatch.store import Store
from django_fair_jobs.dispatch.types import Job, Ready

QUEUE = "walbench"
TABLES = ("fair_jobs_dispatchjob", "fair_jobs_dispatchtenant")
"""The tables whose rows the steps update (a receipt is inserted once, never updated)."""


class Command(BaseCommand):
    """Measure fair dispatch's write-ahead log per job and per step."""

    help = __doc__ or ""

    def add_arguments(self, parser: CommandParser) -> None:
        """``--jobs``, ``--tenants``, ``--capacity`` and ``--waldump``."""
        parser.add_argument("--jobs", type=int, default=2000)
        parser.add_argument("--tenants", type=int, default=5)
        parser.add_argument("--capacity", type=int, default=4)
        parser.add_argument("--waldump", default="", help="path of pg_waldump (optional)")

    def handle(self, *args: Any, **options: Any) -> None:
        """Check the options, then run, print and clean up."""
        if connection.vendor != "postgresql":
            raise CommandError("bench_dispatch_wal measures PostgreSQL's WAL: set DATABASE_URL")
        if options["jobs"] < 1 or options["tenants"] < 1 or options["capacity"] < 2:
            # A capacity of 1 leaves no dispatched job to start while the one before runs.
            raise CommandError("--jobs and --tenants must be at least 1, --capacity at least 2")
        self.drawn: list[int] = []
        try:
            self._reset(options["capacity"])
            self._run(options)
        finally:
            self._reset(None)

    def _run(self, options: dict[str, Any]) -> None:
        store, process = Store("default"), uuid.uuid4()
        message = _message()
        ready: list[Ready] = []
        for i in range(options["capacity"] + options["tenants"]):  # warm: room taken, lines
            ready += store.enqueue(_job(i % options["tenants"], message), self._draw())
        written = {"enqueue": 0, "start carrying an end": 0}
        ended = ready.pop(0).job_id
        store.start(ended, process)  # the first start: nothing to carry yet
        before, start_lsn = row_updates(TABLES), self._lsn()
        for i in range(options["jobs"]):
            mark = self._lsn()
            ready += store.enqueue(_job(i % options["tenants"], message), self._draw())
            written["enqueue"] += self._lsn() - mark
            job, mark = ready.pop(0).job_id, self._lsn()
            ready += store.start(job, process, ended=[ended]).ready
            written["start carrying an end"] += self._lsn() - mark
            ended = job
        end_lsn = self._lsn()
        jobs = options["jobs"]
        self.stdout.write(f"{jobs} jobs, a message of {len(message)} bytes")
        for step, total in written.items():
            self.stdout.write(f"  {step}: {total / jobs:.0f} bytes of WAL a job")
        self.stdout.write(f"  in all: {(end_lsn - start_lsn) / jobs:.0f} bytes a job")
        self._print_updates(before, jobs)
        if options["waldump"]:
            self._print_records(options["waldump"], start_lsn, end_lsn, jobs)

    def _draw(self) -> int:
        """A number as an enqueue draws it (:func:`dispatch.draw`), kept for cleanup."""
        self.drawn.append(dispatch.draw())
        return self.drawn[-1]

    def _reset(self, capacity: int | None) -> None:
        """Empty the run's queue and its receipts; with a ``capacity``, set the queue up."""
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM fair_jobs_dispatchjob WHERE queue = %s", [QUEUE])
            cursor.execute("DELETE FROM fair_jobs_dispatchtenant WHERE queue = %s", [QUEUE])
            cursor.execute("DELETE FROM fair_jobs_dispatchqueue WHERE queue = %s", [QUEUE])
            cursor.execute(
                "DELETE FROM fair_jobs_dispatchreceipt WHERE drawn = ANY(%s)", [self.drawn]
            )
            if capacity is None:
                return
            cursor.execute(
                "INSERT INTO fair_jobs_dispatchqueue (queue, capacity, slack, nodes, updated_at)"
                " VALUES (%s, %s, 0, 1, now())",
                [QUEUE, capacity],
            )
            cursor.execute("CHECKPOINT")  # full-page images from here on are the run's own

    def _lsn(self) -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
            return int(cursor.fetchone()[0])

    def _print_updates(self, before: dict[str, tuple[int, int]], jobs: int) -> None:
        after = row_updates(TABLES)
        for table in TABLES:
            updates = after[table][0] - before[table][0]
            hot = after[table][1] - before[table][1]
            self.stdout.write(
                f"  {table}: {updates / jobs:.2f} row updates a job, {hot / jobs:.2f} of them HOT"
            )

    def _print_records(self, waldump: str, start: int, end: int, jobs: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT setting FROM pg_settings WHERE name = 'data_directory'")
            data = cursor.fetchone()[0]
            cursor.execute("SELECT timeline_id FROM pg_control_checkpoint()")
            timeline = cursor.fetchone()[0]
        run = subprocess.run(
            [waldump, "-p", f"{data}/pg_wal", "-t", str(timeline), "-s", _lsn_text(start),
             "-e", _lsn_text(end), "--stats=record"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        for line in run.stdout.splitlines():
            parts = line.replace("(", " ").replace(")", " ").split()
            # kind, count, %, record bytes, %, full-page images, %, combined, %
            if len(parts) == 9 and "/" in parts[0] and parts[1].isdigit():
                count, size = int(parts[1]) / jobs, int(parts[7]) / jobs
                self.stdout.write(f"  {parts[0]}: {count:.2f} records, {size:.0f} bytes a job")
        if run.returncode:
            self.stderr.write(run.stderr.strip())


def _message() -> str:
    from bench.tasks import dispatch_job

    return build(dispatch_job, (), {"tenant": "t0", "seconds": 0.0}, {"task_id": _task_id()})


def _job(tenant: int, message: str) -> Job:
    return Job(QUEUE, f"t{tenant}", "bench.dispatch_job", _task_id(), message, None, None, None)


def _task_id() -> str:
    return str(uuid.uuid4())


def _lsn_text(position: int) -> str:
    return f"{position >> 32:X}/{position & 0xFFFFFFFF:X}"

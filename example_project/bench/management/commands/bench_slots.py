"""``manage.py bench_slots``: the cost of a tenant slot, measured against raw SQL.

Needs PostgreSQL (``DATABASE_URL=postgres://...``) and ``pgbench`` on the PATH. In one run:

1. Round trips (statements sent) per acquire, release, park and wake, counted with
   Django's query capture on a warm connection.
2. Acquire+release pairs per second on one hot (tenant, queue) row with N concurrent
   clients, three ways: the raw conditional UPDATE pair under pgbench (the reference),
   the library's own two statements under pgbench, and the library called from Python
   (N processes, one connection each, through the Django ORM connection).

Reported as pairs/s and as ratios to the raw SQL.
"""

from __future__ import annotations

import multiprocessing
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import identity
from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess
from django_fair_jobs.slots import store as slot_store
from django_fair_jobs.sql import queries

RAW_SETUP = """
DROP TABLE IF EXISTS bench_raw_slot;
CREATE TABLE bench_raw_slot (id int PRIMARY KEY, current_jobs int NOT NULL, max_jobs int NOT NULL);
INSERT INTO bench_raw_slot VALUES (1, 0, 1000000);
"""
RAW_PAIR = """
UPDATE bench_raw_slot SET current_jobs = current_jobs + 1 WHERE id = 1 AND current_jobs < max_jobs;
UPDATE bench_raw_slot SET current_jobs = current_jobs - 1 WHERE id = 1 AND current_jobs > 0;
"""


def _library_pair_script(process_id: uuid.UUID, slot_id: int) -> str:
    """The library's acquire and release statements as a pgbench script (pgbench's
    variables are numeric, so the text parameters are inlined as literals)."""
    values = {
        "tenant": "'hot'",
        "queue": "'bench'",
        "limit": "1000000",
        "timeout": "60",
        "process_id": f"'{process_id}'::uuid",
        "token": f"'{uuid.uuid4()}'::uuid",
        "slot_id": str(slot_id),
        "woken": "false",
        "async_commit": "false",
        "task_id": "('pg-' || :n)",
    }

    def to_pgbench(sql: str) -> str:
        return " ".join(re.sub(r"%\((\w+)\)s", lambda m: values[m.group(1)], sql).split()) + ";"

    return "\n".join(
        [
            "\\set n random(1, 1000000000000)",
            to_pgbench(queries()["acquire"]),
            to_pgbench(queries()["release"]),
        ]
    )


def _pgbench(script: str, clients: int, seconds: float, mode: str = "simple") -> float:
    """Run a pgbench script; return transactions (pairs) per second."""
    db = connection.settings_dict
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
    cmd = [
        "pgbench", "-n", "-M", mode, "-c", str(clients), "-j", "2", "-T", str(int(seconds)),
        "-f", f.name, "-h", db.get("HOST") or "127.0.0.1", "-p", str(db.get("PORT") or 5432),
        "-U", db.get("USER") or "postgres", db["NAME"],
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    Path(f.name).unlink()
    match = re.search(r"tps = ([\d.]+)", out.stdout)
    if out.returncode != 0 or match is None:
        raise CommandError(f"pgbench failed: {out.stderr or out.stdout}")
    return float(match.group(1))


def _python_worker(args: tuple[int, float, str, bool]) -> int:
    index, seconds, process_id, prepared = args
    connections.close_all()  # a fresh connection per process, never a forked one
    # This forked process's own settings: the library's statements prepared or not.
    settings.FAIR_JOBS_PREPARED_STATEMENTS = prepared
    pairs = 0
    deadline = time.monotonic() + seconds
    pid = uuid.UUID(process_id)
    while time.monotonic() < deadline:
        acquired = slot_store.try_acquire(
            tenant="hot", queue="bench", task_id=f"py-{index}-{pairs}", limit=1_000_000,
            process_id=pid, timeout=60,
        )  # fmt: skip
        assert acquired.grant is not None
        slot_store.release(acquired.grant)
        pairs += 1
    connections.close_all()
    return pairs


class Command(BaseCommand):
    """Measure round trips and hot-row throughput of tenant slots."""

    help = "Round trips per acquire/release and hot-row pairs/s vs raw SQL (PostgreSQL)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--clients", type=int, default=16, help="Concurrent clients (connections) (default 16)."
        )
        parser.add_argument(
            "--seconds",
            type=float,
            default=10,
            help="Duration of each throughput run (default 10).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("bench_slots needs PostgreSQL: set DATABASE_URL=postgres://...")
        if shutil.which("pgbench") is None:
            raise CommandError("pgbench is not on the PATH (Debian: postgresql-client).")
        call_command("migrate", verbosity=0)
        self._reset()
        process_id = uuid.uuid4()
        identity.register_process(
            process_id=process_id, node="bench@local", hostname="local", pid=0
        )
        self._round_trips(process_id)
        self._reset()
        identity.register_process(
            process_id=process_id, node="bench@local", hostname="local", pid=0
        )
        self._throughput(process_id, options["clients"], options["seconds"])
        self._reset()

    def _reset(self) -> None:
        SlotLease.objects.all().delete()
        ParkedJob.objects.all().delete()
        TenantQueueSlot.objects.all().delete()
        WorkerProcess.objects.all().delete()

    def _round_trips(self, pid: uuid.UUID) -> None:
        slots = slot_store

        def count(fn: Any) -> tuple[int, Any]:
            with CaptureQueriesContext(connection) as ctx:
                result = fn()
            return len(ctx.captured_queries), result

        def acquire(task_id: str) -> Any:
            return slots.try_acquire(
                tenant="t", queue="q", task_id=task_id, limit=1, process_id=pid, timeout=60
            )

        n_first, first = count(lambda: acquire("j0"))
        n_release, _ = count(lambda: slots.release(first.grant))
        n_acquire, held = count(lambda: acquire("j1"))
        n_full, _ = count(lambda: acquire("j2"))
        n_park, _ = count(
            lambda: slots.try_park(
                tenant="t", queue="q", task_id="j2", task_name="x", limit=1, signature="{}"
            )
        )
        n_release_p, _ = count(lambda: slots.release(held.grant))
        n_wake, _ = count(lambda: slots.wake_one(held.grant.slot_id))
        self.stdout.write("Round trips (statements) per step, PostgreSQL:\n")
        self.stdout.write("| step | statements |\n|---|---|")
        for name, n in [
            ("acquire, first job of a new tenant (creates the row)", n_first),
            ("acquire, slot free", n_acquire),
            ("acquire, slot full", n_full),
            ("park (after a full acquire)", n_park),
            ("release, nobody parked", n_release),
            ("release, jobs parked", n_release_p),
            ("wake one parked job (then one publish)", n_wake),
        ]:
            self.stdout.write(f"| {name} | {n} |")
        self.stdout.write("")

    def _throughput(self, pid: uuid.UUID, clients: int, seconds: float) -> None:
        with connection.cursor() as cursor:
            cursor.execute(RAW_SETUP)
        grant = slot_store.try_acquire(
            tenant="hot", queue="bench", task_id="seed", limit=1_000_000, process_id=pid,
            timeout=60,
        ).grant  # fmt: skip
        assert grant is not None and grant.slot_id is not None
        slot_store.release(grant)
        script = _library_pair_script(pid, grant.slot_id)
        raw = _pgbench(RAW_PAIR, clients, seconds)
        raw_prepared = _pgbench(RAW_PAIR, clients, seconds, mode="prepared")
        lib_sql = _pgbench(script, clients, seconds)
        lib_prepared = _pgbench(script, clients, seconds, mode="prepared")
        connections.close_all()
        python: dict[bool, float] = {}
        for prepared in (True, False):
            with multiprocessing.get_context("fork").Pool(clients) as pool:
                counts = pool.map(
                    _python_worker, [(i, seconds, str(pid), prepared) for i in range(clients)]
                )
            python[prepared] = sum(counts) / seconds
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS bench_raw_slot")
        left = TenantQueueSlot.objects.get(tenant="hot", queue="bench").current_jobs
        self.stdout.write(
            f"Acquire+release pairs per second on one hot row, {clients} clients, "
            f"{seconds:g} s each, same run:\n"
        )
        self.stdout.write("| path | pairs/s | ratio to raw SQL |\n|---|---|---|")
        for name, value in [
            ("raw conditional UPDATE pair (pgbench)", raw),
            ("raw conditional UPDATE pair (pgbench -M prepared)", raw_prepared),
            ("library SQL: acquire + release with lease (pgbench)", lib_sql),
            ("library SQL (pgbench -M prepared)", lib_prepared),
            (f"library from Python, {clients} processes, prepared (the default)", python[True]),
            (f"library from Python, {clients} processes, not prepared", python[False]),
        ]:
            self.stdout.write(f"| {name} | {value:,.0f} | {value / raw:.2f} |")
        self.stdout.write(f"\nSlot counter after the run: {left} (must be 0).")

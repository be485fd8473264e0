"""``manage.py run_demo``: one greedy merchant floods the imports; who waits?

Runs the same flood twice through a real Celery worker process: first as a plain Celery
task (FIFO), then as a FairTask (at most 2 imports per merchant at once), and prints how
long the small merchants waited and how many of the greedy merchant's imports ran at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess
from shop.models import ImportRun
from shop.tasks import fair_import, plain_import

PROJECT_DIR = Path(__file__).resolve().parents[3]


def peak_concurrency(runs: list[tuple[float, float]]) -> int:
    """The largest number of the intervals open at once."""
    events = sorted([(s, 1) for s, _ in runs] + [(e, -1) for _, e in runs])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


class Command(BaseCommand):
    """Run the fairness demo and print plain Celery against django-fair-jobs."""

    help = "Flood the imports with one greedy merchant, plain Celery vs FairTask."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--greedy-jobs",
            type=int,
            default=60,
            help="Imports the greedy merchant enqueues at once (default 60).",
        )
        parser.add_argument(
            "--small-merchants",
            type=int,
            default=10,
            help="Small merchants enqueueing shortly after (default 10).",
        )
        parser.add_argument(
            "--small-jobs", type=int, default=2, help="Imports per small merchant (default 2)."
        )
        parser.add_argument(
            "--seconds",
            type=float,
            default=0.2,
            help="Duration of one import in seconds (default 0.2).",
        )
        parser.add_argument(
            "--concurrency", type=int, default=4, help="Worker concurrency (default 4)."
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=300,
            help="Give up after this many seconds per mode (default 300).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for name in ("greedy_jobs", "small_merchants", "small_jobs", "concurrency"):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be at least 1.")
        call_command("migrate", verbosity=0)
        self._clean()
        worker = self._start_worker(options["concurrency"])
        try:
            rows = [self._run_mode(mode, options) for mode in ("plain", "fair")]
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:
                worker.kill()
        self._print(rows, options)

    def _clean(self) -> None:
        ImportRun.objects.all().delete()
        SlotLease.objects.all().delete()
        ParkedJob.objects.all().delete()
        TenantQueueSlot.objects.all().delete()
        WorkerProcess.objects.all().delete()
        from example.celery import app

        with app.connection_for_write() as conn:
            for queue in ("imports_plain", "imports"):
                # A queue that does not exist yet has nothing to purge.
                with contextlib.suppress(Exception):
                    conn.default_channel.queue_purge(queue)  # type: ignore[attr-defined]

    def _start_worker(self, concurrency: int) -> subprocess.Popen[bytes]:
        log = Path(settings.DEMO_DIR) / "worker.log"
        self.stdout.write(
            f"Starting a Celery worker (threads pool, concurrency {concurrency}); its log: {log}"
        )
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "example",
                    "worker",
                    "-P",
                    "threads",
                    "-c",
                    str(concurrency),
                    "-Q",
                    "imports_plain,imports",
                    "-l",
                    "INFO",
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                ],
                cwd=PROJECT_DIR,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(PROJECT_DIR)},
            )
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise CommandError(f"The worker did not start; see {log}")
            time.sleep(0.1)
        return proc

    def _run_mode(self, mode: str, options: dict[str, Any]) -> dict[str, Any]:
        task = plain_import if mode == "plain" else fair_import
        seconds = options["seconds"]
        greedy, small_n, per = (
            options["greedy_jobs"],
            options["small_merchants"],
            options["small_jobs"],
        )
        total = greedy + small_n * per
        start = time.time()
        for _ in range(greedy):
            task.delay("greedy-merchant", time.time(), seconds)
        time.sleep(0.3)
        for i in range(small_n):
            for _ in range(per):
                task.delay(f"small-{i:02d}", time.time(), seconds)
        deadline = time.monotonic() + options["timeout"]
        done = shown = 0
        tty = self.stdout.isatty()
        while done < total:
            done = ImportRun.objects.filter(mode=mode, finished_at__isnull=False).count()
            # A live bar on a terminal; a line per quarter when the output is a log.
            if tty or done * 4 // total > shown * 4 // total or done == total:
                bar = "#" * (30 * done // total)
                prefix = "\r" if tty else ""
                self.stdout.write(
                    f"{prefix}  {mode:5} [{bar:30}] {done}/{total} jobs", ending="" if tty else "\n"
                )
                self.stdout.flush()
                shown = done
            if time.monotonic() > deadline:
                raise CommandError(f"{mode}: only {done}/{total} jobs finished in time.")
            time.sleep(0.1)
        if tty:
            self.stdout.write("")
        runs = list(
            ImportRun.objects.filter(mode=mode).values_list(
                "tenant", "enqueued_at", "started_at", "finished_at"
            )
        )
        small_waits = [s - q for t, q, s, _ in runs if t != "greedy-merchant"]
        # Every run has finished here (the loop above waited for it); the filter says so
        # to the type checker.
        ends = [e for *_, e in runs if e is not None]
        greedy_runs = [(s, e) for t, _, s, e in runs if t == "greedy-merchant" and e is not None]
        return {
            "mode": mode,
            "p50": statistics.median(small_waits),
            "p95": percentile(small_waits, 95),
            "max": max(small_waits),
            "greedy_peak": peak_concurrency(greedy_runs),
            "makespan": max(ends) - start,
        }

    def _print(self, rows: list[dict[str, Any]], options: dict[str, Any]) -> None:
        self.stdout.write("")
        self.stdout.write(
            f"Flood: 1 greedy merchant x {options['greedy_jobs']} imports, then "
            f"{options['small_merchants']} small merchants x {options['small_jobs']}; "
            f"{options['seconds']} s each; concurrency {options['concurrency']}."
        )
        self.stdout.write("")
        self.stdout.write(
            "| mode  | small wait p50 | p95     | max     | greedy at once | makespan |"
        )
        self.stdout.write(
            "|-------|----------------|---------|---------|----------------|----------|"
        )
        for r in rows:
            self.stdout.write(
                f"| {r['mode']:5} | {r['p50']:12.2f} s | {r['p95']:5.2f} s | {r['max']:5.2f} s "
                f"| {r['greedy_peak']:14} | {r['makespan']:6.2f} s |"
            )
        plain, fair = rows
        self.stdout.write("")
        self.stdout.write(
            f"Small merchants' p95 wait: {fair['p95']:.2f} s with FairTask vs "
            f"{plain['p95']:.2f} s with plain Celery; the greedy merchant never ran more "
            f"than {fair['greedy_peak']} imports at once (its limit: 2)."
        )
        self.stdout.write("")
        self.stdout.write("Next steps:")
        self.stdout.write(
            "  * Against PostgreSQL and Redis:\n"
            "      DATABASE_URL=postgres://postgres@127.0.0.1:5432/fair_jobs_example \\\n"
            "      CELERY_BROKER_URL=redis://127.0.0.1:6379/0 "
            ".venv/bin/python example_project/manage.py run_demo"
        )
        self.stdout.write(
            "  * The admin (tenant limits, parked jobs, workers):\n"
            "      .venv/bin/python example_project/manage.py createsuperuser\n"
            "      .venv/bin/python example_project/manage.py runserver\n"
            "    then open http://127.0.0.1:8000/admin/fair_jobs/"
        )

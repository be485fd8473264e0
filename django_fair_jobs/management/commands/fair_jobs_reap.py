"""``manage.py fair_jobs_reap``: run one maintenance pass by hand."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_fair_jobs.conf import fair_settings


class Command(BaseCommand):
    """Run one maintenance pass: reap dead workers' leases and fair dispatch's jobs, wake
    parked jobs that can run, and repair fair dispatch's lines."""

    help = (
        "Release the slots held by worker processes silent for FAIR_JOBS_WORKER_TIMEOUT "
        "seconds, put lost wake-ups back in line, wake parked jobs that have room, end "
        "due boosts, and repair fair dispatch (dead workers' jobs back in line or dropped, "
        "as Celery would; lost messages published again; queues with room dispatched). "
        "Workers do this on their own every FAIR_JOBS_HEARTBEAT_INTERVAL; this is for "
        "operators and for deployments with no worker running."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--timeout",
            type=float,
            default=None,
            help="Seconds without heartbeat after which a process is dead "
            "(default: FAIR_JOBS_WORKER_TIMEOUT).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs.maintenance import run_maintenance

        timeout = options["timeout"]
        interval = fair_settings.HEARTBEAT_INTERVAL
        if timeout is not None and timeout < 2 * interval:
            # A shorter threshold would call live workers dead between two beats.
            raise CommandError(
                f"--timeout must be at least twice FAIR_JOBS_HEARTBEAT_INTERVAL "
                f"({2 * interval:g} s), or live workers would be reaped."
            )
        report = run_maintenance(timeout)
        self.stdout.write(
            f"{report.summary()} (timeout {timeout or fair_settings.WORKER_TIMEOUT} s)."
        )

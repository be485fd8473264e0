"""``manage.py fair_jobs_healthcheck``: is django-fair-jobs able to work here?"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_fair_jobs import db


class Command(BaseCommand):
    """Check the database, the migrations, the settings and the workers' heartbeats; one
    ``... OK`` or ``... FAILED`` line each, and a non-zero exit if any failed."""

    help = (
        "Check that the database answers, that every django-fair-jobs migration is "
        "applied, that the FAIR_JOBS_* settings and the fair tasks' fair_* options pass "
        "their system checks, and that worker "
        "nodes beat (with --require-workers: at least one live node). Prints one line per "
        "check and exits non-zero if any fails: usable as a container health check."
    )
    # The system checks are one of its own lines ("settings"), not a refusal to start.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--require-workers",
            action="store_true",
            help="Fail when no worker node has sent a heartbeat within the timeout.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        checks: list[tuple[str, Callable[[], str]]] = [
            ("database", _database),
            ("migrations", _migrations),
            ("settings", _settings),
            ("heartbeats", lambda: _heartbeats(options["require_workers"])),
        ]
        failed = []
        for name, check in checks:
            try:
                detail = check()
            except Exception as exc:
                failed.append(name)
                self.stdout.write(f"{name} FAILED: {exc}")
                if name in ("database", "migrations"):
                    break  # the checks after it read the tables
            else:
                self.stdout.write(f"{name} OK" + (f" ({detail})" if detail else ""))
        if failed:
            raise CommandError(f"health check failed: {', '.join(failed)}")


def _database() -> str:
    from django.db import router

    from django_fair_jobs.models import TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    return f"{alias}, clock {db.database_now(alias):%Y-%m-%d %H:%M:%S}"


def _migrations() -> str:
    from django_fair_jobs import db, dispatch

    db.require_migrated(dispatch.alias())
    return ""


def _settings() -> str:
    from django.core import checks

    errors = [m for m in checks.run_checks(tags=["fair_jobs"]) if m.is_serious()]
    if errors:
        raise RuntimeError("; ".join(f"{m.id}: {m.msg}" for m in errors))
    return ""


def _heartbeats(require_workers: bool) -> str:
    from django_fair_jobs.status import nodes

    found = nodes(db.database_now())
    alive = [n for n in found if n["alive"]]
    dead = len(found) - len(alive)
    if require_workers and not alive:
        raise RuntimeError("no worker node has sent a heartbeat within FAIR_JOBS_WORKER_TIMEOUT")
    note = f"{len(alive)} live node(s)"
    if dead:
        note += f", {dead} presumed dead (their leases are reaped by the next maintenance pass)"
    return note

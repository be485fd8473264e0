"""``manage.py fair_jobs_status``: the admin dashboard as text, or as JSON."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    """Print what the dashboard shows: tenants, queues, planners, worker nodes, the
    fairness index and the totals (see :func:`django_fair_jobs.status.snapshot`)."""

    help = (
        "Show per tenant: per queue its jobs running against the cap in force (boosts), "
        "jobs waiting in fair dispatch's lines, parked and pending, the oldest wait and "
        "reroutes in the last hour; per fair dispatch queue: its capacity and slack, jobs "
        "in flight, room, jobs waiting and scheduled, tenants blocked, jobs failed; per "
        "limited queue: its limits (0: "
        "paused), jobs running in all and per worker node, parked; per planned task: its "
        "last run and each tenant's backlog; worker nodes and their last heartbeat; Jain's "
        "fairness index of the small tenants' waits; totals. Ages use the database clock."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Machine-readable output.")

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs import db, dispatch
        from django_fair_jobs.errors import NotMigratedError
        from django_fair_jobs.status import as_text, snapshot

        try:
            db.require_migrated(dispatch.alias())
        except NotMigratedError as exc:
            raise CommandError(str(exc)) from None
        snap = snapshot()
        if options["json"]:
            self.stdout.write(json.dumps(snap, indent=2))
        else:
            self.stdout.write(as_text(snap))

"""``manage.py fair_jobs_explain TASK_ID``: where a job is and why it has not started."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    """Print :func:`django_fair_jobs.explain` for one or more task ids."""

    help = (
        "Say where each TASK_ID is and why: under fair dispatch scheduled, waiting in its "
        "tenant's line (the jobs ahead of it, its cap, the queue's room), dispatched, "
        "running or failed; running (node, since when, slots held), "
        "reserved or woken (on its way through the broker), parked (behind which tenant "
        "slot or queue limit, held by which jobs, its place in line), pending, promoted "
        "or failed by the planner (place, weight, last run, backpressure; the publish "
        "error of a failed one), rerouted (which rule, the "
        "count), shadow-mode decisions; finished (the result backend's end state), queued "
        "(found in a Redis broker), or unknown."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("task_ids", nargs="+", metavar="TASK_ID")
        parser.add_argument("--json", action="store_true", help="Machine-readable output.")

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs.explanations import explain

        found = [explain(task_id) for task_id in options["task_ids"]]
        if options["json"]:
            data: Any = [f.as_dict() for f in found]
            self.stdout.write(json.dumps(data[0] if len(data) == 1 else data, indent=2))
        else:
            self.stdout.write("\n\n".join(str(f) for f in found))

"""``manage.py fair_jobs_plan``: run fair planners by hand."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    """Run the planner of one planned task, or of all, now."""

    help = (
        "Promote planned jobs now: runs the planner of TASK (or of every task with a "
        "fair_plan) once, even if its next run is not due, unless another run holds its "
        "lock. Workers run planners on their own; this is for operators and tests. "
        "--requeue-promoted SECONDS first puts the jobs promoted more than SECONDS ago "
        "and not started back in line (after a celery purge: 0), so that the run "
        "publishes them again instead of waiting for a planner run to presume them lost "
        "(at least an hour after their promotion)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("task", nargs="?", metavar="TASK")
        parser.add_argument(
            "--requeue-promoted",
            metavar="SECONDS",
            dest="requeue",
            help="First put the jobs promoted more than SECONDS ago and not started back in "
            "line (0 after a celery purge).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs.planner import planned_tasks, run
        from django_fair_jobs.planner import store as planner_store

        tasks = [t for t in planned_tasks() if options["task"] in (None, t.name)]
        if options["task"] and not tasks:
            raise CommandError(f"No task named {options['task']!r} has a fair_plan.")
        older_than = None
        if options["requeue"] is not None:
            try:
                older_than = float(options["requeue"])
            except ValueError:
                older_than = -1.0
            if not 0 <= older_than < float("inf"):
                raise CommandError(
                    "--requeue-promoted wants seconds >= 0 (0: every promoted job not "
                    f"started, as after a celery purge); got {options['requeue']!r}."
                )
        for task in tasks:
            if older_than is not None:
                back = planner_store.requeue_stale(task.name, older_than)
                self.stdout.write(f"{task.name}: {back} promoted job(s) put back in line")
            report = run(task, due_only=False)
            if report is None:
                self.stdout.write(f"{task.name}: another run holds the lock; nothing done")
            elif report.skipped_for_backpressure:
                self.stdout.write(
                    f"{task.name}: queue latency {report.latency:.1f} s is above the "
                    "threshold; nothing promoted"
                )
            else:
                self.stdout.write(f"{task.name}: promoted {report.promoted} job(s)")

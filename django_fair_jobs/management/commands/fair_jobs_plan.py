"""``manage.py fair_jobs_plan``: run fair planners by hand."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    """Run the planner of one planned task, or of all, now."""

    help = (
        "Promote planned jobs now: runs the planner of TASK (or of every task with a "
        "fair_plan) once, even if its next run is not due, unless another run holds its "
        "lock. Workers run planners on their own; this is for operators and tests."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("task", nargs="?", metavar="TASK")

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs.planner import planned_tasks, run

        tasks = [t for t in planned_tasks() if options["task"] in (None, t.name)]
        if options["task"] and not tasks:
            raise CommandError(f"No task named {options['task']!r} has a fair_plan.")
        for task in tasks:
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

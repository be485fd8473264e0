"""``manage.py fair_jobs_status``: what the queue limits are doing, as text or JSON."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    """Print every limited queue (limits, jobs running by node, parked, oldest parked age)
    and every planner (last run, and per tenant jobs pending and the oldest's age)."""

    help = (
        "Show, per queue with stored limits: the cluster-wide and per-worker limits (0: "
        "paused), jobs running in all and on each worker node, jobs parked in its line and "
        "how long the oldest has waited (database clock); per planned task, its last run "
        "and each tenant's pending jobs and oldest wait."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Machine-readable output.")

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs.limits import queue_status
        from django_fair_jobs.planner import status as planner_status

        queues = queue_status()
        planners = planner_status()
        if options["json"]:
            self.stdout.write(json.dumps({"queues": queues, "planners": planners}, indent=2))
            return
        if not queues:
            self.stdout.write("No queue limits stored (see fair_jobs_limit).")
        for plan in planners:
            skipped = " (skipped: queue latency above threshold)"
            self.stdout.write(
                f"planner {plan['task']}: last run {plan['last_run_at'] or 'never'}, promoted "
                f"{plan['last_promoted'] or 0}"
                + (skipped if plan["last_skipped_for_backpressure"] else "")
            )
            for t in plan["tenants"]:
                oldest = t["oldest_pending_seconds"]
                wait = "" if oldest is None else f", oldest waiting {oldest:g} s"
                paused = " PAUSED" if t["paused"] else ""
                self.stdout.write(f"    {t['tenant']}{paused}: {t['pending']} pending{wait}")
        for q in queues:
            paused = " PAUSED" if q["paused"] else ""
            self.stdout.write(
                f"{q['queue']}{paused}: global {_show(q['max_jobs'])}, per worker "
                f"{_show(q['max_jobs_per_worker'])}; running {q['running']}"
            )
            for node, n in q["running_by_node"].items():
                self.stdout.write(f"    {node}: {n} running")
            oldest = q["oldest_parked_seconds"]
            wait = "" if oldest is None else f", oldest waiting {oldest:g} s"
            self.stdout.write(
                f"    parked {q['parked']}{wait}; deferred ever {q['deferred_total']}"
            )


def _show(limit: int | None) -> str:
    return "none" if limit is None else str(limit)

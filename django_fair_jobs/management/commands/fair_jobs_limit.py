"""``manage.py fair_jobs_limit``: read and change queue limits at runtime."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_fair_jobs.limits import LimitError


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise CommandError(
            f"A limit must be a whole number >= 0 (0 pauses the queue); got {text!r}. "
            "Use --clear to remove a queue's limits."
        )
    return value


class Command(BaseCommand):
    """Set, clear, show or reset the stored limits of queues."""

    help = (
        "Show or change how many jobs of QUEUE run at once: --global across every worker "
        "node, --per-worker on each node (0 pauses the queue). Changes apply at once, wake "
        "parked jobs, and survive restarts: FAIR_JOBS_QUEUE_LIMITS and "
        "FAIR_JOBS_QUEUE_PROCESS_LIMITS only seed queues with nothing stored. --clear "
        "removes QUEUE's limits; --reset makes the stored limits (of QUEUE, or of every "
        "queue) what the settings say. With no option, prints the limits."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queue", nargs="?", metavar="QUEUE")
        parser.add_argument("--global", dest="max_jobs", metavar="N", type=str)
        parser.add_argument("--per-worker", dest="per_worker", metavar="N", type=str)
        parser.add_argument("--clear", action="store_true", help="No limit on QUEUE.")
        parser.add_argument(
            "--reset", action="store_true", help="Stored limits back to the settings."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs import limits
        from django_fair_jobs.models import QueueLimit

        queue = options["queue"]
        changes: dict[str, Any] = {}
        if options["max_jobs"] is not None:
            changes["max_jobs"] = _limit(options["max_jobs"])
        if options["per_worker"] is not None:
            changes["max_jobs_per_worker"] = _limit(options["per_worker"])
        if options["clear"]:
            if changes:
                raise CommandError("--clear cannot be combined with --global or --per-worker.")
            changes = {"max_jobs": None, "max_jobs_per_worker": None}
        if options["reset"]:
            if changes:
                raise CommandError("--reset cannot be combined with other changes.")
            rows = limits.reset([queue] if queue else None)
        elif changes:
            if not queue:
                raise CommandError(
                    "Name the QUEUE to change, e.g. fair_jobs_limit webhooks --global 2."
                )
            try:
                rows = [limits.set_limits(queue, **changes)]
            except LimitError as exc:
                raise CommandError(str(exc)) from None
        else:
            stored = QueueLimit.objects.order_by("queue")
            rows = list(stored.filter(queue=queue) if queue else stored)
            if queue and not rows:
                self.stdout.write(f"{queue}: no limit stored")
        for row in rows:
            self.stdout.write(
                f"{row.queue}: global {_show(row.max_jobs)}, per worker "
                f"{_show(row.max_jobs_per_worker)}"
            )


def _show(limit: int | None) -> str:
    if limit is None:
        return "none"
    return "0 (paused)" if limit == 0 else str(limit)

"""``manage.py fair_jobs_limit``: read and change queue limits and tenant limits (and
boosts) at runtime; every change goes into the limit history."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_fair_jobs import db
from django_fair_jobs.conf import MAX_LIMIT, is_limit
from django_fair_jobs.management import command_user
from django_fair_jobs.queue_limits import LimitError


def _limit(text: str, of: str = "queue") -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not is_limit(value):
        remove = (
            "Use --clear to remove a queue's limits."
            if of == "queue"
            else "Use --max-jobs default for the task's own limit."
        )
        raise CommandError(
            f"A limit must be a whole number from 0 (0 pauses the {of}) to {MAX_LIMIT}; "
            f"got {text!r}. {remove}"
        )
    return value


class Command(BaseCommand):
    """Set, clear, show or reset the stored limits of queues; set a tenant's limit on a
    queue, or boost it for a while."""

    help = (
        "Show or change how many jobs of QUEUE run at once: --max-jobs across every worker "
        "node, --per-worker on each node (0 pauses the queue). Changes apply at once, wake "
        "parked jobs, and survive restarts: FAIR_JOBS_QUEUE_LIMITS and "
        "FAIR_JOBS_QUEUE_LIMITS_PER_WORKER only seed queues with nothing stored. --clear "
        "removes QUEUE's limits; --reset makes the stored limits (of QUEUE, or of every "
        "queue) what the settings say. With no option, prints the limits. With --tenant T: "
        "--max-jobs N sets T's limit on QUEUE (--max-jobs default: the task's), --boost N "
        "--for SECONDS (or --until ISO-TIME) raises it for a while, then it comes back by "
        "itself."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queue", nargs="?", metavar="QUEUE")
        parser.add_argument(
            "--per-worker",
            dest="per_worker",
            metavar="N",
            type=str,
            help="Jobs of QUEUE at once on each worker node (0 pauses).",
        )
        parser.add_argument("--clear", action="store_true", help="No limit on QUEUE.")
        parser.add_argument(
            "--reset", action="store_true", help="Stored limits back to the settings."
        )
        parser.add_argument("--tenant", metavar="TENANT", help="Change this tenant's limit.")
        parser.add_argument(
            "--max-jobs",
            dest="max_jobs",
            metavar="N|default",
            help="Jobs of QUEUE at once across the cluster (0 pauses); with --tenant, that "
            "tenant's limit on QUEUE (default: its task's own).",
        )
        parser.add_argument("--boost", metavar="N", help="Temporary limit of --tenant.")
        parser.add_argument(
            "--for", dest="boost_for", metavar="SECONDS", type=float, help="How long --boost lasts."
        )
        parser.add_argument(
            "--until",
            dest="boost_until",
            metavar="ISO-TIME",
            help="When --boost ends, with its time zone (e.g. 2026-11-22T18:00+00:00).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs import queue_limits
        from django_fair_jobs.models import QueueLimit

        queue = options["queue"]
        if options["tenant"] is not None:
            self._tenant(queue, options)
            return
        if options["boost"]:
            raise CommandError("--boost needs --tenant.")
        changes: dict[str, Any] = {}
        if options["max_jobs"] is not None:
            changes["max_jobs"] = _limit(options["max_jobs"])
        if options["per_worker"] is not None:
            changes["max_jobs_per_worker"] = _limit(options["per_worker"])
        if options["clear"]:
            if changes:
                raise CommandError("--clear cannot be combined with --max-jobs or --per-worker.")
            changes = {"max_jobs": None, "max_jobs_per_worker": None}
        if options["reset"]:
            if changes:
                raise CommandError("--reset cannot be combined with other changes.")
            rows = queue_limits.reset(
                [queue] if queue else None, user=command_user(), source="command"
            )
        elif changes:
            if not queue:
                raise CommandError(
                    "Name the QUEUE to change, e.g. fair_jobs_limit webhooks --max-jobs 2."
                )
            try:
                rows = [
                    queue_limits.set_limits(queue, **changes, user=command_user(), source="command")
                ]
            except LimitError as exc:
                raise CommandError(str(exc)) from None
        else:
            stored = QueueLimit.objects.order_by("queue")
            rows = list(stored.filter(queue=queue) if queue else stored)
            if queue and not rows:
                self.stdout.write(f"{queue}: no limit stored")
        for row in rows:
            self.stdout.write(
                f"{row.queue}: max_jobs {_show(row.max_jobs)}, max_jobs_per_worker "
                f"{_show(row.max_jobs_per_worker)}"
            )

    def _tenant(self, queue: str | None, options: dict[str, Any]) -> None:
        from django_fair_jobs import slots
        from django_fair_jobs.models import TenantQueueSlot

        tenant = options["tenant"]
        flags = (("--per-worker", "per_worker"), ("--clear", "clear"), ("--reset", "reset"))
        queue_only = [flag for flag, key in flags if options.get(key)]
        if queue_only:
            raise CommandError(
                f"{', '.join(queue_only)} change a queue's limits, not a tenant's; with "
                "--tenant use --max-jobs N|default or --boost N --for SECONDS."
            )
        if options["boost"] is None and (options["boost_for"] is not None
                                         or options["boost_until"]):  # fmt: skip
            raise CommandError("--for and --until give a boost's end: use them with --boost N.")
        if not queue:
            raise CommandError(
                "Name the QUEUE, e.g. fair_jobs_limit imports --tenant acme --max-jobs 4."
            )
        boost, raw_max = options["boost"], options["max_jobs"]
        try:
            if boost is not None:
                if raw_max is not None:
                    raise CommandError("--boost cannot be combined with --max-jobs.")
                row = slots.boost(
                    tenant,
                    queue,
                    _limit(boost, "tenant"),
                    _boost_end(options),
                    user=command_user(),
                    source="command",
                )
            elif raw_max is not None:
                value = None if raw_max == "default" else _limit(raw_max, "tenant")
                row = slots.set_tenant_limit(
                    tenant, queue, value, user=command_user(), source="command"
                )
            else:
                found = TenantQueueSlot.objects.filter(tenant=tenant, queue=queue).first()
                if found is None:
                    self.stdout.write(f"{tenant} on {queue}: no slot row (the task's default)")
                    return
                row = found
        except slots.TenantLimitError as exc:
            raise CommandError(str(exc)) from None
        boosted = "" if row.boost_until is None else f" (boosted until {row.boost_until})"
        override = "the task's default" if row.max_jobs is None else _show(row.max_jobs)
        self.stdout.write(f"{tenant} on {queue}: max_jobs {override}{boosted}")


def _boost_end(options: dict[str, Any]) -> datetime:
    """When a ``--boost`` ends: ``--for SECONDS`` from now (the database's clock) or
    ``--until ISO-TIME``."""
    if options["boost_for"] is not None:
        return db.database_now() + timedelta(seconds=options["boost_for"])
    if not options["boost_until"]:
        raise CommandError("--boost needs --for SECONDS or --until ISO-TIME.")
    try:
        until = datetime.fromisoformat(options["boost_until"])
    except ValueError:
        until = None
    if until is None or until.tzinfo is None:
        # A time without its zone is refused rather than read in one the operator did not
        # mean: the boost would end hours early or late.
        raise CommandError(
            f"--until wants an ISO time with its time zone, like 2026-11-22T18:00+00:00; "
            f"got {options['boost_until']!r}."
        )
    return until


def _show(limit: int | None) -> str:
    if limit is None:
        return "none"
    return "0 (paused)" if limit == 0 else str(limit)

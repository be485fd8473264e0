"""``manage.py fair_jobs_cancel TENANT``: cancel a tenant's waiting jobs (its flood);
``--failed``: only the failed jobs of fair dispatch, of a tenant or of every tenant."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_fair_jobs import backlog


class Command(BaseCommand):
    """Cancel (:func:`django_fair_jobs.backlog.cancel`) a tenant's waiting jobs, or
    (:func:`django_fair_jobs.backlog.cancel_failed`) fair dispatch's failed jobs."""

    help = (
        "Cancel every job of TENANT that waits for its turn (in fair dispatch's line, "
        "parked, or in a planner's virtual queue) or failed (in fair dispatch or a "
        "planner's virtual queue), on --queue Q or every queue, of --task "
        "NAME or every task, --batch N rows at a time. With --failed, only fair "
        "dispatch's failed jobs, of TENANT or (without one) of every tenant; the jobs "
        "waiting stay. Their results become REVOKED and the cancel goes into the limit "
        "history. Jobs in the broker or running are left alone (revoke those). --dry-run "
        "prints what would be cancelled."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("tenant", metavar="TENANT", nargs="?")
        parser.add_argument("--queue", metavar="QUEUE", help="Only this queue's jobs.")
        parser.add_argument("--task", metavar="NAME", help="Only this task's jobs.")
        parser.add_argument(
            "--failed",
            action="store_true",
            help="Only fair dispatch's failed jobs (of every tenant without TENANT).",
        )
        parser.add_argument(
            "--batch",
            metavar="N",
            default=str(backlog.BATCH),
            help="At most N jobs per place (line, parked, planned) and queue in each "
            f"transaction (default {backlog.BATCH}).",
        )
        parser.add_argument("--reason", default="", help="Kept in the history.")
        parser.add_argument("--dry-run", action="store_true", help="Count, change nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        from django_fair_jobs.management import command_user

        tenant, queue, task = options["tenant"], options["queue"], options["task"]
        if tenant is None and not options["failed"]:
            raise CommandError("Name a TENANT, or --failed for every tenant's failed jobs.")
        try:
            batch = int(options["batch"])
        except ValueError:
            batch = 0
        if batch < 1:
            raise CommandError(f"--batch wants a whole number >= 1; got {options['batch']!r}.")
        if options["failed"]:
            self._cancel_failed(tenant, queue, task, batch, options, command_user())
            return
        if options["dry_run"]:
            self.stdout.write(f"Would cancel {backlog.count(tenant, queue=queue, task=task)}")
            return
        done = backlog.cancel(
            tenant, queue=queue, task=task, batch=batch, user=command_user(), source="command",
            reason=options["reason"],
        )  # fmt: skip
        self.stdout.write(f"Cancelled {done} in {done.batches} batch(es)")
        if done.unmarked:
            self.stderr.write(
                f"{done.unmarked} of them could not be marked REVOKED in the result backend "
                "(see the log): their AsyncResult stays PENDING."
            )

    def _cancel_failed(
        self, tenant: str | None, queue: str | None, task: str | None, batch: int,
        options: dict[str, Any], user: str,
    ) -> None:  # fmt: skip
        ids = backlog.failed_ids(tenant, queue=queue, task=task)
        which = backlog.scope(tenant, queue, task)
        if options["dry_run"]:
            self.stdout.write(f"Would cancel {len(ids)} failed job(s) {which}")
            return
        done = backlog.cancel_failed(
            ids, batch=batch, user=user, source="command", reason=options["reason"]
        )
        self.stdout.write(f"Cancelled {done} failed job(s) {which}; their results are REVOKED")

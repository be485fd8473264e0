"""The planner's storage: virtual queues (store, claim and promote, mark started, measure)
and the planner's run lock."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import (
    models,
    router,
    transaction,
)
from django.db.models import F, Q
from django.db.models.functions import Now

from django_fair_jobs import db
from django_fair_jobs.planner import store_orm

if TYPE_CHECKING:
    from django_fair_jobs.models import PlannedJob


_ERROR_CHARS = 2000
"""The most of a failed publish's error a planned row keeps (a refused message's error can
quote the message)."""


def pending(task_name: str) -> dict[str, tuple[int, datetime]]:
    """``{tenant: (jobs waiting, oldest enqueue)}`` of ``task_name``'s virtual queues,
    counting only jobs due now (no ``not_before`` in the future) and not failed."""
    from django_fair_jobs.models import PlannedJob

    rows = (
        PlannedJob.objects.filter(
            task_name=task_name, promoted_at__isnull=True, failed_at__isnull=True
        )
        .filter(Q(not_before__isnull=True) | Q(not_before__lte=Now()))
        .values("tenant")
        .annotate(n=models.Count("pk"), oldest=models.Min("enqueued_at"))
        .values_list("tenant", "n", "oldest")
    )
    return {tenant: (n, oldest) for tenant, n, oldest in rows}


def promote(
    task_name: str,
    tenant: str,
    count: int,
    publish: Callable[[PlannedJob], None],
    *,
    transient: Callable[[BaseException], bool] = lambda exc: True,
    max_attempts: int = 0,
    gave_up: Callable[[PlannedJob, BaseException], None] | None = None,
) -> list[str]:
    """Claim up to ``count`` of ``tenant``'s oldest due jobs (rows another planner holds
    are skipped, never waited for; failed rows are left out), ``publish`` each, then mark
    the published ones promoted, all in one transaction. Returns the task ids promoted.

    An error that ``transient`` says is passing (the broker or the database is
    unreachable; by default any error) rolls the whole batch back and is raised: every claimed job
    stays in line for the next run (at-least-once), and nothing is counted against the
    jobs. Any other error is the job's own (a serializer refuses it, the broker refuses
    its size): each publish runs in a savepoint, so the failure undoes only that job's
    writes; the job counts an attempt and keeps the error, the rest of the batch goes
    on, and at ``max_attempts`` (0: never) the job is failed for good and, after the
    commit, handed to ``gave_up``."""
    from django_fair_jobs.models import PlannedJob

    failed_for_good: list[tuple[PlannedJob, BaseException]] = []
    with transaction.atomic(using=router.db_for_write(PlannedJob)):
        rows = list(
            PlannedJob.objects.select_for_update(skip_locked=True)
            .filter(task_name=task_name, tenant=tenant, promoted_at__isnull=True)
            .filter(failed_at__isnull=True)
            .filter(Q(not_before__isnull=True) | Q(not_before__lte=Now()))
            .order_by("id")[:count]
        )
        published = []
        for row in rows:
            try:
                with transaction.atomic(using=router.db_for_write(PlannedJob)):
                    publish(row)
            except Exception as exc:
                if transient(exc):
                    raise
                row.attempts += 1
                row.last_error = f"{exc.__class__.__name__}: {exc}"[:_ERROR_CHARS]
                gives_up = 0 < max_attempts <= row.attempts
                PlannedJob.objects.filter(pk=row.pk).update(
                    attempts=row.attempts,
                    last_error=row.last_error,
                    failed_at=Now() if gives_up else None,
                )
                if gives_up:
                    failed_for_good.append((row, exc))
                continue
            published.append(row)
        PlannedJob.objects.filter(pk__in=[row.pk for row in published]).update(promoted_at=Now())
    for job, error in failed_for_good:
        if gave_up is not None:
            gave_up(job, error)
    return [row.task_id for row in published]


def put_back_failed(rows: models.QuerySet[PlannedJob]) -> int:
    """Put failed jobs among ``rows`` back in line, in their old place, with their
    attempts cleared (``last_error`` is kept until they are published); returns how
    many. For an operator who removed the cause (raised the broker's size limit)."""
    return rows.filter(failed_at__isnull=False).update(failed_at=None, attempts=0)


def requeue_stale(task_name: str, older_than: float) -> int:
    """Put ``task_name``'s jobs promoted more than ``older_than`` seconds ago (database
    clock) and never started back in line, in their old place: their message is
    presumed lost (a purged queue), or their start failed to delete the row. The next
    promotion publishes them again with the same task id (at least once). Returns
    how many."""
    from django_fair_jobs.models import PlannedJob

    cutoff = db.database_now(router.db_for_write(PlannedJob)) - timedelta(seconds=older_than)
    return PlannedJob.objects.filter(task_name=task_name, promoted_at__lt=cutoff).update(
        promoted_at=None
    )


def cancel(tenant: str, queue: str | None, task_name: str | None, limit: int) -> list[str]:
    """Delete up to ``limit`` of ``tenant``'s planned jobs not promoted (pending, or failed)
    on ``queue`` (or every queue), of ``task_name`` (or every task), oldest first; returns
    their task ids. A row a planner run is promoting is left to it: the DELETE re-checks
    ``promoted_at`` once that run commits."""
    from django_fair_jobs.models import PlannedJob

    rows = PlannedJob.objects.filter(tenant=tenant, promoted_at__isnull=True)
    if queue is not None:
        rows = rows.filter(queue=queue)
    if task_name is not None:
        rows = rows.filter(task_name=task_name)
    picked = dict(rows.order_by("id").values_list("id", "task_id")[:limit])
    if not picked:
        return []
    with transaction.atomic(using=router.db_for_write(PlannedJob)):
        gone = PlannedJob.objects.filter(pk__in=list(picked), promoted_at__isnull=True)
        ids = list(gone.values_list("id", flat=True))
        gone.delete()
    return [str(picked[pk]) for pk in ids]


def latency(task_name: str, stale_after: float | None = None) -> tuple[float | None, int]:
    """The latency of the queues ``task_name``'s jobs go to: the age in seconds
    (database clock) of the oldest job promoted to any of them and not started yet (of
    any planned task), or None; and how many such jobs there are (their depth). Rows
    promoted more than ``stale_after`` seconds ago do not count: a row left behind
    never holds the queue back for good (see :meth:`requeue_stale`)."""
    from django_fair_jobs.models import PlannedJob

    now = db.database_now(router.db_for_write(PlannedJob))
    queues = PlannedJob.objects.filter(task_name=task_name).values("queue").distinct()
    promoted = PlannedJob.objects.filter(queue__in=queues, promoted_at__isnull=False)
    if stale_after is not None:
        promoted = promoted.filter(promoted_at__gte=now - timedelta(seconds=stale_after))
    found = promoted.aggregate(oldest=models.Min("promoted_at"), depth=models.Count("pk"))
    if found["oldest"] is None:
        return None, 0
    age = (now - found["oldest"]).total_seconds()
    return max(age, 0.0), int(found["depth"])


def started(task_id: str) -> bool:
    """A job of a planned task starts (or was revoked): its row goes. False if there
    was none (a retry, or a second copy of a job promoted twice)."""
    from django_fair_jobs.models import PlannedJob

    deleted, _ = PlannedJob.objects.filter(task_id=task_id).delete()
    return bool(deleted)


def claim_run(task_name: str, *, interval: float, lock_ttl: float) -> uuid.UUID | None:
    """Take ``task_name``'s planner lock for ``lock_ttl`` seconds if its next run is due
    and nobody holds the lock; schedule the next run ``interval`` seconds on. Returns the
    lock token, or None. One conditional UPDATE: two callers cannot both win."""
    from django_fair_jobs.models import PlannedJob

    alias = router.db_for_write(PlannedJob)
    if not db.uses_sql(alias):
        return store_orm.claim_run(task_name, interval=interval, lock_ttl=lock_ttl)
    token = uuid.uuid4()
    params = {"task_name": task_name, "interval": interval, "ttl": lock_ttl, "token": token}
    return token if db.run(alias, "claim_planner", params) else None


def finish_run(task_name: str, token: uuid.UUID, **outcome: Any) -> None:
    """Record what a run did and release its lock, only if this run still holds it."""
    from django_fair_jobs.models import PlannerRun

    PlannerRun.objects.filter(task_name=task_name, lock_token=token).update(
        locked_until=None, lock_token=None, runs_total=F("runs_total") + 1, **outcome
    )

"""Cancel a tenant's backlog: every job of a tenant that waits for its turn, on one queue or
all, of one task or all, in bounded batches; and failed jobs picked one by one.

A waiting job is one the library holds and no worker runs: in fair dispatch (scheduled,
waiting in its line, or failed), parked behind a tenant slot or a queue limit (not woken),
or in a planner's virtual queue (pending or failed). A failed job (its publish failed too
often, or a worker rejected it as a task it does not know) runs only if an operator puts
it back in line; cancelling it discards it. Each batch deletes at most
``batch`` rows per place and queue, each in its own short transaction that keeps the
counters true, so a flood of 300,000 jobs is cancelled without one long lock. Each
cancelled job's result is marked ``REVOKED`` in the result backend, so ``AsyncResult``
says so; the cancel is one line of the limit history.

Jobs already in the broker or running are not touched: revoke them with Celery.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django_fair_jobs import dispatch, events
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.planner import store as planner_store

logger = logging.getLogger("django_fair_jobs.backlog")

BATCH = 1000
"""Rows one batch deletes at most, per place (line, parked, planned) and queue."""

ALL_QUEUES = "*"
"""The history's queue when a cancel covered every queue."""


@dataclass
class Cancelled:
    """What a cancel did (or, with ``dry_run``, would do): jobs cancelled per place."""

    tenant: str
    queue: str | None
    task: str | None
    dispatch: int = 0
    failed: int = 0
    """Of :attr:`dispatch`, the jobs that had failed (see the admin's failed jobs)."""
    parked: int = 0
    planned: int = 0
    batches: int = 0
    unmarked: int = 0
    """Cancelled jobs whose REVOKED state the result backend did not take (logged)."""
    task_ids: list[str] = field(default_factory=list, repr=False)

    @property
    def total(self) -> int:
        """Jobs cancelled in all."""
        return self.dispatch + self.parked + self.planned

    def __str__(self) -> str:
        failed = f" ({self.failed} of them failed)" if self.failed else ""
        return (
            f"{self.total} waiting job(s) {scope(self.tenant, self.queue, self.task)}: "
            f"{self.dispatch} in fair dispatch{failed}, {self.parked} parked, "
            f"{self.planned} planned"
        )


def scope(tenant: str | None, queue: str | None, task: str | None) -> str:
    """Which jobs a cancel takes, in words: ``of TENANT on QUEUE of TASK``, each None
    read as every one."""
    return (
        f"of {tenant if tenant is not None else 'every tenant'} "
        f"on {queue or 'every queue'} of {task or 'every task'}"
    )


def _batch_of(cancelled: Cancelled, tenant: str, queue: str | None, task: str | None,
              batch: int) -> list[str]:  # fmt: skip
    ids: list[str] = []
    for line in [queue] if queue is not None else dispatch.lines_of(tenant):
        gone = dispatch.cancel(line, tenant, task, batch)
        cancelled.dispatch += len(gone)
        cancelled.failed += sum(1 for _, failed in gone if failed)
        ids += [task_id for task_id, _ in gone]
    found = lease_store.drop_parked_of(tenant, queue, task, batch)
    cancelled.parked += len(found)
    ids += found
    found = planner_store.cancel(tenant, queue, task, batch)
    cancelled.planned += len(found)
    return ids + found


def _mark_revoked(task_ids: list[str], reason: str) -> int:
    """Mark each job REVOKED in the result backend; returns how many it refused."""
    from celery import current_app

    backend = current_app.backend
    refused = 0
    for task_id in task_ids:
        try:
            backend.mark_as_revoked(task_id, reason)
        except Exception:
            refused += 1
            logger.warning("Could not mark cancelled job %s revoked", task_id, exc_info=True)
    return refused


def cancel(
    tenant: str,
    *,
    queue: str | None = None,
    task: str | None = None,
    batch: int = BATCH,
    user: str = "",
    source: str = "python",
    reason: str = "",
) -> Cancelled:
    """Cancel ``tenant``'s waiting jobs on ``queue`` (None: every queue) of ``task`` (a
    task name; None: every task), ``batch`` rows at a time, until none is left; see the
    module's docstring. ``user``, ``source`` and ``reason`` go into the history."""
    from django_fair_jobs.models import LimitChange

    _check_batch(batch)
    cancelled = Cancelled(tenant, queue, task)
    # A tenant still enqueueing could keep every batch full: stop after the batches that
    # the backlog found at the start needs (the jobs enqueued meanwhile may go with them).
    rounds = -(-count(tenant, queue=queue, task=task).total // batch) + 1
    for _ in range(rounds):
        ids = _batch_of(cancelled, tenant, queue, task, batch)
        if not ids:
            break
        cancelled.batches += 1
        cancelled.unmarked += _mark_revoked(ids, reason or "cancelled with the tenant's backlog")
        cancelled.task_ids += ids
    if cancelled.total:
        LimitChange.record(
            queue=queue or ALL_QUEUES, field="cancelled", old=None, new=cancelled.total,
            tenant=tenant, user=user, source=source,
            note=(f"{cancelled.dispatch} in fair dispatch ({cancelled.failed} failed), "
                  f"{cancelled.parked} parked, "
                  f"{cancelled.planned} planned" + (f" of {task}" if task else "")
                  + (f": {reason}" if reason else "")),
        )  # fmt: skip
        # INFO: the history row keeps it, and a project without LOGGING would print a
        # WARNING on stderr beside the command's own line.
        logger.info("Cancelled %s", cancelled)
    if cancelled.dispatch:
        # A line blocked at the cap of the task whose jobs were cancelled may now lead
        # with a job of another task: unblocked and dispatched (after the caller's
        # transaction commits, as for a limit changed).
        events.limit_changed.send(sender=LimitChange, tenant=tenant, queue=queue, app=None)
    return cancelled


def count(tenant: str, *, queue: str | None = None, task: str | None = None) -> Cancelled:
    """What :func:`cancel` would cancel now, without changing anything."""
    from django_fair_jobs.dispatch.models import FAILED, SCHEDULED, WAITING, DispatchJob
    from django_fair_jobs.models import ParkedJob, PlannedJob

    lines = DispatchJob.objects.filter(tenant=tenant, state__in=[SCHEDULED, WAITING, FAILED])
    parked = ParkedJob.objects.filter(slot__tenant=tenant, woken_at__isnull=True)
    planned = PlannedJob.objects.filter(tenant=tenant, promoted_at__isnull=True)
    if queue is not None:
        lines, parked = lines.filter(queue=queue), parked.filter(slot__queue=queue)
        planned = planned.filter(queue=queue)
    if task is not None:
        lines, parked = lines.filter(task_name=task), parked.filter(task_name=task)
        planned = planned.filter(task_name=task)
    failed = lines.filter(state=FAILED).count()
    return Cancelled(tenant, queue, task, lines.count(), failed, parked.count(), planned.count())


def _check_batch(batch: object) -> None:
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a whole number >= 1, got {batch!r}.")


def failed_ids(
    tenant: str | None = None, *, queue: str | None = None, task: str | None = None
) -> list[int]:
    """The row ids of fair dispatch's failed jobs of ``tenant`` (None: every tenant) on
    ``queue`` (None: every queue) of ``task`` (None: every task), oldest first: what
    :func:`cancel_failed` takes."""
    from django_fair_jobs.dispatch.models import FAILED, DispatchJob

    rows = DispatchJob.objects.using(dispatch.alias()).filter(state=FAILED)
    for name, value in (("tenant", tenant), ("queue", queue), ("task_name", task)):
        if value is not None:
            rows = rows.filter(**{name: value})
    return list(rows.order_by("id").values_list("pk", flat=True))


def cancel_failed(
    job_ids: list[int],
    *,
    batch: int = BATCH,
    user: str = "",
    source: str = "python",
    reason: str = "",
) -> int:
    """Cancel the failed jobs of fair dispatch among the rows ``job_ids`` (the rest are
    left alone), ``batch`` rows per transaction: each is discarded, one line of the
    history is written per tenant and queue, then each result is marked ``REVOKED``. A
    failed job is in no line and holds no room, so no count changes. Returns how many
    were cancelled."""
    _check_batch(batch)
    cancelled = 0
    for at in range(0, len(job_ids), batch):
        cancelled += _cancel_failed_batch(job_ids[at : at + batch], user, source, reason)
    return cancelled


def _cancel_failed_batch(job_ids: list[int], user: str, source: str, reason: str) -> int:
    from django.db import transaction

    from django_fair_jobs.dispatch.models import FAILED, DispatchJob
    from django_fair_jobs.models import LimitChange

    jobs = DispatchJob.objects.using(dispatch.alias())
    with transaction.atomic(using=dispatch.alias()):
        rows = jobs.select_for_update().filter(pk__in=job_ids, state=FAILED)
        found = list(rows.values_list("pk", "task_id", "tenant", "queue"))
        jobs.filter(pk__in=[pk for pk, _, _, _ in found]).delete()
    per_line: dict[tuple[str, str], int] = {}
    for _, _, tenant, queue in found:
        per_line[tenant, queue] = per_line.get((tenant, queue), 0) + 1
    for (tenant, queue), n in sorted(per_line.items()):
        LimitChange.record(
            queue=queue, field="cancelled", old=None, new=n, tenant=tenant, user=user,
            source=source, note=f"{n} failed in fair dispatch" + (f": {reason}" if reason else ""),
        )  # fmt: skip
    _mark_revoked([task_id for _, task_id, _, _ in found], reason or "cancelled after it failed")
    return len(found)

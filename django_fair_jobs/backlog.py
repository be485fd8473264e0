"""Cancel a tenant's backlog: every job of a tenant that waits for its turn, on one queue or
all, of one task or all, in bounded batches.

A waiting job is one the library holds and has not handed to the broker yet: in fair
dispatch's line (scheduled or waiting), parked behind a tenant slot or a queue limit (not
woken), or in a planner's virtual queue (pending or failed). Each batch deletes at most
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
        where = f"on {self.queue}" if self.queue else "on every queue"
        what = f"of {self.task}" if self.task else "of every task"
        return (
            f"{self.total} waiting job(s) of {self.tenant} {where} {what}: {self.dispatch} "
            f"in fair dispatch's line, {self.parked} parked, {self.planned} planned"
        )


def _batch_of(cancelled: Cancelled, tenant: str, queue: str | None, task: str | None,
              batch: int) -> list[str]:  # fmt: skip
    ids: list[str] = []
    for line in [queue] if queue is not None else dispatch.lines_of(tenant):
        found = dispatch.cancel(line, tenant, task, batch)
        cancelled.dispatch += len(found)
        ids += found
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

    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a whole number >= 1, got {batch!r}.")
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
            note=(f"{cancelled.dispatch} in line, {cancelled.parked} parked, "
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
    from django_fair_jobs.dispatch.models import SCHEDULED, WAITING, DispatchJob
    from django_fair_jobs.models import ParkedJob, PlannedJob

    lines = DispatchJob.objects.filter(tenant=tenant, state__in=[SCHEDULED, WAITING])
    parked = ParkedJob.objects.filter(slot__tenant=tenant, woken_at__isnull=True)
    planned = PlannedJob.objects.filter(tenant=tenant, promoted_at__isnull=True)
    if queue is not None:
        lines, parked = lines.filter(queue=queue), parked.filter(slot__queue=queue)
        planned = planned.filter(queue=queue)
    if task is not None:
        lines, parked = lines.filter(task_name=task), parked.filter(task_name=task)
        planned = planned.filter(task_name=task)
    return Cancelled(tenant, queue, task, lines.count(), parked.count(), planned.count())

"""Leases and parked rows, shared by tenant slots and queue limits (layer 2): reap the leases
of dead holders, drop those of revoked jobs and release their places, requeue lost wake-ups,
and the checks both rooms' park paths share. Each step is one named statement of
``leases/store.sql`` on PostgreSQL; on other databases it is the function of the same name
and signature in :mod:`django_fair_jobs.leases.store_orm`."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import (
    models,
    router,
    transaction,
)
from django.db.models import F
from django.db.models.functions import Coalesce

from django_fair_jobs import db
from django_fair_jobs.leases import store_orm
from django_fair_jobs.leases.store_orm import release_leases as release_leases
from django_fair_jobs.leases.types import ParkOutcome, Reaped

if TYPE_CHECKING:
    from django_fair_jobs.models import (
        ParkedJob,
    )


def reap(*, timeout: float) -> Reaped:
    """Delete leases whose holder is dead (or whose reservation expired) and give their
    tenant slots and queue places back, on every queue; delete dead process rows."""
    from django_fair_jobs.models import SlotLease

    alias = router.db_for_write(SlotLease)
    if not db.uses_sql(alias):
        return store_orm.reap(timeout=timeout)
    leases, slots, queues = 0, [], []
    for kind, row_id, n in db.run(alias, "reap", {"timeout": timeout}):
        if kind == "leases":
            leases = n
        elif kind == "slot":
            slots.append((row_id, n))
        elif kind == "queue":
            queues.append((row_id, n))
    return Reaped(leases, tuple(sorted(slots)), tuple(sorted(queues)))


def drop_for_task(task_id: str, *, running: bool) -> tuple[list[int], list[int]]:
    """Drop the leases of a revoked ``task_id`` and give their slots back.

    Reservations (no process) always go. Leases of a running copy go only with
    ``running=True`` (the job was terminated): revoking or expiring a duplicate copy
    must not free the slot of the copy that runs. Returns the ids of the tenant slots
    and of the queue rows freed.
    """
    from django_fair_jobs.models import SlotLease

    with transaction.atomic(using=router.db_for_write(SlotLease)):
        leases = SlotLease.objects.select_for_update().filter(task_id=task_id)
        if not running:
            leases = leases.filter(process__isnull=True)
        slots, queues = release_leases(list(leases))
    return sorted(slots), sorted(queues)


def drop_held_by(
    task_ids: Sequence[str], process_id: uuid.UUID
) -> tuple[list[int], list[int], list[str]]:
    """Drop the leases of ``task_ids`` held by ``process_id`` and give their slots
    back: the leases of acquires that committed while their reply was lost, which no
    copy of the job can claim while that process lives. Returns the ids of the tenant
    slots and of the queue rows freed, and the task ids whose leases were dropped."""
    from django_fair_jobs.models import SlotLease

    with transaction.atomic(using=router.db_for_write(SlotLease)):
        leases = list(
            SlotLease.objects.select_for_update()
            .filter(task_id__in=list(task_ids), process_id=process_id)
            .order_by("pk")
        )
        slots, queues = release_leases(leases)
    return sorted(slots), sorted(queues), sorted({lease.task_id for lease in leases})


def requeue_lost_wakes(*, timeout: float) -> int:
    """Return woken jobs that never started (and lost their reservation) to waiting.

    Returns the number of slots touched.
    """
    from django_fair_jobs.models import ParkedJob

    alias = router.db_for_write(ParkedJob)
    if not db.uses_sql(alias):
        return store_orm.requeue_lost_wakes(timeout=timeout)
    return len(db.run(alias, "requeue_lost_wakes", {"timeout": timeout}))


def _counter_of(queue_id: int | None, slot_id: int | None) -> models.QuerySet[Any]:
    """The row that counts a parked job of these ids: its limited queue's, else its
    tenant slot's."""
    from django_fair_jobs.models import QueueLimit, TenantQueueSlot

    if queue_id is not None:
        return QueueLimit.objects.filter(pk=queue_id)
    return TenantQueueSlot.objects.filter(pk=slot_id or 0)


def drop_parked(task_id: str) -> bool:
    """Delete the parked row of ``task_id`` (a revoked job), fixing the counter. Returns
    whether a row was deleted."""
    from django_fair_jobs.models import ParkedJob

    found = (
        ParkedJob.objects.filter(task_id=task_id).values_list("queue_limit_id", "slot_id").first()
    )
    if found is None:
        return False
    waiting_on = _counter_of(*found)
    with transaction.atomic(using=router.db_for_write(ParkedJob)):
        # The counter's row first, then the parked row: the order of park and wake.
        list(waiting_on.select_for_update().values_list("pk"))
        job = ParkedJob.objects.select_for_update().filter(task_id=task_id).first()
        if job is None:
            return False
        job.delete()
        if job.woken_at is None:
            waiting_on.filter(parked_jobs__gt=0).update(parked_jobs=F("parked_jobs") - 1)
    return True


def drop_parked_of(tenant: str, queue: str | None, task_name: str | None, limit: int) -> list[str]:
    """Delete up to ``limit`` of ``tenant``'s parked jobs not woken (a cancel), on ``queue``
    (or every queue), of ``task_name`` (or every task), oldest first, fixing the counters;
    returns their task ids. One short transaction per line they wait in (a tenant slot,
    or a limited queue): its counter's row first, then its parked rows, the order of park
    and wake. A woken job is not waiting any more (its slot is reserved for it and its
    message is on the way): it stays."""
    from django.db.models.functions import Greatest

    from django_fair_jobs.models import ParkedJob

    rows = ParkedJob.objects.filter(slot__tenant=tenant, woken_at__isnull=True)
    if queue is not None:
        rows = rows.filter(slot__queue=queue)
    if task_name is not None:
        rows = rows.filter(task_name=task_name)
    lines = list(rows.order_by().values_list("queue_limit_id", "slot_id").distinct())
    dropped: list[str] = []
    for queue_id, slot_id in sorted(lines, key=lambda line: (line[0] or 0, line[1] or 0)):
        if len(dropped) >= limit:
            break
        waiting_on = _counter_of(queue_id, slot_id)
        with transaction.atomic(using=router.db_for_write(ParkedJob)):
            list(waiting_on.select_for_update().values_list("pk"))
            taken = list(
                rows.filter(queue_limit_id=queue_id, slot_id=slot_id)
                .select_for_update(of=("self",)).order_by("id")
                .values_list("id", "task_id")[: limit - len(dropped)]
            )  # fmt: skip
            ParkedJob.objects.filter(id__in=[pk for pk, _ in taken]).delete()
            waiting_on.update(parked_jobs=Greatest(F("parked_jobs") - len(taken), 0))
        dropped += [str(task_id) for _, task_id in taken]
    return dropped


def reconcile_parked(manager: Any, waiting: models.QuerySet[ParkedJob], key: str) -> int:
    """Set ``parked_jobs`` of the rows of ``manager`` (tenant slots or queue rows) that
    disagree with their ``waiting`` parked rows (linked by ``key``); returns how many.
    Each row is fixed under its row lock, so parks and wakes (which update the row) cannot
    interleave with the count."""
    count = models.Subquery(
        waiting.filter(**{key: models.OuterRef("pk")})
        .order_by()
        .values(key)
        .annotate(n=models.Count("pk"))
        .values("n")
    )
    suspects = list(
        manager.annotate(waiting=Coalesce(count, 0))
        .exclude(parked_jobs=F("waiting"))
        .values_list("pk", flat=True)
    )
    for pk in suspects:
        with transaction.atomic(using=router.db_for_write(manager.model)):
            list(manager.select_for_update().filter(pk=pk).values_list("pk"))
            manager.filter(pk=pk).update(parked_jobs=Coalesce(count, 0))
    return len(suspects)


def park_refused(task_id: str, woken: bool) -> ParkOutcome | None:
    """The ORM path's answer before any park: the job is already waiting (a duplicate
    delivery), or it is a woken copy whose parked row another copy took; else None."""
    from django_fair_jobs.models import ParkedJob

    if ParkedJob.objects.filter(task_id=task_id, woken_at__isnull=True).exists():
        return "already_parked"
    if woken and not ParkedJob.objects.filter(task_id=task_id).exists():
        return "stale"
    return None


def started_while_waiting(*, queue_id: int | None = None, slot_id: int | None = None) -> None:
    """Take one job off the waiting counts of ``queue_id``'s line and of ``slot_id``: a
    duplicate delivery of a parked job started while its parked row still waited (the
    acquire deleted the row). Either row may be None; a count never goes below 0."""
    from django_fair_jobs.models import QueueLimit, TenantQueueSlot

    if queue_id is not None:
        QueueLimit.objects.filter(pk=queue_id, parked_jobs__gt=0).update(
            parked_jobs=F("parked_jobs") - 1
        )
    if slot_id is not None:
        TenantQueueSlot.objects.filter(pk=slot_id, parked_jobs__gt=0).update(
            parked_jobs=F("parked_jobs") - 1
        )

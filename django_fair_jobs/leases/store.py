"""Leases and parked rows, shared by tenant slots and queue limits (layer 2): reap the leases
of dead holders, drop those of revoked jobs and give their places back, put lost wake-ups
back in line, and the checks both rooms' park paths share. Each step is one named statement
of ``leases/store.sql`` on PostgreSQL, and the ORM inside ``transaction.atomic()`` on
other databases."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import (
    models,
    router,
    transaction,
)
from django.db.models import F, Q
from django.db.models.functions import Coalesce, Greatest, Now

from django_fair_jobs import db
from django_fair_jobs.leases.types import ParkOutcome, Reaped

if TYPE_CHECKING:
    from django_fair_jobs.models import (
        ParkedJob,
        SlotLease,
    )


def reap(*, timeout: float) -> Reaped:
    """Delete leases whose holder is dead (or whose reservation expired) and give their
    tenant slots and queue places back, on every queue; delete dead process rows."""
    from django_fair_jobs.models import SlotLease

    alias = router.db_for_write(SlotLease)
    if not db.uses_sql(alias):
        return _reap_portable(alias, timeout)
    leases, slots, queues = 0, [], []
    for kind, row_id, n in db.run(alias, "reap", {"timeout": timeout}):
        if kind == "leases":
            leases = n
        elif kind == "slot":
            slots.append((row_id, n))
        elif kind == "queue":
            queues.append((row_id, n))
    return Reaped(leases, tuple(sorted(slots)), tuple(sorted(queues)))


def _reap_portable(alias: str, timeout: float) -> Reaped:
    from django_fair_jobs.models import SlotLease, WorkerProcess

    with transaction.atomic(using=alias):
        live = WorkerProcess.objects.filter(last_heartbeat_at__gte=db.ago(timeout)).values("pk")
        stale = list(
            SlotLease.objects.filter(
                Q(process__isnull=True, acquired_at__lt=db.ago(timeout))
                | (
                    Q(process__isnull=False, acquired_at__lt=db.ago(timeout))
                    & ~Q(process_id__in=live)
                )
            )
        )
        slots, queues = release_leases(stale)
        WorkerProcess.objects.filter(last_heartbeat_at__lt=db.ago(timeout)).delete()
    return Reaped(len(stale), tuple(sorted(slots.items())), tuple(sorted(queues.items())))


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


def drop_held_by(task_ids: Sequence[str], process_id: uuid.UUID) -> tuple[list[int], list[int]]:
    """Drop the leases of ``task_ids`` held by ``process_id`` and give their slots
    back: the leases of acquires that committed while their reply was lost, which no
    copy of the job can claim while that process lives. Returns the ids of the tenant
    slots and of the queue rows freed."""
    from django_fair_jobs.models import SlotLease

    with transaction.atomic(using=router.db_for_write(SlotLease)):
        leases = (
            SlotLease.objects.select_for_update()
            .filter(task_id__in=list(task_ids), process_id=process_id)
            .order_by("pk")
        )
        slots, queues = release_leases(list(leases))
    return sorted(slots), sorted(queues)


def release_leases(leases: Sequence[SlotLease]) -> tuple[dict[int, int], dict[int, int]]:
    """Delete ``leases`` and take them off their tenant slots' and queue rows' counters,
    inside the caller's transaction (the ORM path of reap and revoke). Queue rows are
    locked before tenant rows, the order of every statement. Returns ``{row id: leases}``
    for the tenant slots and the queue rows."""
    from django_fair_jobs.models import QueueLimit, TenantQueueSlot

    slots: dict[int, int] = {}
    queues: dict[int, dict[str, int]] = {}
    for lease in leases:
        if lease.queue_limit_id is not None:
            nodes = queues.setdefault(lease.queue_limit_id, {})
            node = str(lease.node_id or "")
            nodes[node] = nodes.get(node, 0) + 1
        if lease.slot_id is not None:
            slots[lease.slot_id] = slots.get(lease.slot_id, 0) + 1
    if not leases:
        return {}, {}
    leases[0].__class__.objects.filter(pk__in=[lease.pk for lease in leases]).delete()
    for row in QueueLimit.objects.select_for_update().filter(pk__in=sorted(queues)).order_by("pk"):
        running = dict(row.running)
        for node, n in queues[row.pk].items():
            left = int(running.get(node, 0)) - n
            if left > 0:
                running[node] = left
            else:
                running.pop(node, None)
        QueueLimit.objects.filter(pk=row.pk).update(
            current_jobs=Greatest(F("current_jobs") - sum(queues[row.pk].values()), 0),
            running=running,
            updated_at=Now(),
        )
    for slot_id, n in slots.items():
        TenantQueueSlot.objects.filter(pk=slot_id).update(
            current_jobs=Greatest(F("current_jobs") - n, 0), updated_at=Now()
        )
    return slots, {queue_id: sum(nodes.values()) for queue_id, nodes in queues.items()}


def requeue_lost_wakes(*, timeout: float) -> int:
    """Return woken jobs that never started (and lost their reservation) to waiting.

    Returns the number of slots touched.
    """
    from django_fair_jobs.models import ParkedJob, QueueLimit, SlotLease, TenantQueueSlot

    alias = router.db_for_write(ParkedJob)
    if db.uses_sql(alias):
        return len(db.run(alias, "requeue_lost_wakes", {"timeout": timeout}))
    with transaction.atomic(using=alias):
        leased = SlotLease.objects.filter(
            slot_id=models.OuterRef("slot_id"), task_id=models.OuterRef("task_id")
        )
        lost = ParkedJob.objects.filter(woken_at__lt=db.ago(timeout)).filter(
            Q(queue_limit__isnull=False) | ~models.Exists(leased)
        )
        slots: dict[int, int] = {}
        queues: dict[int, int] = {}
        for slot_id, queue_id in lost.values_list("slot_id", "queue_limit_id"):
            if queue_id is not None:
                queues[queue_id] = queues.get(queue_id, 0) + 1
            else:
                slots[slot_id] = slots.get(slot_id, 0) + 1
        lost.update(woken_at=None)
        for queue_id, n in sorted(queues.items()):
            QueueLimit.objects.filter(pk=queue_id).update(parked_jobs=F("parked_jobs") + n)
        for slot_id, n in slots.items():
            TenantQueueSlot.objects.filter(pk=slot_id).update(parked_jobs=F("parked_jobs") + n)
    return len(slots) + len(queues)


def drop_parked(task_id: str) -> None:
    """Delete the parked row of ``task_id`` (a revoked job), fixing the counter."""
    from django_fair_jobs.models import ParkedJob, QueueLimit, TenantQueueSlot

    found = (
        ParkedJob.objects.filter(task_id=task_id).values_list("queue_limit_id", "slot_id").first()
    )
    if found is None:
        return
    queue_id, slot_id = found
    waiting_on: models.QuerySet[Any] = (
        QueueLimit.objects.filter(pk=queue_id)
        if queue_id is not None
        else TenantQueueSlot.objects.filter(pk=slot_id or 0)
    )
    with transaction.atomic(using=router.db_for_write(ParkedJob)):
        # The counter's row first, then the parked row: the order of park and wake.
        list(waiting_on.select_for_update().values_list("pk"))
        job = ParkedJob.objects.select_for_update().filter(task_id=task_id).first()
        if job is None:
            return
        job.delete()
        if job.woken_at is None:
            waiting_on.filter(parked_jobs__gt=0).update(parked_jobs=F("parked_jobs") - 1)


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

"""Queue limits' storage on databases other than PostgreSQL (SQLite for development): the
steps :mod:`django_fair_jobs.queue_limits.store` runs as named statements on PostgreSQL,
each a function of the same name and signature, through the ORM inside
``transaction.atomic()`` with the queue row locked first, the order of every statement."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from django.db import models, router, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce, Greatest, Now

from django_fair_jobs.leases import store as leases
from django_fair_jobs.leases.types import (
    Grant,
    LimitedStatus,
    ParkOutcome,
    Woken,
)

if TYPE_CHECKING:
    from django_fair_jobs.models import QueueLimit, TenantQueueSlot


def acquire_limited(
    *,
    queue: str,
    tenant: str | None,
    limit: int,
    task_id: str,
    token: uuid.UUID,
    process_id: uuid.UUID,
    node_id: uuid.UUID,
    woken: bool,
) -> tuple[LimitedStatus, int | None, int | None, int, int]:
    """See :func:`django_fair_jobs.queue_limits.store.acquire_limited`."""
    from django_fair_jobs.models import ParkedJob, QueueLimit, SlotLease, TenantQueueSlot

    node = str(node_id)
    with transaction.atomic(using=router.db_for_write(QueueLimit)):
        row = QueueLimit.objects.select_for_update().filter(queue=queue).first()
        if row is None:
            return "unlimited", None, None, 0, 0
        slot = (
            None
            if tenant is None
            else TenantQueueSlot.objects.select_for_update()
            .filter(tenant=tenant, queue=queue)
            .first()
        )
        mine = Q(queue_limit=row) | Q(slot=slot) if slot is not None else Q(queue_limit=row)
        existing = list(SlotLease.objects.filter(mine, task_id=task_id))
        if any(lease.process_id is None and lease.queue_limit_id is None for lease in existing):
            return "reserved", None, None, 0, 0
        if existing:
            return "duplicate", None, None, 0, 0
        if woken and not ParkedJob.objects.filter(task_id=task_id).exists():
            return "stale", None, None, 0, 0
        if tenant is not None and slot is None:
            return "new_tenant", None, None, 0, 0
        if _queue_blocked(row, node):
            return "queue_full", None, None, 0, 0
        if slot is not None and slot.current_jobs >= _slot_limit(slot, limit):
            return "full", None, None, 0, 0
        running = {**row.running, node: int(row.running.get(node, 0)) + 1}
        QueueLimit.objects.filter(pk=row.pk).update(
            current_jobs=F("current_jobs") + 1, running=running, updated_at=Now()
        )
        if slot is not None:
            TenantQueueSlot.objects.filter(pk=slot.pk).update(
                current_jobs=F("current_jobs") + 1, default_max_jobs=limit, updated_at=Now()
            )
        SlotLease.objects.create(
            slot=slot, queue_limit=row, node_id=node_id, task_id=task_id, token=token,
            process_id=process_id,
        )  # fmt: skip
        parked = ParkedJob.objects.filter(task_id=task_id).first()
        in_line = on_slot = 0
        if parked is not None:
            parked.delete()
            if parked.woken_at is None:
                in_line = int(parked.queue_limit_id is not None)
                on_slot = int(parked.queue_limit_id is None)
    return "held", row.pk, None if slot is None else slot.pk, in_line, on_slot


def try_park(
    *,
    queue: str,
    tenant: str | None,
    limit: int,
    task_id: str,
    task_name: str,
    signature: str,
    node_id: uuid.UUID,
    woken: bool = False,
) -> ParkOutcome:
    """See :func:`django_fair_jobs.queue_limits.store.try_park`."""
    from django_fair_jobs.models import ParkedJob, QueueLimit, TenantQueueSlot

    node = str(node_id)

    with transaction.atomic(using=router.db_for_write(QueueLimit)):
        refused = leases.park_refused(task_id, woken)
        if refused is not None:
            return refused
        row = QueueLimit.objects.select_for_update().filter(queue=queue).first()
        slot = (
            None
            if tenant is None
            else TenantQueueSlot.objects.filter(tenant=tenant, queue=queue).first()
        )
        tenant_full = slot is not None and slot.current_jobs >= _slot_limit(slot, limit)
        if row is None or not (_queue_blocked(row, node) or tenant_full):
            return "room"
        QueueLimit.objects.filter(pk=row.pk).update(
            parked_jobs=F("parked_jobs") + 1,
            deferred_total=F("deferred_total") + 1,
            updated_at=Now(),
        )
        ParkedJob.objects.update_or_create(
            task_id=task_id,
            defaults={
                "slot": slot,
                "queue_limit": row,
                "task_name": task_name,
                "signature": signature,
                "default_max_jobs": limit,
                "woken_at": None,
            },
        )
    return "parked"


def release(grant: Grant) -> tuple[int, int | None] | None:
    """See :func:`django_fair_jobs.queue_limits.store.release`."""
    from django_fair_jobs.models import QueueLimit, SlotLease, TenantQueueSlot

    alias = router.db_for_write(QueueLimit)
    with transaction.atomic(using=alias):
        lease = SlotLease.objects.filter(
            queue_limit_id=grant.queue_limit_id, task_id=grant.task_id, token=grant.token
        ).first()
        if lease is None:
            return None
        leases.release_leases([lease])
        in_line = QueueLimit.objects.filter(pk=grant.queue_limit_id or 0).values_list(
            "parked_jobs", flat=True
        )
        on_slot = TenantQueueSlot.objects.filter(pk=grant.slot_id or 0).values_list(
            "parked_jobs", flat=True
        )
        return (in_line.first() or 0), on_slot.first()


def wake_one(queue_limit_id: int) -> Woken | None:
    """See :func:`django_fair_jobs.queue_limits.store.wake_one`."""
    from django_fair_jobs.models import ParkedJob, QueueLimit, TenantQueueSlot

    alias = router.db_for_write(QueueLimit)
    with transaction.atomic(using=alias):
        row = QueueLimit.objects.select_for_update().filter(pk=queue_limit_id).first()
        if row is None or row.max_jobs_per_worker == 0:
            return None
        if row.max_jobs is not None and row.current_jobs >= row.max_jobs:
            return None
        slot_room = TenantQueueSlot.objects.filter(
            pk=models.OuterRef("slot_id"),
            current_jobs__lt=Coalesce(F("max_jobs"), models.OuterRef("default_max_jobs")),
        )
        job = (
            ParkedJob.objects.filter(queue_limit_id=queue_limit_id, woken_at__isnull=True)
            .filter(Q(slot__isnull=True) | models.Exists(slot_room))
            .order_by("id")
            .first()
        )
        if job is None:
            return None
        QueueLimit.objects.filter(pk=queue_limit_id).update(
            parked_jobs=Greatest(F("parked_jobs") - 1, 0)
        )
        ParkedJob.objects.filter(pk=job.pk).update(woken_at=Now(), wake_count=F("wake_count") + 1)
    return Woken(queue_limit_id, job.task_id, job.signature, job.wake_count + 1)


def _queue_blocked(row: QueueLimit, node: str) -> bool:
    """True if ``row``'s queue is at its cluster-wide limit, or at its per-worker limit on
    ``node`` (the ORM path's copy of the SQL verdict)."""
    if row.max_jobs is not None and row.current_jobs >= row.max_jobs:
        return True
    on_node = int(row.running.get(node, 0))
    return row.max_jobs_per_worker is not None and on_node >= row.max_jobs_per_worker


def _slot_limit(slot: TenantQueueSlot, limit: int) -> int:
    return limit if slot.max_jobs is None else slot.max_jobs

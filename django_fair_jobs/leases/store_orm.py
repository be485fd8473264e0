"""The shared leases' storage on databases other than PostgreSQL (SQLite for development):
the steps :mod:`django_fair_jobs.leases.store` runs as named statements on PostgreSQL, each a
function of the same name and signature, through the ORM inside ``transaction.atomic()``;
and :func:`release_leases`, the ORM step every store's reap, drop and release share, which
:mod:`django_fair_jobs.leases.store` gives under the same name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from django.db import models, router, transaction
from django.db.models import F, Q
from django.db.models.functions import Greatest, Now

from django_fair_jobs import db
from django_fair_jobs.leases.types import Reaped

if TYPE_CHECKING:
    from django_fair_jobs.models import SlotLease


def reap(*, timeout: float) -> Reaped:
    """See :func:`django_fair_jobs.leases.store.reap`."""
    from django_fair_jobs.dispatch.models import RUNNING, DispatchJob
    from django_fair_jobs.models import SlotLease, WorkerProcess

    with transaction.atomic(using=router.db_for_write(SlotLease)):
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
        # A dead process's row is the only record of its node, which fair dispatch's reap
        # reads: kept while it has a running job there.
        running = DispatchJob.objects.filter(state=RUNNING).values("process_id")
        WorkerProcess.objects.filter(last_heartbeat_at__lt=db.ago(timeout)).exclude(
            pk__in=running
        ).delete()
    return Reaped(len(stale), tuple(sorted(slots.items())), tuple(sorted(queues.items())))


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
    """See :func:`django_fair_jobs.leases.store.requeue_lost_wakes`."""
    from django_fair_jobs.models import ParkedJob, QueueLimit, SlotLease, TenantQueueSlot

    alias = router.db_for_write(ParkedJob)
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

"""Tenant slots' storage on databases other than PostgreSQL (SQLite for development): the
steps :mod:`django_fair_jobs.slots.store` runs as named statements on PostgreSQL, each a
function of the same name and signature, through the ORM inside ``transaction.atomic()``.
SQLite serializes writers, so each conditional UPDATE stays atomic; success is judged by its
row count, never by a read followed by a write."""

from __future__ import annotations

import uuid

from django.db import IntegrityError, models, router, transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Greatest, Now

from django_fair_jobs import db
from django_fair_jobs.leases import store as leases
from django_fair_jobs.leases.types import AcquireStatus, Grant, ParkOutcome, Woken


def acquire(
    *,
    tenant: str,
    queue: str,
    task_id: str,
    limit: int,
    process_id: uuid.UUID,
    token: uuid.UUID,
    timeout: float,
    woken: bool,
) -> tuple[AcquireStatus, int | None, int, bool]:
    """See :func:`django_fair_jobs.slots.store.acquire`."""
    from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess

    with transaction.atomic(using=router.db_for_write(TenantQueueSlot)):
        slot_id = (
            TenantQueueSlot.objects.filter(tenant=tenant, queue=queue)
            .values_list("pk", flat=True)
            .first()
        )
        lease = (
            None
            if slot_id is None
            else SlotLease.objects.filter(slot_id=slot_id, task_id=task_id).first()
        )
        if lease is not None:
            live = (
                lease.process_id is not None
                and WorkerProcess.objects.filter(
                    pk=lease.process_id, last_heartbeat_at__gte=db.ago(timeout)
                ).exists()
            )
            if live or lease.queue_limit_id is not None:
                # A queue path's lease is claimed on the queue path only: its release
                # alone gives the queue's place back.
                return "duplicate", None, 0, False
            SlotLease.objects.filter(pk=lease.pk).update(
                process_id=process_id, token=token, acquired_at=Now()
            )
        elif woken and not ParkedJob.objects.filter(task_id=task_id).exists():
            return "stale", None, 0, False
        else:
            if slot_id is None:
                TenantQueueSlot.objects.bulk_create(
                    [TenantQueueSlot(tenant=tenant, queue=queue, default_max_jobs=limit)],
                    ignore_conflicts=True,
                )
                slot_id = TenantQueueSlot.objects.get(tenant=tenant, queue=queue).pk
            taken = TenantQueueSlot.objects.filter(
                pk=slot_id, current_jobs__lt=Coalesce(F("max_jobs"), limit)
            ).update(current_jobs=F("current_jobs") + 1, default_max_jobs=limit, updated_at=Now())
            if not taken:
                return "full", None, 0, False
            SlotLease.objects.create(
                slot_id=slot_id, task_id=task_id, token=token, process_id=process_id
            )
        waiting = ParkedJob.objects.filter(
            task_id=task_id, slot_id=slot_id, woken_at__isnull=True
        ).count()
        ParkedJob.objects.filter(task_id=task_id, slot_id=slot_id).delete()
    return "held", slot_id, waiting, lease is None and _room_to_spare(slot_id, limit)


def _room_to_spare(slot_id: int | None, limit: int) -> bool:
    """Whether a newly taken slot (not a claimed lease) is below its limit with no job
    parked on it: only such a slot may be kept for the process's next job."""
    from django_fair_jobs.models import TenantQueueSlot

    if slot_id is None:
        return False
    row = TenantQueueSlot.objects.get(pk=slot_id)
    return row.current_jobs < (limit if row.max_jobs is None else row.max_jobs) and not (
        row.parked_jobs
    )


def try_park(
    *,
    tenant: str,
    queue: str,
    task_id: str,
    task_name: str,
    limit: int,
    signature: str,
    woken: bool = False,
) -> ParkOutcome:
    """See :func:`django_fair_jobs.slots.store.try_park`."""
    from django_fair_jobs.models import ParkedJob, TenantQueueSlot

    with transaction.atomic(using=router.db_for_write(TenantQueueSlot)):
        refused = leases.park_refused(task_id, woken)
        if refused is not None:
            return refused
        updated = TenantQueueSlot.objects.filter(
            tenant=tenant, queue=queue, current_jobs__gte=Coalesce(F("max_jobs"), limit)
        ).update(
            parked_jobs=F("parked_jobs") + 1,
            deferred_total=F("deferred_total") + 1,
            updated_at=Now(),
        )
        if not updated:
            return "room"
        slot = TenantQueueSlot.objects.get(tenant=tenant, queue=queue)
        ParkedJob.objects.update_or_create(
            task_id=task_id,
            defaults={
                "slot": slot,
                "queue_limit": None,
                "task_name": task_name,
                "signature": signature,
                "default_max_jobs": limit,
                "woken_at": None,
            },
        )
    return "parked"


def release(grant: Grant) -> int | None:
    """See :func:`django_fair_jobs.slots.store.release`."""
    from django_fair_jobs.models import SlotLease, TenantQueueSlot

    slot_id = grant.slot_id
    if slot_id is None:
        return None
    with transaction.atomic(using=router.db_for_write(TenantQueueSlot)):
        deleted, _ = SlotLease.objects.filter(
            slot_id=slot_id, task_id=grant.task_id, token=grant.token
        ).delete()
        if not deleted:
            return None
        TenantQueueSlot.objects.filter(pk=slot_id, current_jobs__gt=0).update(
            current_jobs=F("current_jobs") - 1, updated_at=Now()
        )
        parked: int = TenantQueueSlot.objects.filter(pk=slot_id).values_list(
            "parked_jobs", flat=True
        )[0]
    return parked


def confirm_releases(
    grants: list[Grant], *, process_id: uuid.UUID
) -> tuple[bool, list[tuple[int, int]]]:
    """See :func:`django_fair_jobs.slots.store.confirm_releases` (no release is
    asynchronous here: this only redoes what a lease still held shows undone)."""
    from django_fair_jobs.models import WorkerProcess

    freed = []
    for grant in grants:
        parked = release(grant)
        if parked is not None and grant.slot_id is not None:
            freed.append((grant.slot_id, parked))
    beat = WorkerProcess.objects.filter(pk=process_id).update(last_heartbeat_at=Now())
    return bool(beat), freed


def hand_over(*, held: Grant, task_id: str, limit: int) -> Grant | None:
    """See :func:`django_fair_jobs.slots.store.hand_over`."""
    from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot

    if held.slot_id is None or held.queue_limit_id is not None:
        return None
    with transaction.atomic(using=router.db_for_write(TenantQueueSlot)):
        slot = TenantQueueSlot.objects.filter(pk=held.slot_id).first()
        if (
            slot is None
            or slot.parked_jobs
            or slot.current_jobs > (limit if slot.max_jobs is None else slot.max_jobs)
            or SlotLease.objects.filter(slot_id=held.slot_id, task_id=task_id).exists()
            or ParkedJob.objects.filter(task_id=task_id).exists()
        ):
            return None
        token = uuid.uuid4()
        spare = slot.current_jobs < (limit if slot.max_jobs is None else slot.max_jobs)
        handed = SlotLease.objects.filter(
            slot_id=held.slot_id, task_id=held.task_id, token=held.token,
            queue_limit__isnull=True,
        ).update(task_id=task_id, token=token, acquired_at=Now())  # fmt: skip
    if not handed:
        return None
    return Grant(slot_id=held.slot_id, task_id=task_id, token=token, spare=spare)


def release_and_acquire(
    *,
    held: Grant,
    tenant: str,
    queue: str,
    task_id: str,
    limit: int,
    process_id: uuid.UUID,
    token: uuid.UUID,
    timeout: float,
    woken: bool,
) -> tuple[AcquireStatus, int | None, int, bool, int | None] | None:
    """See :func:`django_fair_jobs.slots.store.release_and_acquire`: the release, then the
    acquire, in one transaction."""
    from django_fair_jobs.models import TenantQueueSlot

    try:
        with transaction.atomic(using=router.db_for_write(TenantQueueSlot)):
            released = release(held)
            taken = acquire(
                tenant=tenant, queue=queue, task_id=task_id, limit=limit,
                process_id=process_id, token=token, timeout=timeout, woken=woken,
            )  # fmt: skip
    except IntegrityError:
        return None  # a copy of task_id took a lease meanwhile: nothing happened
    return (*taken, released)


def wake_one(slot_id: int) -> Woken | None:
    """See :func:`django_fair_jobs.slots.store.wake_one`."""
    from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot

    with transaction.atomic(using=router.db_for_write(TenantQueueSlot)):
        slot = TenantQueueSlot.objects.filter(pk=slot_id).values("current_jobs", "max_jobs").first()
        if slot is None:
            return None
        running = SlotLease.objects.filter(slot_id=slot_id, task_id=models.OuterRef("task_id"))
        # Same choice as the PostgreSQL statement: the oldest job with room under its own
        # limit whose task holds no lease on the slot.
        candidates = ParkedJob.objects.filter(
            slot_id=slot_id, woken_at__isnull=True, queue_limit__isnull=True
        ).exclude(models.Exists(running))
        if slot["max_jobs"] is None:
            candidates = candidates.filter(default_max_jobs__gt=slot["current_jobs"])
        elif slot["current_jobs"] >= slot["max_jobs"]:
            return None
        job = candidates.order_by("id").first()
        if job is None:
            return None
        taken = TenantQueueSlot.objects.filter(
            pk=slot_id, current_jobs__lt=Coalesce(F("max_jobs"), job.default_max_jobs)
        ).update(
            current_jobs=F("current_jobs") + 1,
            parked_jobs=Greatest(F("parked_jobs") - 1, 0),
            updated_at=Now(),
        )
        if not taken:
            return None
        ParkedJob.objects.filter(pk=job.pk).update(woken_at=Now(), wake_count=F("wake_count") + 1)
        SlotLease.objects.create(slot_id=slot_id, task_id=job.task_id, token=uuid.uuid4())
    return Woken(slot_id, job.task_id, job.signature, job.wake_count + 1)

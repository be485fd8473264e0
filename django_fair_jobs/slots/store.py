"""Tenant slots' storage: acquire, park, release and wake, each one named statement of
``store.sql`` (beside this module) on PostgreSQL and the same steps through the ORM inside
``transaction.atomic()`` on other databases (SQLite serializes writers, so the conditional
UPDATEs stay atomic). Success is judged by the row count of a conditional UPDATE, never by a
read followed by a write."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.db import (
    IntegrityError,
    models,
    router,
    transaction,
)
from django.db.models import F
from django.db.models.functions import Coalesce, Greatest, Now

from django_fair_jobs import db
from django_fair_jobs.leases import store as leases
from django_fair_jobs.leases.types import AcquireStatus, Acquisition, Grant, ParkOutcome, Woken

if TYPE_CHECKING:
    pass


def try_acquire(
    *,
    tenant: str,
    queue: str,
    task_id: str,
    limit: int,
    process_id: uuid.UUID,
    timeout: float,
    woken: bool = False,
) -> Acquisition:
    """Take one of ``tenant``'s slots on ``queue`` for ``task_id``.

    ``limit`` applies when the row has no ``max_jobs`` override. A job whose lease on
    this slot is held by a gone holder (a reservation, or a process silent for
    ``timeout`` seconds) claims it with a new token and takes no second slot; one
    whose lease is held by a live process, or holds a place in a limited queue (only
    the queue path claims that one), is a ``"duplicate"`` delivery. A ``woken``
    job (a re-published parked job) starts only while its parked row exists.
    """
    from django_fair_jobs.models import TenantQueueSlot

    token = uuid.uuid4()
    alias = router.db_for_write(TenantQueueSlot)
    if db.uses_sql(alias):
        params: dict[str, Any] = {
            "tenant": tenant,
            "queue": queue,
            "task_id": task_id,
            "limit": limit,
            "process_id": process_id,
            "token": token,
            "timeout": timeout,
            "woken": woken,
        }
        try:
            with db.savepoint_if_needed(alias):
                ((status, slot_id, still_waiting),) = db.run(alias, "acquire", params)
        except IntegrityError:
            # Two deliveries of one task id raced for the lease's unique key.
            return Acquisition("duplicate")
    else:
        status, slot_id, still_waiting = _acquire_portable(
            tenant, queue, task_id, limit, process_id, token, timeout, woken
        )
    if status != "held":
        return Acquisition(status)
    if still_waiting:
        # A duplicate delivery started while its parked row was still waiting.
        TenantQueueSlot.objects.filter(pk=slot_id, parked_jobs__gt=0).update(
            parked_jobs=F("parked_jobs") - 1
        )
    return Acquisition("held", Grant(slot_id=slot_id, task_id=task_id, token=token))


def _acquire_portable(
    tenant: str,
    queue: str,
    task_id: str,
    limit: int,
    process_id: uuid.UUID,
    token: uuid.UUID,
    timeout: float,
    woken: bool,
) -> tuple[AcquireStatus, int | None, int]:
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
                return "duplicate", None, 0
            SlotLease.objects.filter(pk=lease.pk).update(
                process_id=process_id, token=token, acquired_at=Now()
            )
        elif woken and not ParkedJob.objects.filter(task_id=task_id).exists():
            return "stale", None, 0
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
                return "full", None, 0
            SlotLease.objects.create(
                slot_id=slot_id, task_id=task_id, token=token, process_id=process_id
            )
        waiting = ParkedJob.objects.filter(
            task_id=task_id, slot_id=slot_id, woken_at__isnull=True
        ).count()
        ParkedJob.objects.filter(task_id=task_id, slot_id=slot_id).delete()
    return "held", slot_id, waiting


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
    """Park a job whose acquire failed, if the slot is still full.

    Returns ``"room"`` when a slot freed in between (the caller acquires again),
    ``"already_parked"`` for a duplicate delivery of a waiting job, ``"stale"`` for a
    ``woken`` copy whose parked row another copy already took, else ``"parked"``.
    """
    from django_fair_jobs.models import TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    if db.uses_sql(alias):
        params: dict[str, Any] = {
            "tenant": tenant,
            "queue": queue,
            "task_id": task_id,
            "task_name": task_name,
            "limit": limit,
            "signature": signature,
            "woken": woken,
        }
        ((outcome,),) = db.run(alias, "park", params)
        return outcome  # type: ignore[no-any-return]
    return _park_portable(tenant, queue, task_id, task_name, limit, signature, woken)


def _park_portable(
    tenant: str,
    queue: str,
    task_id: str,
    task_name: str,
    limit: int,
    signature: str,
    woken: bool,
) -> ParkOutcome:
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


def count_deferral(*, tenant: str, queue: str) -> None:
    """Count a deferral that did not park (``fair_on_limit = "retry"``)."""
    from django_fair_jobs.models import TenantQueueSlot

    TenantQueueSlot.objects.filter(tenant=tenant, queue=queue).update(
        deferred_total=F("deferred_total") + 1
    )


def release(grant: Grant) -> int | None:
    """Release the slot of ``grant``, only if its lease is still the holder's.

    Returns the slot's ``parked_jobs`` after the release (the caller wakes that many
    at most), or None when the lease was already gone (reaped, or taken over by a
    redelivery): a stale holder releases nothing.
    """
    from django_fair_jobs.models import SlotLease, TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    slot_id = grant.slot_id
    if slot_id is None:
        return None
    params: dict[str, Any] = {
        "slot_id": slot_id,
        "task_id": grant.task_id,
        "token": grant.token,
    }
    if db.uses_sql(alias):
        rows = db.run(alias, "release", params)
        return int(rows[0][0]) if rows else None
    with transaction.atomic(using=alias):
        deleted, _ = SlotLease.objects.filter(
            slot_id=grant.slot_id, task_id=grant.task_id, token=grant.token
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


def wake_one(slot_id: int) -> Woken | None:
    """Give a free slot of ``slot_id`` to its oldest waiting parked job.

    Reserves a lease for the job and marks it woken; the caller must re-publish
    :attr:`Woken.signature`. Returns None when no job waits or no slot is free.
    """
    from django_fair_jobs.models import TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    token = uuid.uuid4()
    if db.uses_sql(alias):
        try:
            with db.savepoint_if_needed(alias):
                rows = db.run(alias, "wake", {"slot_id": slot_id, "token": token})
        except IntegrityError:
            # The job already has a lease on this slot: it is running, nothing to wake.
            return None
        return Woken(slot_id, *rows[0]) if rows else None
    return _wake_portable(slot_id, token)


def _wake_portable(slot_id: int, token: uuid.UUID) -> Woken | None:
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
        SlotLease.objects.create(slot_id=slot_id, task_id=job.task_id, token=token)
    return Woken(slot_id, job.task_id, job.signature, job.wake_count + 1)


def with_waiting_room() -> list[int]:
    """Slots that have a waiting parked job and a free slot for it (missed wake-ups)."""
    from django_fair_jobs.models import ParkedJob

    rows = (
        ParkedJob.objects.filter(woken_at__isnull=True, queue_limit__isnull=True)
        .filter(slot__current_jobs__lt=Coalesce(F("slot__max_jobs"), F("default_max_jobs")))
        .values_list("slot_id", flat=True)
        .distinct()
    )
    return list(rows)


def reconcile_parked() -> int:
    """Repair ``parked_jobs`` where it disagrees with the waiting rows; return how many.

    Each slot is fixed under its row lock, so parks and wakes (which update the row)
    cannot interleave with the count.
    """
    from django_fair_jobs.models import ParkedJob, TenantQueueSlot

    waiting = ParkedJob.objects.filter(woken_at__isnull=True, queue_limit__isnull=True)
    return leases.reconcile_parked(TenantQueueSlot.objects, waiting, "slot_id")

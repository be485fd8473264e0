"""Tenant slots' storage: acquire, park, release and wake, each one named statement of
``store.sql`` (beside this module) on PostgreSQL. On other databases each of these steps is
the function of the same name and signature in :mod:`django_fair_jobs.slots.store_orm`
(the contract the room's store tests hold both to); the steps that are ORM statements on
every database are here. Success is judged by the row count of a conditional UPDATE, never
by a read followed by a write."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import IntegrityError, connections, router
from django.db.models import F
from django.db.models.functions import Coalesce

from django_fair_jobs import db
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.leases import store as leases
from django_fair_jobs.leases.types import AcquireStatus, Acquisition, Grant, ParkOutcome, Woken
from django_fair_jobs.slots import store_orm


def alias() -> str:
    """The database alias of the tenant slots' rows."""
    from django_fair_jobs.models import TenantQueueSlot

    return router.db_for_write(TenantQueueSlot)


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
    token = uuid.uuid4()
    taken = acquire(
        tenant=tenant, queue=queue, task_id=task_id, limit=limit, process_id=process_id,
        token=token, timeout=timeout, woken=woken,
    )  # fmt: skip
    return _acquisition(taken, task_id=task_id, token=token)


def _acquisition(
    taken: tuple[AcquireStatus, int | None, int, bool], *, task_id: str, token: uuid.UUID
) -> Acquisition:
    """The answer to a job from :func:`acquire`'s row: its grant when held (a parked row
    of the job still waiting is counted off its slot)."""
    status, slot_id, still_waiting, spare = taken
    if status != "held":
        return Acquisition(status)
    if still_waiting:
        leases.started_while_waiting(slot_id=slot_id)
    return Acquisition("held", Grant(slot_id=slot_id, task_id=task_id, token=token, spare=spare))


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
    """The ``acquire`` statement: ``(status, slot id, 1 if the job's parked row was still
    waiting, whether a newly taken slot left room to spare)``; see :func:`try_acquire`,
    which builds the answer from it."""
    from django_fair_jobs.models import TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    if not db.uses_sql(alias):
        return store_orm.acquire(
            tenant=tenant, queue=queue, task_id=task_id, limit=limit, process_id=process_id,
            token=token, timeout=timeout, woken=woken,
        )  # fmt: skip
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
            ((status, slot_id, still_waiting, spare),) = db.run(alias, "acquire", params)
    except IntegrityError:
        # Two deliveries of one task id raced for the lease's unique key.
        return "duplicate", None, 0, False
    return status, slot_id, int(still_waiting or 0), bool(spare)


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
    if not db.uses_sql(alias):
        return store_orm.try_park(
            tenant=tenant,
            queue=queue,
            task_id=task_id,
            task_name=task_name,
            limit=limit,
            signature=signature,
            woken=woken,
        )
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
    from django_fair_jobs.models import TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    slot_id = grant.slot_id
    if slot_id is None:
        return None
    params: dict[str, Any] = {
        "slot_id": slot_id,
        "task_id": grant.task_id,
        "token": grant.token,
    }
    if not db.uses_sql(alias):
        return store_orm.release(grant)
    params["async_commit"] = releases_async()
    rows = db.run(alias, "release", params)
    return int(rows[0][0]) if rows else None


def releases_async() -> bool:
    """Whether :func:`release` commits without waiting for the disk here and now
    (``FAIR_JOBS_ASYNC_RELEASE`` on PostgreSQL, the release a transaction of its own):
    such releases are confirmed later by :func:`confirm_releases`."""
    from django_fair_jobs.models import TenantQueueSlot

    if not fair_settings.ASYNC_RELEASE:
        return False
    alias = router.db_for_write(TenantQueueSlot)
    conn = connections[alias]
    # Inside a caller's transaction (an atomic block, or autocommit turned off) the
    # setting would make the caller's whole commit asynchronous.
    return db.uses_sql(alias) and conn.get_autocommit() and not conn.in_atomic_block


def confirm_releases(
    grants: list[Grant], *, process_id: uuid.UUID
) -> tuple[bool, list[tuple[int, int]]]:
    """Make the releases of ``grants`` (made by process ``process_id``, possibly without
    waiting for the disk) durable, and redo those a crash of the database server lost, in
    one statement that also refreshes the process's heartbeat.

    Returns whether they are confirmed (False: the process row is gone, so the statement
    may have written nothing that waits for the disk; try again once it is registered),
    and the ``(slot id, parked_jobs)`` of each slot released again, whose parked jobs the
    caller wakes either way.
    """
    from django_fair_jobs.models import TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    if not db.uses_sql(alias):
        return store_orm.confirm_releases(grants, process_id=process_id)
    held = [g for g in grants if g.slot_id is not None]
    params: dict[str, Any] = {
        "slot_ids": [g.slot_id for g in held],
        "task_ids": [g.task_id for g in held],
        "tokens": [g.token for g in held],
        "process_id": process_id,
    }
    rows = db.run(alias, "confirm_releases", params)
    freed = [(int(row[1]), int(row[2])) for row in rows if row[1] is not None]
    return bool(rows[0][0]), freed


def hand_over(*, held: Grant, task_id: str, limit: int) -> Grant | None:
    """Hand the slot of ``held`` (a finished job's, kept by this process) to ``task_id``,
    the next job this process starts of the same tenant and queue: one statement, the
    counter untouched, the finished job's token fenced off.

    Returns the new job's grant, or None when the slot cannot be handed over (jobs are
    parked on it, it is over ``limit`` or its ``max_jobs``, ``task_id`` already has a
    lease or a parked row, or ``held`` is no longer the holder): the caller then releases
    ``held`` and acquires as usual.
    """
    from django_fair_jobs.models import TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    if held.slot_id is None or held.queue_limit_id is not None:
        return None
    if not db.uses_sql(alias):
        return store_orm.hand_over(held=held, task_id=task_id, limit=limit)
    token = uuid.uuid4()
    params: dict[str, Any] = {
        "slot_id": held.slot_id, "held_task_id": held.task_id, "held_token": held.token,
        "task_id": task_id, "token": token, "limit": limit,
    }  # fmt: skip
    try:
        with db.savepoint_if_needed(alias):
            rows = db.run(alias, "hand_over", params)
    except IntegrityError:
        return None  # a copy of task_id took a lease on this slot meanwhile
    if not rows:
        return None
    return Grant(slot_id=held.slot_id, task_id=task_id, token=token, spare=bool(rows[0][1]))


def try_release_and_acquire(
    *,
    held: Grant,
    tenant: str,
    queue: str,
    task_id: str,
    limit: int,
    process_id: uuid.UUID,
    timeout: float,
    woken: bool,
) -> tuple[Acquisition, int | None] | None:
    """Release ``held`` (a finished job's slot, kept by this process) and take one of
    ``tenant``'s slots on ``queue`` for ``task_id`` (as :func:`try_acquire`), in one
    statement. ``held`` must be another tenant's or queue's slot (:func:`hand_over` serves
    the same one).

    Returns the acquisition and what :func:`release` returns for ``held``: the slot's
    ``parked_jobs`` after the release (the caller wakes that many at most), or None when
    its lease was already gone. None when nothing happened: a copy of ``task_id`` took a
    lease meanwhile, so the whole statement rolled back; the caller releases ``held``
    alone, and the job is a duplicate delivery.
    """
    token = uuid.uuid4()
    traded = release_and_acquire(
        held=held, tenant=tenant, queue=queue, task_id=task_id, limit=limit,
        process_id=process_id, token=token, timeout=timeout, woken=woken,
    )  # fmt: skip
    if traded is None:
        return None
    status, slot_id, still_waiting, spare, released = traded
    taken = (status, slot_id, still_waiting, spare)
    return _acquisition(taken, task_id=task_id, token=token), released


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
    """The ``release_and_acquire`` statement: :func:`acquire`'s answer followed by
    :func:`release`'s for ``held``, or None if it rolled back whole (see
    :func:`try_release_and_acquire`, which builds the answer from it)."""
    from django_fair_jobs.models import TenantQueueSlot

    if held.slot_id is None or held.queue_limit_id is not None:
        raise ValueError(f"release_and_acquire releases a tenant slot alone, not {held!r}")
    alias = router.db_for_write(TenantQueueSlot)
    if not db.uses_sql(alias):
        return store_orm.release_and_acquire(
            held=held, tenant=tenant, queue=queue, task_id=task_id, limit=limit,
            process_id=process_id, token=token, timeout=timeout, woken=woken,
        )  # fmt: skip
    params: dict[str, Any] = {
        "held_slot_id": held.slot_id, "held_task_id": held.task_id, "held_token": held.token,
        "tenant": tenant, "queue": queue, "task_id": task_id, "limit": limit,
        "process_id": process_id, "token": token, "timeout": timeout, "woken": woken,
    }  # fmt: skip
    try:
        with db.savepoint_if_needed(alias):
            ((status, slot_id, still_waiting, spare, parked),) = db.run(
                alias, "release_and_acquire", params
            )
    except IntegrityError:
        return None  # two deliveries of task_id raced for the lease's unique key
    released = None if parked is None else int(parked)
    return status, slot_id, int(still_waiting or 0), bool(spare), released


def wake_one(slot_id: int) -> Woken | None:
    """Give a free slot of ``slot_id`` to its oldest waiting parked job.

    Reserves a lease for the job and marks it woken; the caller must re-publish
    :attr:`Woken.signature`. Returns None when no job waits or no slot is free.
    """
    from django_fair_jobs.models import TenantQueueSlot

    alias = router.db_for_write(TenantQueueSlot)
    if not db.uses_sql(alias):
        return store_orm.wake_one(slot_id)
    token = uuid.uuid4()
    try:
        with db.savepoint_if_needed(alias):
            rows = db.run(alias, "wake", {"slot_id": slot_id, "token": token})
    except IntegrityError:
        # The job already has a lease on this slot: it is running, nothing to wake.
        return None
    return Woken(slot_id, *rows[0]) if rows else None


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

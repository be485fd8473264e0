"""Queue limits' storage: the stored limits, and acquire, park, release and wake on a limited
queue, each one statement on PostgreSQL (the ``*_limited`` and ``wake_queue`` blocks of
``store.sql`` beside this module). On other databases each of these steps is the function of
the same name and signature in :mod:`django_fair_jobs.queue_limits.store_orm`; the steps
that are ORM statements on every database are here."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.db import (
    IntegrityError,
    models,
    router,
    transaction,
)
from django.db.models import F, Q
from django.db.models.functions import Now

from django_fair_jobs import db
from django_fair_jobs.leases import store as leases
from django_fair_jobs.leases.types import (
    Grant,
    LimitedAcquisition,
    LimitedStatus,
    ParkOutcome,
    Woken,
)
from django_fair_jobs.queue_limits import store_orm

if TYPE_CHECKING:
    from django_fair_jobs.models import QueueLimit


UNCHANGED: Any = object()
"""Marks a limit left as it is by :func:`set_limits`."""


def limits() -> dict[str, tuple[int | None, int | None]]:
    """``{queue: (max_jobs, max_jobs_per_worker)}`` of every queue with a limit set, or
    still draining (jobs holding a place or waiting in line after its limit was
    cleared: they must be released and woken through the queue's row)."""
    from django_fair_jobs.models import QueueLimit

    rows = QueueLimit.objects.filter(
        Q(max_jobs__isnull=False)
        | Q(max_jobs_per_worker__isnull=False)
        | Q(current_jobs__gt=0)
        | Q(parked_jobs__gt=0)
    )
    return {
        queue: (max_jobs, per_worker)
        for queue, max_jobs, per_worker in rows.values_list(
            "queue", "max_jobs", "max_jobs_per_worker"
        )
    }


def seed(max_jobs: dict[str, int], per_worker: dict[str, int]) -> list[str]:
    """Store the settings' limits of every queue that has no row yet; a stored row
    (changed at runtime, or cleared) is kept as it is. Returns the queues seeded."""
    from django_fair_jobs.models import QueueLimit

    wanted = set(max_jobs) | set(per_worker)
    stored = set(QueueLimit.objects.filter(queue__in=wanted).values_list("queue", flat=True))
    missing = sorted(wanted - stored)
    QueueLimit.objects.bulk_create(
        [
            QueueLimit(queue=q, max_jobs=max_jobs.get(q), max_jobs_per_worker=per_worker.get(q))
            for q in missing
        ],
        ignore_conflicts=True,
    )
    return missing


def set_limits(
    queue: str, *, max_jobs: Any = UNCHANGED, max_jobs_per_worker: Any = UNCHANGED
) -> QueueLimit:
    """Store new limits for ``queue`` (None: no limit; 0: paused); a limit not given is
    left as it is. Only the limit columns are written, never the counters."""
    from django_fair_jobs.models import QueueLimit

    fields: dict[str, Any] = {}
    if max_jobs is not UNCHANGED:
        fields["max_jobs"] = max_jobs
    if max_jobs_per_worker is not UNCHANGED:
        fields["max_jobs_per_worker"] = max_jobs_per_worker
    with transaction.atomic(using=router.db_for_write(QueueLimit)):
        row, _ = QueueLimit.objects.get_or_create(queue=queue)
        if fields:
            QueueLimit.objects.filter(pk=row.pk).update(**fields, updated_at=Now())
            row.refresh_from_db()
    return row


def count_deferral(queue: str) -> None:
    """Count a deferral that did not park (``fair_on_limit = "retry"``)."""
    from django_fair_jobs.models import QueueLimit

    QueueLimit.objects.filter(queue=queue).update(deferred_total=F("deferred_total") + 1)


def try_acquire(
    *,
    queue: str,
    tenant: str | None,
    limit: int,
    task_id: str,
    process_id: uuid.UUID,
    node_id: uuid.UUID,
    woken: bool = False,
) -> LimitedAcquisition:
    """Take a place in ``queue`` (within its cluster and per-node limits, counted on
    ``node_id``) and, with a ``tenant``, one of its slots (``limit`` when the slot row
    has no override): both or neither. Creates the tenant's slot row on first use."""
    from django_fair_jobs.models import TenantQueueSlot

    token = uuid.uuid4()
    for _ in range(2):
        status, queue_id, slot_id, in_line, on_slot = acquire_limited(
            queue=queue, tenant=tenant, limit=limit, task_id=task_id, token=token,
            process_id=process_id, node_id=node_id, woken=woken,
        )  # fmt: skip
        if status != "new_tenant":
            break
        TenantQueueSlot.objects.bulk_create(
            [TenantQueueSlot(tenant=str(tenant), queue=queue, default_max_jobs=limit)],
            ignore_conflicts=True,
        )
    if status != "held":
        return LimitedAcquisition(status)
    if in_line or on_slot:
        leases.started_while_waiting(
            queue_id=queue_id if in_line else None, slot_id=slot_id if on_slot else None
        )
    return LimitedAcquisition("held", Grant(slot_id, task_id, token, queue_id))


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
    """The ``acquire_limited`` statement: ``(status, queue row id, slot id, 1 if the job's
    parked row waited in the queue's line, 1 if it waited on its slot)``; see
    :func:`try_acquire`, which builds the answer from it."""
    from django_fair_jobs.models import QueueLimit

    alias = router.db_for_write(QueueLimit)
    if not db.uses_sql(alias):
        return store_orm.acquire_limited(
            queue=queue, tenant=tenant, limit=limit, task_id=task_id, token=token,
            process_id=process_id, node_id=node_id, woken=woken,
        )  # fmt: skip
    params: dict[str, Any] = {
        "queue": queue,
        "tenant": tenant,
        "limit": limit,
        "task_id": task_id,
        "token": token,
        "process_id": process_id,
        "node": str(node_id),
        "woken": woken,
    }
    try:
        with db.savepoint_if_needed(alias):
            ((status, queue_id, slot_id, in_line, on_slot),) = db.run(
                alias, "acquire_limited", params
            )
    except IntegrityError:
        return "duplicate", None, None, 0, 0
    return status, queue_id, slot_id, int(in_line or 0), int(on_slot or 0)


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
    """Park a job of a limited queue in the queue's line if it is still blocked (by the
    queue, the per-worker limit on ``node_id``, or its tenant); same outcomes as
    :func:`django_fair_jobs.slots.store.try_park`."""
    from django_fair_jobs.models import QueueLimit

    alias = router.db_for_write(QueueLimit)
    if not db.uses_sql(alias):
        return store_orm.try_park(
            queue=queue,
            tenant=tenant,
            limit=limit,
            task_id=task_id,
            task_name=task_name,
            signature=signature,
            node_id=node_id,
            woken=woken,
        )
    params: dict[str, Any] = {
        "queue": queue,
        "tenant": tenant,
        "limit": limit,
        "task_id": task_id,
        "task_name": task_name,
        "signature": signature,
        "node": str(node_id),
        "woken": woken,
    }
    ((outcome,),) = db.run(alias, "park_limited", params)
    return outcome  # type: ignore[no-any-return]


def release(grant: Grant) -> tuple[int, int | None] | None:
    """Release ``grant``'s place in its queue and its tenant slot, only if its lease
    is still the holder's. Returns the ``parked_jobs`` of the queue row and of the
    tenant slot (None without one) after the release, or None if the lease was gone."""
    from django_fair_jobs.models import QueueLimit

    alias = router.db_for_write(QueueLimit)
    params: dict[str, Any] = {
        "queue_limit_id": grant.queue_limit_id,
        "task_id": grant.task_id,
        "token": grant.token,
    }
    if not db.uses_sql(alias):
        return store_orm.release(grant)
    rows = db.run(alias, "release_limited", params)
    if not rows:
        return None
    in_line, on_slot = rows[0]
    return int(in_line or 0), on_slot


def wake_one(queue_limit_id: int) -> Woken | None:
    """Mark the oldest job of the queue's line that can start now as woken; the caller
    re-publishes it. No place is reserved (see ``wake_queue``)."""
    from django_fair_jobs.models import QueueLimit

    alias = router.db_for_write(QueueLimit)
    if not db.uses_sql(alias):
        return store_orm.wake_one(queue_limit_id)
    rows = db.run(alias, "wake_queue", {"queue_limit_id": queue_limit_id})
    return Woken(queue_limit_id, *rows[0]) if rows else None


def with_waiting_room(live_nodes: int) -> list[tuple[int, int]]:
    """Queues with jobs waiting in line and room to start some (missed wake-ups, a
    reap, a raised limit): ``[(queue row id, jobs to wake)]``. Without a cluster-wide
    limit the room is the per-worker limit times ``live_nodes``."""
    from django_fair_jobs.models import QueueLimit

    wanted: list[tuple[int, int]] = []
    for row in QueueLimit.objects.filter(parked_jobs__gt=0):
        if row.max_jobs_per_worker == 0:
            continue
        caps = [] if row.max_jobs is None else [row.max_jobs]
        if row.max_jobs_per_worker is not None:
            caps.append(row.max_jobs_per_worker * max(live_nodes, 1))
        # Without a cap (a limit just cleared) every waiting job may start at once.
        room = min(caps) - row.current_jobs if caps else row.parked_jobs
        if room > 0:
            wanted.append((row.pk, min(room, row.parked_jobs)))
    return wanted


def reconcile_parked() -> int:
    """Repair ``parked_jobs`` where it disagrees with the rows waiting in the queue's
    line; returns how many rows were fixed (each under its row lock)."""
    from django_fair_jobs.models import ParkedJob, QueueLimit

    waiting = ParkedJob.objects.filter(woken_at__isnull=True)
    return leases.reconcile_parked(QueueLimit.objects, waiting, "queue_limit_id")


def reconcile_running() -> int:
    """Repair ``current_jobs`` and ``running`` where they disagree with the queue's
    leases (a place taken and never released); returns how many rows were fixed.

    Each row is recounted under its row lock, in a statement that starts after the
    lock is held: every statement that adds or removes a queue's lease locks that
    queue's row in the same transaction, so the count cannot miss one in flight."""
    from django_fair_jobs.models import QueueLimit

    expected = _queue_lease_counts(None)
    rows = list(QueueLimit.objects.values_list("pk", "current_jobs", "running"))
    suspects = [
        pk
        for pk, current, running in rows
        if (current, dict(running or {})) != _totals(expected.get(pk, {}))
    ]
    for pk in suspects:
        with transaction.atomic(using=router.db_for_write(QueueLimit)):
            list(QueueLimit.objects.select_for_update().filter(pk=pk).values_list("pk"))
            total, running = _totals(_queue_lease_counts(pk).get(pk, {}))
            QueueLimit.objects.filter(pk=pk).update(
                current_jobs=total, running=running, updated_at=Now()
            )
    return len(suspects)


def _queue_lease_counts(queue_limit_id: int | None) -> dict[int, dict[str, int]]:
    """``{queue row id: {node id: leases}}`` of the leases holding a queue's place (of one
    queue row, or of every one with None)."""
    from django_fair_jobs.models import SlotLease

    leases = SlotLease.objects.filter(queue_limit__isnull=False)
    if queue_limit_id is not None:
        leases = leases.filter(queue_limit_id=queue_limit_id)
    counts: dict[int, dict[str, int]] = {}
    for row_id, node_id, n in (
        leases.order_by().values_list("queue_limit_id", "node_id").annotate(n=models.Count("pk"))
    ):
        counts.setdefault(row_id, {})[str(node_id or "")] = n
    return counts


def _totals(nodes: dict[str, int]) -> tuple[int, dict[str, int]]:
    """A queue row's ``current_jobs`` and ``running`` for its leases per node."""
    return sum(nodes.values()), dict(nodes)

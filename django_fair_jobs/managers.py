"""The SQL that changes slots, leases, parked jobs and worker processes.

Every method that changes a counter has two paths with the same contract:

* PostgreSQL: one statement from :mod:`django_fair_jobs.sql` (one round trip).
* Any other database (SQLite for development): the same steps through the ORM inside
  ``transaction.atomic()``. SQLite serializes writers, so the conditional UPDATEs stay
  atomic; use ``"transaction_mode": "IMMEDIATE"`` in its OPTIONS to avoid lock upgrades.

Success is always judged by the row count of a conditional UPDATE, never by a read
followed by a write.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    models,
    router,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Q
from django.db.models.functions import Coalesce, Greatest, Now

from django_fair_jobs.sql import queries

if TYPE_CHECKING:
    # Used in the Manager["..."] subscripts below, which the linter cannot see.
    from django_fair_jobs.models import (  # noqa: F401
        Maintenance,
        ParkedJob,
        PlannedJob,
        QueueLimit,
        SlotLease,
        TenantQueueSlot,
        TenantWindow,
        WorkerProcess,
    )


ParkOutcome = Literal["parked", "already_parked", "room", "stale"]
AcquireStatus = Literal["held", "full", "duplicate", "stale"]


@dataclass(frozen=True)
class Grant:
    """Proof that a job holds its slots: its tenant slot (``slot_id``), its place in a
    limited queue (``queue_limit_id``), or both; what a release needs."""

    slot_id: int | None
    task_id: str
    token: uuid.UUID
    queue_limit_id: int | None = None


@dataclass(frozen=True)
class Acquisition:
    """The answer of an acquire: ``"held"`` (with a grant), ``"full"`` (the tenant is at
    its limit), ``"duplicate"`` (this task id is running in a live process) or ``"stale"``
    (a copy of a woken parked job that another copy already started)."""

    status: AcquireStatus
    grant: Grant | None = None


@dataclass(frozen=True)
class Woken:
    """A parked job that was given a slot (or, in a queue's line, its turn) and must now
    be re-published. ``slot_id`` is the tenant slot or the queue row it was woken on."""

    slot_id: int
    task_id: str
    signature: str
    wake: int


LimitedStatus = Literal[
    "held", "full", "queue_full", "unlimited", "new_tenant", "duplicate", "reserved", "stale"
]


@dataclass(frozen=True)
class LimitedAcquisition:
    """The answer of an acquire on a limited queue: see ``acquire_limited`` in
    ``sql/postgresql.sql`` for the statuses. ``grant`` is set when ``"held"``."""

    status: LimitedStatus
    grant: Grant | None = None


@dataclass(frozen=True)
class Reaped:
    """What a reap gave back: leases deleted, and per tenant slot and per queue row how
    many of them it held."""

    leases: int = 0
    slots: tuple[tuple[int, int], ...] = ()
    queues: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Recorded:
    """The answer of recording an enqueue: the count within each rule's window (in rule
    order, the enqueue itself included) and the 0-based index of the rule that picks the
    queue (the last one whose count is above its threshold), or None."""

    counts: tuple[int, ...]
    rule: int | None


def _is_postgres(alias: str) -> bool:
    return connections[alias].vendor == "postgresql"


def _run(alias: str, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run the named statement of ``sql/postgresql.sql`` and return its rows."""
    with connections[alias].cursor() as cursor:
        cursor.execute(queries()[name], params)
        return list(cursor.fetchall())


def database_now(alias: str = "default") -> datetime:
    """The database clock (aware), for ages shown to operators. SQLite has no clock of its
    own: there it is the host's, the one every process of the host reads."""

    with connections[alias].cursor() as cursor:
        if _is_postgres(alias):
            cursor.execute("SELECT now()")
            value: datetime = cursor.fetchone()[0]
            return value
        cursor.execute("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")
        return datetime.fromisoformat(cursor.fetchone()[0]).replace(tzinfo=UTC)


def _savepoint_if_needed(alias: str) -> Any:
    """A savepoint only inside a caller's transaction, so that a failed statement does not
    break it; in autocommit (the worker's case) no extra round trip is spent."""
    from contextlib import nullcontext

    if connections[alias].in_atomic_block:
        return transaction.atomic(using=alias)
    return nullcontext()


def _ago(seconds: float) -> Any:
    """A database-clock expression for ``now() - seconds`` (never the worker's clock)."""
    from datetime import timedelta

    delta: timedelta = timedelta(seconds=seconds)
    return Now() - models.Value(delta, output_field=models.DurationField())


class TenantQueueSlotManager(models.Manager["TenantQueueSlot"]):
    """Acquire, park, release and wake: the slot protocol, as domain-named methods."""

    def _alias(self) -> str:
        return router.db_for_write(self.model)

    def try_acquire(
        self,
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
        alias = self._alias()
        if _is_postgres(alias):
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
                with _savepoint_if_needed(alias):
                    ((status, slot_id, still_waiting),) = _run(alias, "acquire", params)
            except IntegrityError:
                # Two deliveries of one task id raced for the lease's unique key.
                return Acquisition("duplicate")
        else:
            status, slot_id, still_waiting = self._acquire_portable(
                tenant, queue, task_id, limit, process_id, token, timeout, woken
            )
        if status != "held":
            return Acquisition(status)
        if still_waiting:
            # A duplicate delivery started while its parked row was still waiting.
            self.filter(pk=slot_id, parked_jobs__gt=0).update(parked_jobs=F("parked_jobs") - 1)
        return Acquisition("held", Grant(slot_id=slot_id, task_id=task_id, token=token))

    def _acquire_portable(
        self,
        tenant: str,
        queue: str,
        task_id: str,
        limit: int,
        process_id: uuid.UUID,
        token: uuid.UUID,
        timeout: float,
        woken: bool,
    ) -> tuple[AcquireStatus, int | None, int]:
        from django_fair_jobs.models import ParkedJob, SlotLease, WorkerProcess

        with transaction.atomic(using=self._alias()):
            slot_id = self.filter(tenant=tenant, queue=queue).values_list("pk", flat=True).first()
            lease = (
                None
                if slot_id is None
                else SlotLease.objects.filter(slot_id=slot_id, task_id=task_id).first()
            )
            if lease is not None:
                live = (
                    lease.process_id is not None
                    and WorkerProcess.objects.filter(
                        pk=lease.process_id, last_heartbeat_at__gte=_ago(timeout)
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
                    self.bulk_create(
                        [self.model(tenant=tenant, queue=queue, default_max_jobs=limit)],
                        ignore_conflicts=True,
                    )
                    slot_id = self.get(tenant=tenant, queue=queue).pk
                taken = self.filter(
                    pk=slot_id, current_jobs__lt=Coalesce(F("max_jobs"), limit)
                ).update(
                    current_jobs=F("current_jobs") + 1, default_max_jobs=limit, updated_at=Now()
                )
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
        self,
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
        alias = self._alias()
        if _is_postgres(alias):
            params: dict[str, Any] = {
                "tenant": tenant,
                "queue": queue,
                "task_id": task_id,
                "task_name": task_name,
                "limit": limit,
                "signature": signature,
                "woken": woken,
            }
            ((outcome,),) = _run(alias, "park", params)
            return outcome  # type: ignore[no-any-return]
        return self._park_portable(tenant, queue, task_id, task_name, limit, signature, woken)

    def _park_portable(
        self,
        tenant: str,
        queue: str,
        task_id: str,
        task_name: str,
        limit: int,
        signature: str,
        woken: bool,
    ) -> ParkOutcome:
        from django_fair_jobs.models import ParkedJob

        with transaction.atomic(using=self._alias()):
            refused = _park_refused(task_id, woken)
            if refused is not None:
                return refused
            updated = self.filter(
                tenant=tenant, queue=queue, current_jobs__gte=Coalesce(F("max_jobs"), limit)
            ).update(
                parked_jobs=F("parked_jobs") + 1,
                deferred_total=F("deferred_total") + 1,
                updated_at=Now(),
            )
            if not updated:
                return "room"
            slot = self.get(tenant=tenant, queue=queue)
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

    def count_deferral(self, *, tenant: str, queue: str) -> None:
        """Count a deferral that did not park (``fair_on_limit = "retry"``)."""
        self.filter(tenant=tenant, queue=queue).update(deferred_total=F("deferred_total") + 1)

    def release(self, grant: Grant) -> int | None:
        """Give back the slot of ``grant``, only if its lease is still the holder's.

        Returns the slot's ``parked_jobs`` after the release (the caller wakes that many
        at most), or None when the lease was already gone (reaped, or taken over by a
        redelivery): a stale holder releases nothing.
        """
        alias = self._alias()
        slot_id = grant.slot_id
        if slot_id is None:
            return None
        params: dict[str, Any] = {
            "slot_id": slot_id,
            "task_id": grant.task_id,
            "token": grant.token,
        }
        if _is_postgres(alias):
            rows = _run(alias, "release", params)
            return int(rows[0][0]) if rows else None
        from django_fair_jobs.models import SlotLease

        with transaction.atomic(using=alias):
            deleted, _ = SlotLease.objects.filter(
                slot_id=grant.slot_id, task_id=grant.task_id, token=grant.token
            ).delete()
            if not deleted:
                return None
            self.filter(pk=slot_id, current_jobs__gt=0).update(
                current_jobs=F("current_jobs") - 1, updated_at=Now()
            )
            parked: int = self.filter(pk=slot_id).values_list("parked_jobs", flat=True)[0]
        return parked

    def wake_one(self, slot_id: int) -> Woken | None:
        """Give a free slot of ``slot_id`` to its oldest waiting parked job.

        Reserves a lease for the job and marks it woken; the caller must re-publish
        :attr:`Woken.signature`. Returns None when no job waits or no slot is free.
        """
        alias = self._alias()
        token = uuid.uuid4()
        if _is_postgres(alias):
            try:
                with _savepoint_if_needed(alias):
                    rows = _run(alias, "wake", {"slot_id": slot_id, "token": token})
            except IntegrityError:
                # The job already has a lease on this slot: it is running, nothing to wake.
                return None
            return Woken(slot_id, *rows[0]) if rows else None
        return self._wake_portable(slot_id, token)

    def _wake_portable(self, slot_id: int, token: uuid.UUID) -> Woken | None:
        from django_fair_jobs.models import ParkedJob, SlotLease

        with transaction.atomic(using=self._alias()):
            slot = self.filter(pk=slot_id).values("current_jobs", "max_jobs").first()
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
            taken = self.filter(
                pk=slot_id, current_jobs__lt=Coalesce(F("max_jobs"), job.default_max_jobs)
            ).update(
                current_jobs=F("current_jobs") + 1,
                parked_jobs=Greatest(F("parked_jobs") - 1, 0),
                updated_at=Now(),
            )
            if not taken:
                return None
            ParkedJob.objects.filter(pk=job.pk).update(
                woken_at=Now(), wake_count=F("wake_count") + 1
            )
            SlotLease.objects.create(slot_id=slot_id, task_id=job.task_id, token=token)
        return Woken(slot_id, job.task_id, job.signature, job.wake_count + 1)

    def with_waiting_room(self) -> list[int]:
        """Slots that have a waiting parked job and a free slot for it (missed wake-ups)."""
        from django_fair_jobs.models import ParkedJob

        rows = (
            ParkedJob.objects.filter(woken_at__isnull=True, queue_limit__isnull=True)
            .filter(slot__current_jobs__lt=Coalesce(F("slot__max_jobs"), F("default_max_jobs")))
            .values_list("slot_id", flat=True)
            .distinct()
        )
        return list(rows)

    def reconcile_parked(self) -> int:
        """Repair ``parked_jobs`` where it disagrees with the waiting rows; return how many.

        Each slot is fixed under its row lock, so parks and wakes (which update the row)
        cannot interleave with the count.
        """
        from django_fair_jobs.models import ParkedJob

        waiting = ParkedJob.objects.filter(woken_at__isnull=True, queue_limit__isnull=True)
        return _reconcile_parked(self, waiting, "slot_id")


class SlotLeaseManager(models.Manager["SlotLease"]):
    """Leases: reaping the leases of dead holders and dropping those of revoked jobs."""

    def reap(self, *, timeout: float) -> Reaped:
        """Delete leases whose holder is dead (or whose reservation expired) and give their
        tenant slots and queue places back, on every queue; delete dead process rows."""
        alias = router.db_for_write(self.model)
        if not _is_postgres(alias):
            return self._reap_portable(alias, timeout)
        leases, slots, queues = 0, [], []
        for kind, row_id, n in _run(alias, "reap", {"timeout": timeout}):
            if kind == "leases":
                leases = n
            elif kind == "slot":
                slots.append((row_id, n))
            elif kind == "queue":
                queues.append((row_id, n))
        return Reaped(leases, tuple(sorted(slots)), tuple(sorted(queues)))

    def _reap_portable(self, alias: str, timeout: float) -> Reaped:
        from django_fair_jobs.models import WorkerProcess

        with transaction.atomic(using=alias):
            live = WorkerProcess.objects.filter(last_heartbeat_at__gte=_ago(timeout)).values("pk")
            stale = list(
                self.filter(
                    Q(process__isnull=True, acquired_at__lt=_ago(timeout))
                    | (
                        Q(process__isnull=False, acquired_at__lt=_ago(timeout))
                        & ~Q(process_id__in=live)
                    )
                )
            )
            slots, queues = _give_back(stale)
            WorkerProcess.objects.filter(last_heartbeat_at__lt=_ago(timeout)).delete()
        return Reaped(len(stale), tuple(sorted(slots.items())), tuple(sorted(queues.items())))

    def drop_for_task(self, task_id: str, *, running: bool) -> tuple[list[int], list[int]]:
        """Drop the leases of a revoked ``task_id`` and give their slots back.

        Reservations (no process) always go. Leases of a running copy go only with
        ``running=True`` (the job was terminated): revoking or expiring a duplicate copy
        must not free the slot of the copy that runs. Returns the ids of the tenant slots
        and of the queue rows freed.
        """
        with transaction.atomic(using=router.db_for_write(self.model)):
            leases = self.select_for_update().filter(task_id=task_id)
            if not running:
                leases = leases.filter(process__isnull=True)
            slots, queues = _give_back(list(leases))
        return sorted(slots), sorted(queues)

    def drop_held_by(
        self, task_ids: Sequence[str], process_id: uuid.UUID
    ) -> tuple[list[int], list[int]]:
        """Drop the leases of ``task_ids`` held by ``process_id`` and give their slots
        back: the leases of acquires that committed while their reply was lost, which no
        copy of the job can claim while that process lives. Returns the ids of the tenant
        slots and of the queue rows freed."""
        with transaction.atomic(using=router.db_for_write(self.model)):
            leases = (
                self.select_for_update()
                .filter(task_id__in=list(task_ids), process_id=process_id)
                .order_by("pk")
            )
            slots, queues = _give_back(list(leases))
        return sorted(slots), sorted(queues)


def _give_back(leases: Sequence[SlotLease]) -> tuple[dict[int, int], dict[int, int]]:
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


class ParkedJobManager(models.Manager["ParkedJob"]):
    """Parked jobs: putting lost wake-ups back in line, forgetting revoked ones."""

    def rewake_lost(self, *, timeout: float) -> int:
        """Return woken jobs that never started (and lost their reservation) to waiting.

        Returns the number of slots touched.
        """
        alias = router.db_for_write(self.model)
        if _is_postgres(alias):
            return len(_run(alias, "rewake_lost", {"timeout": timeout}))
        from django_fair_jobs.models import QueueLimit, SlotLease, TenantQueueSlot

        with transaction.atomic(using=alias):
            leased = SlotLease.objects.filter(
                slot_id=models.OuterRef("slot_id"), task_id=models.OuterRef("task_id")
            )
            lost = self.filter(woken_at__lt=_ago(timeout)).filter(
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

    def forget(self, task_id: str) -> None:
        """Delete the parked row of ``task_id`` (a revoked job), fixing the counter."""
        from django_fair_jobs.models import QueueLimit, TenantQueueSlot

        found = self.filter(task_id=task_id).values_list("queue_limit_id", "slot_id").first()
        if found is None:
            return
        queue_id, slot_id = found
        waiting_on: models.QuerySet[Any] = (
            QueueLimit.objects.filter(pk=queue_id)
            if queue_id is not None
            else TenantQueueSlot.objects.filter(pk=slot_id or 0)
        )
        with transaction.atomic(using=router.db_for_write(self.model)):
            # The counter's row first, then the parked row: the order of park and wake.
            list(waiting_on.select_for_update().values_list("pk"))
            job = self.select_for_update().filter(task_id=task_id).first()
            if job is None:
                return
            job.delete()
            if job.woken_at is None:
                waiting_on.filter(parked_jobs__gt=0).update(parked_jobs=F("parked_jobs") - 1)


UNCHANGED: Any = object()
"""Marks a limit left as it is by :meth:`QueueLimitManager.set_limits`."""


class QueueLimitManager(models.Manager["QueueLimit"]):
    """Queue limits: the stored limits, and acquire, park, release and wake on a limited
    queue, each one statement on PostgreSQL (the ``*_limited`` and ``wake_queue`` blocks of
    ``sql/postgresql.sql``)."""

    def _alias(self) -> str:
        return router.db_for_write(self.model)

    def limits(self) -> dict[str, tuple[int | None, int | None]]:
        """``{queue: (max_jobs, max_jobs_per_worker)}`` of every queue with a limit set, or
        still draining (jobs holding a place or waiting in line after its limit was
        cleared: they must be given back and woken through the queue's row)."""
        rows = self.filter(
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

    def seed(self, max_jobs: dict[str, int], per_worker: dict[str, int]) -> list[str]:
        """Store the settings' limits of every queue that has no row yet; a stored row
        (changed at runtime, or cleared) is kept as it is. Returns the queues seeded."""
        wanted = set(max_jobs) | set(per_worker)
        stored = set(self.filter(queue__in=wanted).values_list("queue", flat=True))
        missing = sorted(wanted - stored)
        self.bulk_create(
            [
                self.model(queue=q, max_jobs=max_jobs.get(q), max_jobs_per_worker=per_worker.get(q))
                for q in missing
            ],
            ignore_conflicts=True,
        )
        return missing

    def set_limits(
        self, queue: str, *, max_jobs: Any = UNCHANGED, max_jobs_per_worker: Any = UNCHANGED
    ) -> QueueLimit:
        """Store new limits for ``queue`` (None: no limit; 0: paused); a limit not given is
        left as it is. Only the limit columns are written, never the counters."""
        fields: dict[str, Any] = {}
        if max_jobs is not UNCHANGED:
            fields["max_jobs"] = max_jobs
        if max_jobs_per_worker is not UNCHANGED:
            fields["max_jobs_per_worker"] = max_jobs_per_worker
        with transaction.atomic(using=self._alias()):
            row, _ = self.get_or_create(queue=queue)
            if fields:
                self.filter(pk=row.pk).update(**fields, updated_at=Now())
                row.refresh_from_db()
        return row

    def count_deferral(self, queue: str) -> None:
        """Count a deferral that did not park (``fair_on_limit = "retry"``)."""
        self.filter(queue=queue).update(deferred_total=F("deferred_total") + 1)

    def try_acquire(
        self,
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
        alias = self._alias()
        for _ in range(2):
            if _is_postgres(alias):
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
                    with _savepoint_if_needed(alias):
                        ((status, queue_id, slot_id, in_line, on_slot),) = _run(
                            alias, "acquire_limited", params
                        )
                except IntegrityError:
                    return LimitedAcquisition("duplicate")
            else:
                status, queue_id, slot_id, in_line, on_slot = self._acquire_portable(
                    queue, tenant, limit, task_id, token, process_id, node_id, woken
                )
            if status != "new_tenant":
                break
            TenantQueueSlot.objects.bulk_create(
                [TenantQueueSlot(tenant=str(tenant), queue=queue, default_max_jobs=limit)],
                ignore_conflicts=True,
            )
        if status != "held":
            return LimitedAcquisition(status)
        # A duplicate delivery started while its parked row was still waiting.
        if in_line:
            self.filter(pk=queue_id, parked_jobs__gt=0).update(parked_jobs=F("parked_jobs") - 1)
        if on_slot:
            TenantQueueSlot.objects.filter(pk=slot_id, parked_jobs__gt=0).update(
                parked_jobs=F("parked_jobs") - 1
            )
        return LimitedAcquisition("held", Grant(slot_id, task_id, token, queue_id))

    def _acquire_portable(
        self,
        queue: str,
        tenant: str | None,
        limit: int,
        task_id: str,
        token: uuid.UUID,
        process_id: uuid.UUID,
        node_id: uuid.UUID,
        woken: bool,
    ) -> tuple[LimitedStatus, int | None, int | None, int, int]:
        from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot

        node = str(node_id)
        with transaction.atomic(using=self._alias()):
            row = self.select_for_update().filter(queue=queue).first()
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
            self.filter(pk=row.pk).update(
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
        self,
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
        :meth:`TenantQueueSlotManager.try_park`."""
        alias = self._alias()
        if _is_postgres(alias):
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
            ((outcome,),) = _run(alias, "park_limited", params)
            return outcome  # type: ignore[no-any-return]
        return self._park_portable(
            queue, tenant, limit, task_id, task_name, signature, str(node_id), woken
        )

    def _park_portable(
        self,
        queue: str,
        tenant: str | None,
        limit: int,
        task_id: str,
        task_name: str,
        signature: str,
        node: str,
        woken: bool,
    ) -> ParkOutcome:
        from django_fair_jobs.models import ParkedJob, TenantQueueSlot

        with transaction.atomic(using=self._alias()):
            refused = _park_refused(task_id, woken)
            if refused is not None:
                return refused
            row = self.select_for_update().filter(queue=queue).first()
            slot = (
                None
                if tenant is None
                else TenantQueueSlot.objects.filter(tenant=tenant, queue=queue).first()
            )
            tenant_full = slot is not None and slot.current_jobs >= _slot_limit(slot, limit)
            if row is None or not (_queue_blocked(row, node) or tenant_full):
                return "room"
            self.filter(pk=row.pk).update(
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

    def release(self, grant: Grant) -> tuple[int, int | None] | None:
        """Give back ``grant``'s place in its queue and its tenant slot, only if its lease
        is still the holder's. Returns the ``parked_jobs`` of the queue row and of the
        tenant slot (None without one) after the release, or None if the lease was gone."""
        alias = self._alias()
        params: dict[str, Any] = {
            "queue_limit_id": grant.queue_limit_id,
            "task_id": grant.task_id,
            "token": grant.token,
        }
        if _is_postgres(alias):
            rows = _run(alias, "release_limited", params)
            if not rows:
                return None
            in_line, on_slot = rows[0]
            return int(in_line or 0), on_slot
        from django_fair_jobs.models import SlotLease, TenantQueueSlot

        with transaction.atomic(using=alias):
            lease = SlotLease.objects.filter(
                queue_limit_id=grant.queue_limit_id, task_id=grant.task_id, token=grant.token
            ).first()
            if lease is None:
                return None
            _give_back([lease])
            in_line = self.filter(pk=grant.queue_limit_id or 0).values_list(
                "parked_jobs", flat=True
            )
            on_slot = TenantQueueSlot.objects.filter(pk=grant.slot_id or 0).values_list(
                "parked_jobs", flat=True
            )
            return (in_line.first() or 0), on_slot.first()

    def wake_one(self, queue_limit_id: int) -> Woken | None:
        """Mark the oldest job of the queue's line that can start now as woken; the caller
        re-publishes it. No place is reserved (see ``wake_queue``)."""
        alias = self._alias()
        if _is_postgres(alias):
            rows = _run(alias, "wake_queue", {"queue_limit_id": queue_limit_id})
            return Woken(queue_limit_id, *rows[0]) if rows else None
        from django_fair_jobs.models import ParkedJob, TenantQueueSlot

        with transaction.atomic(using=alias):
            row = self.select_for_update().filter(pk=queue_limit_id).first()
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
            self.filter(pk=queue_limit_id).update(parked_jobs=Greatest(F("parked_jobs") - 1, 0))
            ParkedJob.objects.filter(pk=job.pk).update(
                woken_at=Now(), wake_count=F("wake_count") + 1
            )
        return Woken(queue_limit_id, job.task_id, job.signature, job.wake_count + 1)

    def with_waiting_room(self, live_nodes: int) -> list[tuple[int, int]]:
        """Queues with jobs waiting in line and room to start some (missed wake-ups, a
        reap, a raised limit): ``[(queue row id, jobs to wake)]``. Without a cluster-wide
        limit the room is the per-worker limit times ``live_nodes``."""
        wanted: list[tuple[int, int]] = []
        for row in self.filter(parked_jobs__gt=0):
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

    def reconcile_parked(self) -> int:
        """Repair ``parked_jobs`` where it disagrees with the rows waiting in the queue's
        line; returns how many rows were fixed (each under its row lock)."""
        from django_fair_jobs.models import ParkedJob

        waiting = ParkedJob.objects.filter(woken_at__isnull=True)
        return _reconcile_parked(self, waiting, "queue_limit_id")

    def reconcile_running(self) -> int:
        """Repair ``current_jobs`` and ``running`` where they disagree with the queue's
        leases (a place taken and never given back); returns how many rows were fixed.

        Each row is recounted under its row lock, in a statement that starts after the
        lock is held: every statement that adds or removes a queue's lease locks that
        queue's row in the same transaction, so the count cannot miss one in flight."""
        expected = _queue_lease_counts(None)
        rows = list(self.values_list("pk", "current_jobs", "running"))
        suspects = [
            pk
            for pk, current, running in rows
            if (current, dict(running or {})) != _totals(expected.get(pk, {}))
        ]
        for pk in suspects:
            with transaction.atomic(using=self._alias()):
                list(self.select_for_update().filter(pk=pk).values_list("pk"))
                total, running = _totals(_queue_lease_counts(pk).get(pk, {}))
                self.filter(pk=pk).update(current_jobs=total, running=running, updated_at=Now())
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


def _reconcile_parked(manager: Any, waiting: models.QuerySet[ParkedJob], key: str) -> int:
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
        with transaction.atomic(using=manager._alias()):
            list(manager.select_for_update().filter(pk=pk).values_list("pk"))
            manager.filter(pk=pk).update(parked_jobs=Coalesce(count, 0))
    return len(suspects)


def _park_refused(task_id: str, woken: bool) -> ParkOutcome | None:
    """The ORM path's answer before any park: the job is already waiting (a duplicate
    delivery), or it is a woken copy whose parked row another copy took; else None."""
    from django_fair_jobs.models import ParkedJob

    if ParkedJob.objects.filter(task_id=task_id, woken_at__isnull=True).exists():
        return "already_parked"
    if woken and not ParkedJob.objects.filter(task_id=task_id).exists():
        return "stale"
    return None


def _queue_blocked(row: QueueLimit, node: str) -> bool:
    """True if ``row``'s queue is at its cluster-wide limit, or at its per-worker limit on
    ``node`` (the ORM path's copy of the SQL verdict)."""
    if row.max_jobs is not None and row.current_jobs >= row.max_jobs:
        return True
    on_node = int(row.running.get(node, 0))
    return row.max_jobs_per_worker is not None and on_node >= row.max_jobs_per_worker


def _slot_limit(slot: TenantQueueSlot, limit: int) -> int:
    return limit if slot.max_jobs is None else slot.max_jobs


class MaintenanceManager(models.Manager["Maintenance"]):
    """Cluster-wide pacing of maintenance passes."""

    def claim(self, name: str, *, interval: float) -> bool:
        """True if this caller may run ``name`` now: nobody ran it for ``interval`` seconds.

        One conditional upsert on PostgreSQL; two callers at once cannot both win.
        """
        alias = router.db_for_write(self.model)
        if _is_postgres(alias):
            return bool(_run(alias, "claim_maintenance", {"name": name, "interval": interval}))
        with transaction.atomic(using=alias):
            if self.filter(name=name, last_run_at__lt=_ago(interval)).update(last_run_at=Now()):
                return True
            if self.filter(name=name).exists():
                return False
            self.create(name=name)
        return True

    def count_reaped(self, leases: int) -> None:
        """Add ``leases`` reaped leases to the cluster-wide total (for the metrics)."""
        if not self.filter(name="reaped").update(
            leases_reaped_total=F("leases_reaped_total") + leases
        ):
            try:
                with transaction.atomic(using=router.db_for_write(self.model)):
                    self.create(name="reaped", leases_reaped_total=leases)
            except IntegrityError:
                self.filter(name="reaped").update(
                    leases_reaped_total=F("leases_reaped_total") + leases
                )


class WorkerProcessManager(models.Manager["WorkerProcess"]):
    """Worker process rows and their heartbeats (database clock only)."""

    def register(
        self,
        *,
        process_id: uuid.UUID,
        node: str,
        hostname: str,
        pid: int,
        node_id: uuid.UUID | None = None,
        queues: list[str] | None = None,
        concurrency: int = 1,
    ) -> None:
        """Insert this process's row, or refresh it if it exists (re-registration after a
        stall during which it was reaped). ``node_id``: the worker node's identity (a new
        one if not given); ``queues`` and ``concurrency``: what it consumes and how many
        jobs it runs at once (fair dispatch's capacity)."""
        self.update_or_create(
            pk=process_id,
            defaults={
                "node": node,
                "queues": list(queues or ()),
                "concurrency": concurrency,
                "node_id": node_id or uuid.uuid4(),
                "hostname": hostname,
                "pid": pid,
                "last_heartbeat_at": Now(),
            },
        )

    def live_nodes(self, timeout: float) -> int:
        """How many worker nodes have a process that beat within ``timeout`` seconds."""
        live = self.filter(last_heartbeat_at__gte=_ago(timeout))
        return live.values("node_id").distinct().count()

    def beat(self, process_id: uuid.UUID) -> bool:
        """Refresh the heartbeat; False if the row is gone (this process was reaped)."""
        return bool(self.filter(pk=process_id).update(last_heartbeat_at=Now()))

    def retire(self, process_id: uuid.UUID) -> None:
        """Delete this process's row at a clean shutdown, so its leases are reaped at once."""
        self.filter(pk=process_id).delete()


_side_connections = threading.local()


def _autocommit_connection(alias: str) -> BaseDatabaseWrapper:
    """The connection to count enqueues on: the thread's own, unless it is inside a
    transaction on PostgreSQL; then a second connection of this thread, in autocommit.

    Celery publishes at once, not at commit, so the count must commit at once too. Run in
    the caller's transaction, it would also hold the tenant's hot window row locked until
    that transaction ends (a whole request under ``ATOMIC_REQUESTS``), serializing every
    publisher of that tenant. SQLite has one writer anyway and keeps the caller's.
    """
    connection = connections[alias]
    if not connection.in_atomic_block or connection.vendor != "postgresql":
        return connection
    side: BaseDatabaseWrapper | None = getattr(_side_connections, alias, None)
    if side is None:
        side = connections.create_connection(alias)
        setattr(_side_connections, alias, side)
    return side


def _count_enqueue(connection: BaseDatabaseWrapper, params: dict[str, Any]) -> Any:
    """Run the count of one enqueue on ``connection``; returns (counts, picked rule)."""
    with connection.cursor() as cursor:
        cursor.execute(queries()["record_enqueue"], params)
        return cursor.fetchone()


def _forget_side_connection(alias: str) -> None:
    side: BaseDatabaseWrapper | None = getattr(_side_connections, alias, None)
    if side is not None:
        delattr(_side_connections, alias)
        with contextlib.suppress(DatabaseError):  # a dead connection may refuse to close
            side.close()


class TenantWindowManager(models.Manager["TenantWindow"]):
    """Enqueue counts per (counting key, tenant), per-second buckets, reroute counts."""

    def reset(self, pks: Sequence[int]) -> int:
        """Forget the enqueue counts of windows ``pks`` (their buckets go with them): the
        next enqueue starts a new count. Returns how many windows were reset."""
        deleted = self.filter(pk__in=list(pks)).delete()[1]
        return int(deleted.get(self.model._meta.label, 0))

    def record(
        self,
        *,
        key: str,
        tenant: str,
        task_name: str,
        rules: Sequence[tuple[int, int, str]],
        at: datetime | None = None,
    ) -> Recorded:
        """Count one enqueue and pick the rule that reroutes it.

        ``rules`` are ``(per, threshold, queue)`` in declaration order. A rule matches when
        the count within its last ``per`` seconds (whole seconds of the database clock,
        both ends included, this enqueue included) is above ``threshold``; the last match
        wins and its reroute is counted. ``at`` replaces the database clock (tests, replays).
        One statement on PostgreSQL, committed at once even inside a transaction.
        """
        alias = router.db_for_write(self.model)
        if _is_postgres(alias):
            params = {
                "key": key,
                "tenant": tenant,
                "task_name": task_name,
                "at": at,
                "pers": [per for per, _, _ in rules],
                "thresholds": [threshold for _, threshold, _ in rules],
                "queues": [queue for _, _, queue in rules],
            }
            connection = _autocommit_connection(alias)
            try:
                counts, picked = _count_enqueue(connection, params)
            except DatabaseError as exc:
                if connection is connections[alias]:
                    raise
                _forget_side_connection(alias)
                # The side connection lives outside Django's request cycle, so nothing
                # checks it between uses: after a database or pooler restart, or an idle
                # timeout, it is dead at its next use. One more try on a new one (if the
                # count committed before its reply was lost, the enqueue counts twice: a
                # window one higher, no job lost); any other error is raised as it is.
                if not isinstance(exc, OperationalError | InterfaceError):
                    raise
                counts, picked = _count_enqueue(_autocommit_connection(alias), params)
            return Recorded(tuple(counts), None if picked is None else picked - 1)
        with transaction.atomic(using=alias):
            return self._record_portable(key, tenant, task_name, rules, at)

    def _record_portable(
        self,
        key: str,
        tenant: str,
        task_name: str,
        rules: Sequence[tuple[int, int, str]],
        at: datetime | None,
    ) -> Recorded:
        from django_fair_jobs.models import RerouteCount, WindowBucket

        second = int(at.timestamp()) if at is not None else self.database_second()
        window, _ = self.get_or_create(key=key, tenant=tenant, defaults={"last_second": second})
        self.filter(pk=window.pk).update(
            total=F("total") + 1, last_second=Greatest(F("last_second"), second)
        )
        window.refresh_from_db(fields=["total", "last_second"])
        second, total = window.last_second, window.total
        if not WindowBucket.objects.filter(window=window, second=second).update(
            cum=Greatest(F("cum"), total)
        ):
            WindowBucket.objects.create(window=window, second=second, cum=total)
        counts = tuple(total - self._cum_before(window.pk, second - per) for per, _, _ in rules)
        matches = [
            i
            for i, (n, (_, threshold, _)) in enumerate(zip(counts, rules, strict=True))
            if n > threshold
        ]
        picked = matches[-1] if matches else None
        if picked is not None:
            reroutes, _ = RerouteCount.objects.get_or_create(
                tenant=tenant, task_name=task_name, queue=rules[picked][2]
            )
            RerouteCount.objects.filter(pk=reroutes.pk).update(total=F("total") + 1, last_at=Now())
        return Recorded(counts, picked)

    @staticmethod
    def _cum_before(window_id: int, second: int) -> int:
        from django_fair_jobs.models import WindowBucket

        cum = (
            WindowBucket.objects.filter(window_id=window_id, second__lt=second)
            .order_by("-second")
            .values_list("cum", flat=True)
            .first()
        )
        return cum or 0

    def database_second(self) -> int:
        """The database clock as a Unix second (SQLite: the host's clock, the same one)."""
        alias = router.db_for_write(self.model)
        with connections[alias].cursor() as cursor:
            if _is_postgres(alias):
                cursor.execute("SELECT floor(extract(epoch FROM now()))::bigint")
            else:
                cursor.execute("SELECT CAST(strftime('%s', 'now') AS INTEGER)")
            return int(cursor.fetchone()[0])

    def current_counts(
        self, window: TenantWindow, pers: Sequence[int], now: int | None = None
    ) -> list[int]:
        """How many enqueues each window of ``pers`` seconds holds at Unix second ``now``
        (default: the database clock's), for the admin."""
        now = self.database_second() if now is None else now
        return [window.total - self._cum_before(window.pk, now - per) for per in pers]

    def prune(self, *, max_window: int) -> int:
        """Delete the windows (with their buckets) and reroute counts of tenants idle for
        longer than ``max_window`` seconds, and the other windows' buckets that no window
        reads any more; returns how many windows went."""
        from django_fair_jobs.models import RerouteCount, WindowBucket

        alias = router.db_for_write(self.model)
        if _is_postgres(alias):
            return int(_run(alias, "prune_windows", {"max_window": max_window})[0][0])
        with transaction.atomic(using=alias):
            cutoff = self.database_second() - max_window
            idle = list(self.filter(last_second__lt=cutoff).values_list("pk", flat=True))
            WindowBucket.objects.filter(window_id__in=idle).delete()
            self.filter(pk__in=idle).delete()
            RerouteCount.objects.filter(last_at__lt=_ago(max_window)).delete()
            for window_id in self.values_list("pk", flat=True):
                anchor = (
                    WindowBucket.objects.filter(window_id=window_id, second__lt=cutoff)
                    .order_by("-second")
                    .values_list("second", flat=True)
                    .first()
                )
                if anchor is not None:
                    WindowBucket.objects.filter(window_id=window_id, second__lt=anchor).delete()
        return len(idle)


_ERROR_CHARS = 2000
"""The most of a failed publish's error a planned row keeps (a refused message's error can
quote the message)."""


class PlannedJobManager(models.Manager["PlannedJob"]):
    """The planner's virtual queues: store, claim and promote, mark started, measure."""

    def _alias(self) -> str:
        return router.db_for_write(self.model)

    def pending(self, task_name: str) -> dict[str, tuple[int, datetime]]:
        """``{tenant: (jobs waiting, oldest enqueue)}`` of ``task_name``'s virtual queues,
        counting only jobs due now (no ``not_before`` in the future) and not failed."""
        rows = (
            self.filter(task_name=task_name, promoted_at__isnull=True, failed_at__isnull=True)
            .filter(Q(not_before__isnull=True) | Q(not_before__lte=Now()))
            .values("tenant")
            .annotate(n=models.Count("pk"), oldest=models.Min("enqueued_at"))
            .values_list("tenant", "n", "oldest")
        )
        return {tenant: (n, oldest) for tenant, n, oldest in rows}

    def promote(
        self,
        task_name: str,
        tenant: str,
        count: int,
        publish: Callable[[PlannedJob], None],
        *,
        transient: tuple[type[BaseException], ...] = (Exception,),
        max_attempts: int = 0,
        gave_up: Callable[[PlannedJob, BaseException], None] | None = None,
    ) -> list[str]:
        """Claim up to ``count`` of ``tenant``'s oldest due jobs (rows another planner holds
        are skipped, never waited for; failed rows are left out), ``publish`` each, then mark
        the published ones promoted, all in one transaction. Returns the task ids promoted.

        An error of a ``transient`` type (the broker or the database is unreachable; by
        default any error) rolls the whole batch back and is raised: every claimed job
        stays in line for the next run (at-least-once), and nothing is counted against the
        jobs. Any other error is the job's own (a serializer refuses it, the broker refuses
        its size): each publish runs in a savepoint, so the failure undoes only that job's
        writes; the job counts an attempt and keeps the error, the rest of the batch goes
        on, and at ``max_attempts`` (0: never) the job is failed for good and, after the
        commit, handed to ``gave_up``."""
        failed_for_good: list[tuple[PlannedJob, BaseException]] = []
        with transaction.atomic(using=self._alias()):
            rows = list(
                self.select_for_update(skip_locked=True)
                .filter(task_name=task_name, tenant=tenant, promoted_at__isnull=True)
                .filter(failed_at__isnull=True)
                .filter(Q(not_before__isnull=True) | Q(not_before__lte=Now()))
                .order_by("id")[:count]
            )
            published = []
            for row in rows:
                try:
                    with transaction.atomic(using=self._alias()):
                        publish(row)
                except transient:
                    raise
                except Exception as exc:
                    row.attempts += 1
                    row.last_error = f"{exc.__class__.__name__}: {exc}"[:_ERROR_CHARS]
                    gives_up = 0 < max_attempts <= row.attempts
                    self.filter(pk=row.pk).update(
                        attempts=row.attempts,
                        last_error=row.last_error,
                        failed_at=Now() if gives_up else None,
                    )
                    if gives_up:
                        failed_for_good.append((row, exc))
                    continue
                published.append(row)
            self.filter(pk__in=[row.pk for row in published]).update(promoted_at=Now())
        for job, error in failed_for_good:
            if gave_up is not None:
                gave_up(job, error)
        return [row.task_id for row in published]

    def retry_failed(self, rows: models.QuerySet[PlannedJob]) -> int:
        """Put failed jobs among ``rows`` back in line, in their old place, with their
        attempts cleared (``last_error`` is kept until they are published); returns how
        many. For an operator who removed the cause (raised the broker's size limit)."""
        return rows.filter(failed_at__isnull=False).update(failed_at=None, attempts=0)

    def requeue_stale(self, task_name: str, older_than: float) -> int:
        """Put ``task_name``'s jobs promoted more than ``older_than`` seconds ago (database
        clock) and never started back in line, in their old place: their message is
        presumed lost (a purged queue), or their start failed to delete the row. The next
        promotion publishes them again with the same task id (at least once). Returns
        how many."""
        cutoff = database_now(self._alias()) - timedelta(seconds=older_than)
        return self.filter(task_name=task_name, promoted_at__lt=cutoff).update(promoted_at=None)

    def latency(self, task_name: str, stale_after: float | None = None) -> tuple[float | None, int]:
        """The latency of the queues ``task_name``'s jobs go to: the age in seconds
        (database clock) of the oldest job promoted to any of them and not started yet (of
        any planned task), or None; and how many such jobs there are (their depth). Rows
        promoted more than ``stale_after`` seconds ago do not count: a row left behind
        never holds the queue back for good (see :meth:`requeue_stale`)."""
        now = database_now(self._alias())
        queues = self.filter(task_name=task_name).values("queue").distinct()
        promoted = self.filter(queue__in=queues, promoted_at__isnull=False)
        if stale_after is not None:
            promoted = promoted.filter(promoted_at__gte=now - timedelta(seconds=stale_after))
        found = promoted.aggregate(oldest=models.Min("promoted_at"), depth=models.Count("pk"))
        if found["oldest"] is None:
            return None, 0
        age = (now - found["oldest"]).total_seconds()
        return max(age, 0.0), int(found["depth"])

    def started(self, task_id: str) -> bool:
        """A job of a planned task starts (or was revoked): its row goes. False if there
        was none (a retry, or a second copy of a job promoted twice)."""
        deleted, _ = self.filter(task_id=task_id).delete()
        return bool(deleted)

    def claim_run(self, task_name: str, *, interval: float, lock_ttl: float) -> uuid.UUID | None:
        """Take ``task_name``'s planner lock for ``lock_ttl`` seconds if its next run is due
        and nobody holds the lock; schedule the next run ``interval`` seconds on. Returns the
        lock token, or None. One conditional UPDATE: two callers cannot both win."""
        from datetime import timedelta

        from django_fair_jobs.models import PlannerRun

        token = uuid.uuid4()
        alias = self._alias()
        if _is_postgres(alias):
            params = {"task_name": task_name, "interval": interval, "ttl": lock_ttl,
                      "token": token}  # fmt: skip
            return token if _run(alias, "claim_planner", params) else None
        PlannerRun.objects.get_or_create(task_name=task_name)
        claimed = (
            PlannerRun.objects.filter(task_name=task_name, next_run_at__lte=Now())
            .filter(Q(locked_until__isnull=True) | Q(locked_until__lt=Now()))
            .update(
                locked_until=Now() + models.Value(timedelta(seconds=lock_ttl)),
                lock_token=token,
                next_run_at=Now() + models.Value(timedelta(seconds=interval)),
                last_run_at=Now(),
            )
        )
        return token if claimed else None

    def finish_run(self, task_name: str, token: uuid.UUID, **outcome: Any) -> None:
        """Record what a run did and release its lock, only if this run still holds it."""
        from django_fair_jobs.models import PlannerRun

        PlannerRun.objects.filter(task_name=task_name, lock_token=token).update(
            locked_until=None, lock_token=None, runs_total=F("runs_total") + 1, **outcome
        )

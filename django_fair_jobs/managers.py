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

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from django.db import DatabaseError, IntegrityError, connections, models, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Q
from django.db.models.functions import Coalesce, Greatest, Now

from django_fair_jobs.sql import queries

if TYPE_CHECKING:
    from datetime import timedelta

    # Used in the Manager["..."] subscripts below, which the linter cannot see.
    from django_fair_jobs.models import (  # noqa: F401
        Maintenance,
        ParkedJob,
        SlotLease,
        TenantQueueSlot,
        TenantWindow,
        WorkerProcess,
    )


ParkOutcome = Literal["parked", "already_parked", "room", "stale"]
AcquireStatus = Literal["held", "full", "duplicate", "stale"]


@dataclass(frozen=True)
class Grant:
    """Proof that a job holds a slot: what :meth:`TenantQueueSlotManager.release` needs."""

    slot_id: int
    task_id: str
    token: uuid.UUID


@dataclass(frozen=True)
class Acquisition:
    """The answer of an acquire: ``"held"`` (with a grant), ``"full"`` (the tenant is at
    its limit), ``"duplicate"`` (this task id is running in a live process) or ``"stale"``
    (a copy of a woken parked job that another copy already started)."""

    status: AcquireStatus
    grant: Grant | None = None


@dataclass(frozen=True)
class Woken:
    """A parked job that was given a slot and must now be re-published."""

    slot_id: int
    task_id: str
    signature: str
    wake: int


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
        whose lease is held by a live process is a ``"duplicate"`` delivery. A ``woken``
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
                if live:
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
            if ParkedJob.objects.filter(task_id=task_id, woken_at__isnull=True).exists():
                return "already_parked"
            if woken and not ParkedJob.objects.filter(task_id=task_id).exists():
                return "stale"
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
        params: dict[str, Any] = {
            "slot_id": grant.slot_id,
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
            self.filter(pk=grant.slot_id, current_jobs__gt=0).update(
                current_jobs=F("current_jobs") - 1, updated_at=Now()
            )
            parked: int = self.filter(pk=grant.slot_id).values_list("parked_jobs", flat=True)[0]
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
            candidates = ParkedJob.objects.filter(slot_id=slot_id, woken_at__isnull=True).exclude(
                models.Exists(running)
            )
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
            ParkedJob.objects.filter(woken_at__isnull=True)
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

        waiting = models.Subquery(
            ParkedJob.objects.filter(slot_id=models.OuterRef("pk"), woken_at__isnull=True)
            .order_by()
            .values("slot_id")
            .annotate(n=models.Count("pk"))
            .values("n")
        )
        suspects = list(
            self.annotate(waiting=Coalesce(waiting, 0))
            .exclude(parked_jobs=F("waiting"))
            .values_list("pk", flat=True)
        )
        for slot_id in suspects:
            with transaction.atomic(using=self._alias()):
                list(self.select_for_update().filter(pk=slot_id).values_list("pk"))
                self.filter(pk=slot_id).update(parked_jobs=Coalesce(waiting, 0))
        return len(suspects)


class SlotLeaseManager(models.Manager["SlotLease"]):
    """Leases: reaping the leases of dead holders and dropping those of revoked jobs."""

    def reap(self, *, timeout: float) -> list[tuple[int, int]]:
        """Delete leases whose holder is dead (or whose reservation expired) and give their
        slots back; delete dead process rows. Returns ``[(slot_id, leases_reaped)]``."""
        alias = router.db_for_write(self.model)
        if _is_postgres(alias):
            return [(row[0], row[1]) for row in _run(alias, "reap", {"timeout": timeout})]
        return self._reap_portable(alias, timeout)

    def _reap_portable(self, alias: str, timeout: float) -> list[tuple[int, int]]:
        from django_fair_jobs.models import TenantQueueSlot, WorkerProcess

        with transaction.atomic(using=alias):
            live = WorkerProcess.objects.filter(last_heartbeat_at__gte=_ago(timeout)).values("pk")
            stale = self.filter(
                Q(process__isnull=True, acquired_at__lt=_ago(timeout))
                | (
                    Q(process__isnull=False, acquired_at__lt=_ago(timeout))
                    & ~Q(process_id__in=live)
                )
            )
            counts: dict[int, int] = {}
            for slot_id in stale.values_list("slot_id", flat=True):
                counts[slot_id] = counts.get(slot_id, 0) + 1
            stale.delete()
            WorkerProcess.objects.filter(last_heartbeat_at__lt=_ago(timeout)).delete()
            for slot_id, n in counts.items():
                TenantQueueSlot.objects.filter(pk=slot_id).update(
                    current_jobs=Greatest(F("current_jobs") - n, 0), updated_at=Now()
                )
        return sorted(counts.items())

    def drop_for_task(self, task_id: str, *, running: bool) -> list[int]:
        """Drop the leases of a revoked ``task_id`` and give the slots back.

        Reservations (no process) always go. Leases of a running copy go only with
        ``running=True`` (the job was terminated): revoking or expiring a duplicate copy
        must not free the slot of the copy that runs. Returns the ids of the slots freed.
        """
        from django_fair_jobs.models import TenantQueueSlot

        freed: list[int] = []
        leases = self.select_for_update().filter(task_id=task_id)
        if not running:
            leases = leases.filter(process__isnull=True)
        with transaction.atomic(using=router.db_for_write(self.model)):
            for lease in leases:
                lease.delete()
                TenantQueueSlot.objects.filter(pk=lease.slot_id, current_jobs__gt=0).update(
                    current_jobs=F("current_jobs") - 1, updated_at=Now()
                )
                freed.append(lease.slot_id)
        return freed


class ParkedJobManager(models.Manager["ParkedJob"]):
    """Parked jobs: putting lost wake-ups back in line, forgetting revoked ones."""

    def rewake_lost(self, *, timeout: float) -> int:
        """Return woken jobs that never started (and lost their reservation) to waiting.

        Returns the number of slots touched.
        """
        alias = router.db_for_write(self.model)
        if _is_postgres(alias):
            return len(_run(alias, "rewake_lost", {"timeout": timeout}))
        from django_fair_jobs.models import SlotLease, TenantQueueSlot

        with transaction.atomic(using=alias):
            leased = SlotLease.objects.filter(
                slot_id=models.OuterRef("slot_id"), task_id=models.OuterRef("task_id")
            )
            lost = self.filter(woken_at__lt=_ago(timeout)).exclude(models.Exists(leased))
            counts: dict[int, int] = {}
            for slot_id in lost.values_list("slot_id", flat=True):
                counts[slot_id] = counts.get(slot_id, 0) + 1
            lost.update(woken_at=None)
            for slot_id, n in counts.items():
                TenantQueueSlot.objects.filter(pk=slot_id).update(parked_jobs=F("parked_jobs") + n)
        return len(counts)

    def forget(self, task_id: str) -> None:
        """Delete the parked row of ``task_id`` (a revoked job), fixing the counter."""
        from django_fair_jobs.models import TenantQueueSlot

        with transaction.atomic(using=router.db_for_write(self.model)):
            job = self.select_for_update().filter(task_id=task_id).first()
            if job is None:
                return
            job.delete()
            if job.woken_at is None:
                TenantQueueSlot.objects.filter(pk=job.slot_id, parked_jobs__gt=0).update(
                    parked_jobs=F("parked_jobs") - 1
                )


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


class WorkerProcessManager(models.Manager["WorkerProcess"]):
    """Worker process rows and their heartbeats (database clock only)."""

    def register(self, *, process_id: uuid.UUID, node: str, hostname: str, pid: int) -> None:
        """Insert this process's row, or refresh it if it exists (re-registration after a
        stall during which it was reaped)."""
        self.update_or_create(
            pk=process_id,
            defaults={
                "node": node,
                "hostname": hostname,
                "pid": pid,
                "last_heartbeat_at": Now(),
            },
        )

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


def _forget_side_connection(alias: str) -> None:
    side: BaseDatabaseWrapper | None = getattr(_side_connections, alias, None)
    if side is not None:
        side.close()
        delattr(_side_connections, alias)


class TenantWindowManager(models.Manager["TenantWindow"]):
    """Enqueue counts per (counting key, tenant), per-second buckets, reroute counts."""

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
                with connection.cursor() as cursor:
                    cursor.execute(queries()["record_enqueue"], params)
                    counts, picked = cursor.fetchone()
            except DatabaseError:
                if connection is not connections[alias]:
                    _forget_side_connection(alias)
                raise
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

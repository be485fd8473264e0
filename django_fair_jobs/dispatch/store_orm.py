"""Fair dispatch's storage on databases other than PostgreSQL (SQLite, for development and
the demo): the same steps as ``sql/dispatch.sql``, each in one ORM transaction. SQLite runs
one writing transaction at a time, so each step sees no concurrent change."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from django_fair_jobs.dispatch import store as pg_store
from django_fair_jobs.dispatch.models import (
    DISPATCHED,
    LOAD,
    RUNNING,
    SCHEDULED,
    WAITING,
    DispatchJob,
    DispatchQueue,
    DispatchTenant,
)
from django_fair_jobs.dispatch.types import BATCH, Job, Ready, Started


class Store(pg_store.Store):
    """The ORM store of one database alias (maintenance reads are shared with the
    PostgreSQL store where they are plain ORM already)."""

    def _jobs(self) -> Any:
        return DispatchJob.objects.using(self.alias)

    def _tenants(self) -> Any:
        return DispatchTenant.objects.using(self.alias)

    def _queues(self) -> Any:
        return DispatchQueue.objects.using(self.alias)

    def _head(self, queue: str, tenant: str) -> int | None:
        first = (
            self._jobs()
            .filter(queue=queue, tenant=tenant, state=WAITING)
            .order_by("id")
            .values_list("id", flat=True)
            .first()
        )
        return None if first is None else int(first)

    def _into_line(self, queue: str, vt: float) -> None:
        """Put ``queue``'s countdowns and ETAs come due in their tenants' lines (a tenant
        whose line was empty re-enters at the queue's virtual time ``vt``)."""
        due = self._jobs().filter(queue=queue, state=SCHEDULED, not_before__lte=Now())
        for job in list(due.order_by("id")):
            self._jobs().filter(pk=job.pk).update(state=WAITING)
            tenant = self._tenants().get(queue=queue, tenant=job.tenant)
            if tenant.waiting == 0:
                tenant.head_id, tenant.pass_value = job.pk, max(tenant.pass_value, vt)
            else:
                tenant.head_id = min(tenant.head_id or job.pk, job.pk)
            tenant.waiting += 1
            tenant.save(update_fields=["waiting", "head_id", "pass_value"])

    def _dispatch(self, queue: str, limit: int) -> list[Ready]:
        from django_fair_jobs.models import TenantQueueSlot

        row = self._queues().filter(queue=queue).first()
        self._into_line(queue, row.virtual_time if row is not None else 0.0)
        if row is None:
            return []
        room = min(row.capacity + row.slack - row.in_flight, limit)
        ready: list[Ready] = []
        caps = {
            s.tenant: s.max_jobs
            for s in TenantQueueSlot.objects.using(self.alias).filter(
                queue=queue, max_jobs__isnull=False
            )
        }
        while room > 0:
            candidates = self._tenants().filter(queue=queue, waiting__gt=0)
            chosen = None
            for tenant in candidates.order_by(LOAD, "pass_value", "head_id"):
                cap = caps.get(tenant.tenant, tenant.cap)
                if cap is None or tenant.in_flight < cap:
                    chosen = tenant
                    break
            if chosen is None:
                break
            job_id = chosen.head_id
            claimed = (
                self._jobs()
                .filter(pk=job_id, state=WAITING)
                .update(state=DISPATCHED, dispatched_at=Now())
            )
            if not claimed:
                chosen.head_id = self._head(queue, chosen.tenant)
                chosen.waiting = (
                    self._jobs().filter(queue=queue, tenant=chosen.tenant, state=WAITING).count()
                )
                chosen.save(update_fields=["head_id", "waiting"])
                continue
            old_pass = chosen.pass_value
            self._tenants().filter(pk=chosen.pk).update(
                in_flight=F("in_flight") + 1,
                waiting=F("waiting") - 1,
                pass_value=F("pass_value") + 1.0 / chosen.weight,
                dispatched_total=F("dispatched_total") + 1,
                head_id=self._head(queue, chosen.tenant),
            )
            row.in_flight += 1
            row.virtual_time = max(row.virtual_time, old_pass)
            row.dispatched_total += 1
            self._queues().filter(pk=queue).update(
                in_flight=row.in_flight,
                virtual_time=row.virtual_time,
                dispatched_total=row.dispatched_total,
            )
            signature = self._jobs().filter(pk=job_id).values_list("signature", flat=True).get()
            ready.append(Ready(int(job_id), signature))
            room -= 1
        return ready

    def dispatch(self, queue: str, limit: int) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.dispatch`."""
        with transaction.atomic(using=self.alias):
            return self._dispatch(queue, limit)

    def enqueue(self, job: Job) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.enqueue`."""

        with transaction.atomic(using=self.alias):
            if self._put(job):
                return self._dispatch(job.queue, BATCH)
        return []

    def _put(self, job: Job) -> bool:
        """Store ``job`` in its line (aside, if not due yet); True if it is due and its
        queue has room."""
        from django.utils import timezone

        due = job.not_before is None or job.not_before <= timezone.now()
        queue_row, _ = self._queues().get_or_create(queue=job.queue)
        row = self._jobs().create(
            queue=job.queue, tenant=job.tenant, task_name=job.task_name,
            task_id=job.task_id, signature=job.signature,
            state=WAITING if due else SCHEDULED, not_before=job.not_before,
        )  # fmt: skip
        tenant, created = self._tenants().get_or_create(
            queue=job.queue,
            tenant=job.tenant,
            defaults={"weight": job.weight or 1.0, "cap": job.cap,
                      "pass_value": queue_row.virtual_time},
        )  # fmt: skip
        if not created:
            tenant.weight = job.weight if job.weight is not None else tenant.weight
            tenant.cap = job.cap
        if due:
            if tenant.waiting == 0:
                tenant.head_id = row.pk
                tenant.pass_value = max(tenant.pass_value, queue_row.virtual_time)
            tenant.waiting += 1
        tenant.save(update_fields=["weight", "cap", "waiting", "head_id", "pass_value"])
        return due and queue_row.in_flight < queue_row.capacity + queue_row.slack

    def enqueue_many(self, jobs: list[Job]) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.enqueue_many` (one transaction)."""

        ready: list[Ready] = []
        with transaction.atomic(using=self.alias):
            for job in jobs:
                self._put(job)
            for queue in sorted({job.queue for job in jobs}):
                ready += self._dispatch(queue, BATCH)
        return ready

    def start(self, job_id: int, process_id: uuid.UUID) -> Started:
        """See :func:`django_fair_jobs.dispatch.start`."""
        from django_fair_jobs.models import TenantQueueSlot

        with transaction.atomic(using=self.alias):
            job = self._jobs().filter(pk=job_id, state__in=[WAITING, DISPATCHED]).first()
            if job is None:
                return Started("duplicate")
            self._jobs().filter(pk=job_id).update(
                state=RUNNING, process_id=process_id, started_at=Now()
            )
            tenant = self._tenants().filter(queue=job.queue, tenant=job.tenant).first()
            if job.state == WAITING:
                self._tenants().filter(queue=job.queue, tenant=job.tenant).update(
                    waiting=F("waiting") - 1,
                    in_flight=F("in_flight") + 1,
                    head_id=self._head(job.queue, job.tenant),
                )
                self._queues().filter(pk=job.queue).update(in_flight=F("in_flight") + 1)
            slot = (
                TenantQueueSlot.objects.using(self.alias)
                .filter(queue=job.queue, tenant=job.tenant)
                .values_list("max_jobs", flat=True)
                .first()
            )
            cap = slot if slot is not None else (tenant.cap if tenant is not None else None)
            return Started("started", cap)

    def _out_of_flight(
        self,
        job_id: int,
        process_id: uuid.UUID | None,
        *,
        ended: bool,
        delay: float,
        limit: int | None = None,
    ) -> list[Ready]:
        from datetime import timedelta

        from django.utils import timezone

        back = not ended and delay <= 0
        with transaction.atomic(using=self.alias):
            held = (
                Q(state=DISPATCHED)
                if process_id is None
                else Q(state=RUNNING, process_id=process_id)
            )
            job = self._jobs().filter(held, pk=job_id).first()
            if job is None:
                return []
            if ended:
                self._jobs().filter(pk=job_id).delete()
            else:
                self._jobs().filter(pk=job_id).update(
                    state=WAITING if back else SCHEDULED,
                    not_before=job.not_before
                    if back
                    else timezone.now() + timedelta(seconds=delay),
                    process_id=None,
                    dispatched_at=None,
                    started_at=None,
                    publish_failures=job.publish_failures + (process_id is None),
                )
            tenant = self._tenants().get(queue=job.queue, tenant=job.tenant)
            tenant.in_flight = max(tenant.in_flight - 1, 0)
            if back:
                tenant.head_id = (
                    job_id if tenant.waiting == 0 else min(tenant.head_id or job_id, job_id)
                )
                tenant.waiting += 1
            tenant.save(update_fields=["in_flight", "waiting", "head_id"])
            self._queues().filter(pk=job.queue, in_flight__gt=0).update(
                in_flight=F("in_flight") - 1
            )
            return (
                self._dispatch(job.queue, BATCH if limit is None else limit) if limit != 0 else []
            )

    def end(self, job_id: int, process_id: uuid.UUID, *, delay: float | None) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.end`."""
        return self._out_of_flight(job_id, process_id, ended=delay is None, delay=delay or 0.0)

    def requeue(self, job_id: int) -> list[Ready]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.requeue`."""
        failures = self._jobs().filter(pk=job_id).values_list("publish_failures", flat=True).first()
        delay = min(2.0 ** (failures or 0), pg_store.MAX_BACKOFF)
        return self._out_of_flight(job_id, None, ended=False, delay=delay)

    def drop(self, task_id: str, *, terminated: bool) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.drop`."""
        states = [DISPATCHED, RUNNING] if terminated else [DISPATCHED]
        rows = self._jobs().filter(task_id=task_id, state__in=states)
        ready: list[Ready] = []
        for job_id, process_id in list(rows.values_list("id", "process_id")):
            ready += self._out_of_flight(job_id, process_id, ended=True, delay=0.0)
        return ready

    def cancel(self, queue: str, tenant: str, task_name: str | None, limit: int) -> list[str]:
        """See :func:`django_fair_jobs.dispatch.cancel`."""
        with transaction.atomic(using=self.alias):
            list(self._tenants().select_for_update().filter(queue=queue, tenant=tenant))
            rows = self._jobs().filter(queue=queue, tenant=tenant, state__in=[SCHEDULED, WAITING])
            if task_name is not None:
                rows = rows.filter(task_name=task_name)
            picked = list(rows.order_by("id").values_list("id", "task_id", "state")[:limit])
            if not picked:
                return []
            self._jobs().filter(pk__in=[pk for pk, _, _ in picked]).delete()
            waiting = sum(1 for _, _, state in picked if state == WAITING)
            self._tenants().filter(queue=queue, tenant=tenant).update(
                waiting=F("waiting") - waiting, head_id=self._head(queue, tenant)
            )
            return [str(task_id) for _, task_id, _ in picked]

    def reap(self, timeout: float, requeue_tasks: list[str]) -> tuple[int, int]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.reap`."""
        from django_fair_jobs.models import WorkerProcess

        live = WorkerProcess.objects.using(self.alias).filter(
            last_heartbeat_at__gte=Now() - pg_store._interval(timeout)
        )
        dead = self._jobs().filter(state=RUNNING).exclude(process_id__in=live.values("id"))
        requeued = dropped = 0
        for job_id, process_id, task_name in list(
            dead.values_list("id", "process_id", "task_name")
        ):
            back = task_name in requeue_tasks
            # Maintenance dispatches every queue with room afterwards.
            self._out_of_flight(job_id, process_id, ended=not back, delay=0.0, limit=0)
            requeued += back
            dropped += not back
        return requeued, dropped

    def lost(self, lost_after: float) -> list[Ready]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.lost`."""

        with transaction.atomic(using=self.alias):
            stale = self._jobs().filter(
                state=DISPATCHED, dispatched_at__lt=Now() - pg_store._interval(lost_after)
            )
            rows = list(stale.values_list("id", "signature"))
            self._jobs().filter(pk__in=[job_id for job_id, _ in rows]).update(dispatched_at=Now())
        return [Ready(int(job_id), signature) for job_id, signature in rows]

    def due_queues(self, queues: list[str]) -> list[str]:
        """See :func:`django_fair_jobs.dispatch.due_queues`."""
        due = self._jobs().filter(queue__in=queues, state=SCHEDULED, not_before__lte=Now())
        return sorted(set(due.values_list("queue", flat=True)))

    def queues_with_room(self) -> list[str]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.queues_with_room`."""
        rows = self._queues().filter(in_flight__lt=F("capacity") + F("slack")).order_by("queue")
        return list(rows.values_list("queue", flat=True))

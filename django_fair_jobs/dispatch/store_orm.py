"""Fair dispatch's storage on databases other than PostgreSQL (SQLite, for development and
the demo): the same steps as ``sql/dispatch.sql``, each in one ORM transaction. SQLite runs
one writing transaction at a time, so each step sees no concurrent change and no lock is
skipped."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Case, Count, Exists, F, Max, Min, OuterRef, Q, Subquery, When
from django.db.models.functions import Coalesce, Greatest, Now
from django.utils import timezone

from django_fair_jobs import db
from django_fair_jobs.dispatch import store as pg_store
from django_fair_jobs.dispatch.models import (
    DISPATCHED,
    FAILED,
    LOAD,
    REQUEUE_IF_NODE_LOST,
    REQUEUE_ON_LOSS,
    RUNNING,
    SCHEDULED,
    WAITING,
    DispatchJob,
    DispatchQueue,
    DispatchReceipt,
    DispatchTenant,
)
from django_fair_jobs.dispatch.types import BATCH, Job, Outcome, Ready, Started

_STATE_OF: dict[str, int] = {
    "back": WAITING,
    "later": SCHEDULED,
    "failed": FAILED,
    "unregistered": FAILED,
}
_FAILURE_OF: dict[str, str] = {"failed": "publish", "unregistered": "unregistered"}
_LIMIT_FIELDS = ("id", "max_jobs", "current_jobs", "max_jobs_per_worker")
"""The fields of a queue's limit that bound its room."""


class Store(pg_store.Store):
    """The ORM store of one database alias (maintenance reads are shared with the
    PostgreSQL store where they are plain ORM already)."""

    def _jobs(self) -> Any:
        return DispatchJob.objects.using(self.alias)

    def _tenants(self) -> Any:
        return DispatchTenant.objects.using(self.alias)

    def _queues(self) -> Any:
        return DispatchQueue.objects.using(self.alias)

    def _waiting(self, queue: str, tenant: str) -> Any:
        """``tenant``'s waiting jobs on ``queue``: its line."""
        return self._jobs().filter(queue=queue, tenant=tenant, state=WAITING)

    def _head(self, queue: str, tenant: str) -> tuple[int | None, int | None]:
        """The id and cap of ``tenant``'s oldest waiting job on ``queue``."""
        first = self._waiting(queue, tenant).order_by("id").values_list("id", "cap").first()
        return (None, None) if first is None else (int(first[0]), first[1])

    def _claimed(self, queue: str, tenant: str, job_id: int) -> tuple[int | None, Any, str]:
        """The line's next head and its cap once ``job_id`` (its head) is dispatched, and
        ``job_id``'s message, in one read: the claimed job's row first, then the oldest
        job still waiting (whose message is not read)."""
        claimed = Q(pk=job_id)
        rows = list(
            (self._jobs().filter(claimed) | self._waiting(queue, tenant))
            .annotate(body=Case(When(claimed, then="message")))
            .order_by(Case(When(claimed, then=0), default=1), "id")
            .values_list("id", "cap", "body")[:2]
        )
        following = rows[1] if len(rows) > 1 else (None, None, "")
        return following[0], following[1], rows[0][2]

    def _vt(self, queue: str) -> float:
        """See ``fair_jobs_dispatch_vt``."""
        served = self._tenants().filter(queue=queue).aggregate(v=Max("served_pass"))["v"]
        return float(served or 0.0)

    def _slot(self, tenant: Any, queue: Any) -> Any:
        """``tenant``'s tenant slot on ``queue`` (values, or ``OuterRef`` in a subquery)."""
        from django_fair_jobs.models import TenantQueueSlot

        return TenantQueueSlot.objects.using(self.alias).filter(tenant=tenant, queue=queue)

    def _slot_max(self, tenant: str, queue: str) -> int | None:
        found: int | None = self._slot(tenant, queue).values_list("max_jobs", flat=True).first()
        return found

    def _free(self, queue: str, tenant: str, in_flight: int, cap: int | None) -> bool:
        """See ``fair_jobs_dispatch_free``: whether a line may be chosen."""
        slot = self._slot(tenant, queue).values_list("max_jobs", "current_jobs").first()
        if slot is None:
            return cap is None or in_flight < cap
        limit = slot[0] if slot[0] is not None else cap
        return limit is None or (in_flight < limit and slot[1] < limit)

    def _room(self, queue: str) -> int:
        """See ``fair_jobs_dispatch_room``: the queue's row, its jobs in flight and its
        queue limit in one read (a step holds the database's one write lock through it)."""
        from django_fair_jobs.models import QueueLimit, SlotLease

        flight = self._jobs().filter(queue=queue, state__in=[DISPATCHED, RUNNING])
        limit = QueueLimit.objects.using(self.alias).filter(queue=OuterRef("queue"))
        row = (
            self._queues()
            .filter(queue=queue)
            .annotate(
                in_flight=Coalesce(
                    Subquery(flight.order_by().values("queue").annotate(n=Count("id")).values("n")),
                    0,
                ),
                **{f"limit_{f}": Subquery(limit.values(f)[:1]) for f in _LIMIT_FIELDS},
            )
            .values(
                "capacity", "slack", "nodes", "in_flight", *(f"limit_{f}" for f in _LIMIT_FIELDS)
            )
            .first()
        )
        if row is None:
            return 0
        in_flight = row["in_flight"]
        bounds = [row["capacity"] + row["slack"] - in_flight]
        if row["limit_max_jobs"] is not None:
            running = flight.filter(
                state=RUNNING, task_id=OuterRef("task_id"), process_id=OuterRef("process_id")
            )
            placed = SlotLease.objects.using(self.alias).filter(
                Exists(running), queue_limit_id=row["limit_id"]
            )
            bounds.append(
                row["limit_max_jobs"] - row["limit_current_jobs"] - in_flight + placed.count()
            )
        if row["limit_max_jobs_per_worker"] is not None:
            bounds.append(row["nodes"] * row["limit_max_jobs_per_worker"] - in_flight)
        return max(int(min(bounds)), 0)

    def _due(self, queue: str) -> None:
        """See ``fair_jobs_dispatch_due``."""
        # Against the clock read as a value: SQLite's clock gives milliseconds, a stored
        # time microseconds, and a job stored within the same millisecond would not be due.
        scheduled = self._jobs().filter(queue=queue, state=SCHEDULED)
        if not scheduled.exists():  # most dispatches: one probe, not the clock and a read
            return
        due = scheduled.filter(not_before__lte=db.database_now(self.alias))
        moved = list(due.order_by("id").values_list("id", "tenant", "cap", "weight"))
        if not moved:
            return
        vt = self._vt(queue)
        self._jobs().filter(pk__in=[job_id for job_id, _, _, _ in moved]).update(state=WAITING)
        for job_id, tenant, cap, weight in moved:
            line, _ = self._tenants().get_or_create(
                queue=queue, tenant=tenant, defaults={"pass_value": vt}
            )
            if line.head_id is None:  # an empty line re-enters at the virtual time
                line.pass_value = max(line.pass_value, vt)
            if line.head_id is None or job_id < line.head_id:
                # Blocked with room under the old head's cap: by the fence, it stays.
                fenced = line.blocked and self._free(queue, tenant, line.in_flight, line.cap)
                line.head_id, line.cap = job_id, cap
                line.blocked = fenced or not self._free(queue, tenant, line.in_flight, cap)
            line.waiting += 1
            line.weight = weight if weight is not None else line.weight
            fields = ["waiting", "head_id", "cap", "blocked", "pass_value", "weight"]
            line.save(update_fields=fields)

    def _dispatch(self, queue: str, limit: int, by: int | None = None) -> list[Ready]:
        self._due(queue)
        room = min(self._room(queue), limit)
        ready: list[Ready] = []
        while room > 0:
            candidates = self._tenants().filter(queue=queue, head_id__isnull=False, blocked=False)
            line = candidates.order_by(LOAD, "pass_value", "head_id").first()
            if line is None:
                break
            slot = self._slot_max(line.tenant, queue)
            cap = slot if slot is not None else line.cap
            if cap is not None and line.in_flight >= cap:
                self._tenants().filter(pk=line.pk).update(blocked=True)
                continue
            job_id = line.head_id
            claimed = (
                self._jobs()
                .filter(pk=job_id, state=WAITING)
                .update(state=DISPATCHED, dispatched_at=Now(), dispatched_by=by)
            )
            if not claimed:
                line.head_id, line.cap = self._head(queue, line.tenant)
                line.waiting = self._waiting(queue, line.tenant).count()
                line.save(update_fields=["head_id", "cap", "waiting"])
                continue
            head, head_cap, message = self._claimed(queue, line.tenant, job_id)
            cap_next = slot if slot is not None else head_cap
            self._tenants().filter(pk=line.pk).update(
                in_flight=F("in_flight") + 1,
                waiting=F("waiting") - 1,
                pass_value=F("pass_value") + 1.0 / line.weight,
                served_pass=line.pass_value,
                dispatched_total=F("dispatched_total") + 1,
                head_id=head,
                cap=head_cap,
                blocked=cap_next is not None and line.in_flight + 1 >= cap_next,
            )
            ready.append(Ready(int(job_id), message))
            room -= 1
        return ready

    def dispatch(
        self, queue: str, limit: int, by: int | None = None, again: bool = False
    ) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.store.Store.dispatch`."""
        with transaction.atomic(using=self.alias):
            ready = self._sent_again([by], queue) if again and by is not None else []
            return ready + self._dispatch(queue, limit, by)

    def enqueue(self, job: Job, by: int, *, again: bool = False) -> list[Ready]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.enqueue`: the receipt first;
        sent ``again``, in a savepoint, so that one already stored (the first try's,
        committed) answers. A first try's is a plain insert: no savepoint's two
        statements on its path."""
        receipts = DispatchReceipt.objects.using(self.alias)
        with transaction.atomic(using=self.alias):
            if not again:
                receipts.create(drawn=by)
            else:
                try:
                    with transaction.atomic(using=self.alias):
                        receipts.create(drawn=by)
                except IntegrityError:
                    return self._sent_again([by], job.queue)
            if self._put(job):
                return self._dispatch(job.queue, BATCH, by)
        return []

    def stage(self, jobs: list[Job]) -> None:
        """See :func:`django_fair_jobs.dispatch.stage`."""
        now = db.database_now(self.alias)
        for job in jobs:
            self._create(job, SCHEDULED, job.not_before or now + timedelta(seconds=job.delay))

    def _create(self, job: Job, state: int, not_before: Any) -> DispatchJob:
        return self._jobs().create(  # type: ignore[no-any-return]
            queue=job.queue, tenant=job.tenant, task_name=job.task_name,
            task_id=job.task_id, message=job.message, state=state,
            not_before=not_before, cap=job.cap, weight=job.weight, on_loss=job.on_loss,
        )  # fmt: skip

    def _put(self, job: Job) -> bool:
        """Store ``job`` in its line (aside, if not due yet); True if it is due. A
        countdown counts by the database's clock, as on PostgreSQL."""
        not_before = job.not_before
        if not_before is None and job.delay > 0:
            not_before = db.database_now(self.alias) + timedelta(seconds=job.delay)
        due = not_before is None or not_before <= db.database_now(self.alias)
        row = self._create(job, WAITING if due else SCHEDULED, not_before)
        line, created = self._tenants().get_or_create(
            queue=job.queue, tenant=job.tenant, defaults={"weight": job.weight or 1.0}
        )
        if not created and job.weight is not None:
            line.weight = job.weight
        if due:
            if line.head_id is None:
                # Only a line that was empty reads the virtual time: one read less while
                # the enqueue holds SQLite's write lock.
                line.pass_value = max(line.pass_value, self._vt(job.queue))
            if line.head_id is None or row.pk < line.head_id:
                # A job stored before the head whose line it reaches later: it leads.
                line.head_id, line.cap = row.pk, job.cap
                line.blocked = not self._free(job.queue, job.tenant, line.in_flight, job.cap)
            line.waiting += 1
        line.save(update_fields=["weight", "cap", "blocked", "waiting", "head_id", "pass_value"])
        return due

    def enqueue_many(self, jobs: list[Job]) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.enqueue_many` (one transaction)."""

        ready: list[Ready] = []
        with transaction.atomic(using=self.alias):
            for job in jobs:
                self._put(job)
            for queue in sorted({job.queue for job in jobs}):
                ready += self._dispatch(queue, BATCH)
        return ready

    def restart(
        self, job_ids: list[int], process_id: uuid.UUID, *, ended: list[int] | None = None
    ) -> int:
        """See :meth:`django_fair_jobs.dispatch.store.Store.restart` (the ORM store's
        commits always wait for the disk: only a caller's own list brings it here; its
        writers take turns on SQLite, so ``ended`` needs no lines taken first)."""
        return sum(self.start(job_id, process_id).status == "started" for job_id in sorted(job_ids))

    def confirm_beat(self, process_id: uuid.UUID) -> bool:
        """See :meth:`django_fair_jobs.dispatch.store.Store.confirm_beat`."""
        from django_fair_jobs.models import WorkerProcess

        rows = WorkerProcess.objects.using(self.alias).filter(pk=process_id)
        return bool(rows.update(last_heartbeat_at=Now()))

    def start(
        self,
        job_id: int,
        process_id: uuid.UUID,
        *,
        ended: list[int] | None = None,
        async_commit: bool = False,
    ) -> Started:
        """See :func:`django_fair_jobs.dispatch.start` (``async_commit`` is PostgreSQL's:
        this store's commits wait). The start, then the ends it carries, in one
        transaction."""
        with transaction.atomic(using=self.alias):
            started = self._start(job_id, process_id)
            if not ended:
                return started
            ready = tuple(self.end_many(ended, process_id))
            return Started(started.status, started.cap, ready)

    def _start(self, job_id: int, process_id: uuid.UUID) -> Started:
        """The start alone, inside :meth:`start`'s transaction."""
        # The fence's cap read with the job: its tenant slot's override, if it has one.
        slot = self._slot(OuterRef("tenant"), OuterRef("queue")).values("max_jobs")[:1]
        job = self._jobs().filter(pk=job_id).annotate(slot=Subquery(slot)).first()
        if job is None or job.state not in (WAITING, DISPATCHED, RUNNING):
            return Started("duplicate")
        status = "started"
        if job.state == RUNNING:
            if job.process_id != process_id:
                return Started("duplicate")
            status = "again"
        else:
            self._jobs().filter(pk=job_id).update(
                state=RUNNING, process_id=process_id, started_at=Now()
            )
        if job.state == WAITING:
            head, cap = self._head(job.queue, job.tenant)
            line = self._tenants().get(queue=job.queue, tenant=job.tenant)
            line.waiting, line.in_flight = line.waiting - 1, line.in_flight + 1
            line.head_id, line.cap = head, cap
            line.blocked = head is not None and not self._free(
                job.queue, job.tenant, line.in_flight, cap
            )
            line.save(update_fields=["waiting", "in_flight", "head_id", "cap", "blocked"])
        return Started(status, job.slot if job.slot is not None else job.cap)

    def end(
        self,
        job_id: int,
        process_id: uuid.UUID | None,
        *,
        outcome: Outcome = "end",
        delay: float = 0.0,
        block: bool = False,
        limit: int = BATCH,
        again: bool = False,
    ) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.end`."""
        with transaction.atomic(using=self.alias):
            held = (
                Q(state=DISPATCHED)
                if process_id is None
                else Q(state=RUNNING, process_id=process_id)
            )
            job = self._jobs().filter(held, pk=job_id).first()
            if job is None:
                return self._sent_again([job_id]) if again else []
            if outcome == "end":
                self._jobs().filter(pk=job_id).delete()
            else:
                later = outcome == "later"
                self._jobs().filter(pk=job_id).update(
                    state=_STATE_OF[outcome],
                    not_before=timezone.now() + timedelta(seconds=delay)
                    if later
                    else job.not_before,
                    process_id=None,
                    dispatched_at=None,
                    started_at=None,
                    # A worker's rejection of an unregistered task is no failed publish.
                    publish_failures=job.publish_failures
                    + (process_id is None and outcome != "unregistered"),
                    failure=_FAILURE_OF.get(outcome, ""),
                )
            line = self._tenants().get(queue=job.queue, tenant=job.tenant)
            line.in_flight = max(line.in_flight - 1, 0)
            if outcome == "back":
                if line.head_id is None or job_id < line.head_id:
                    line.head_id, line.cap = job_id, job.cap
                line.waiting += 1
            line.blocked = block
            line.save(update_fields=["in_flight", "waiting", "head_id", "cap", "blocked"])
            return self._dispatch(job.queue, limit, job_id) if limit > 0 else []

    def end_many(
        self,
        job_ids: list[int],
        process_id: uuid.UUID,
        limit: int = BATCH,
        *,
        async_commit: bool = False,
        again: bool = False,
    ) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.end_many` (``async_commit`` as in
        :meth:`start`)."""
        # No savepoint inside a start's transaction: an error rolls back the start with it.
        with transaction.atomic(using=self.alias, savepoint=False):
            held = self._jobs().filter(pk__in=job_ids, state=RUNNING, process_id=process_id)
            rows = sorted(held.values_list("queue", "tenant"))
            held.delete()
            ready = self._sent_again(job_ids) if again and len(rows) < len(job_ids) else []
            for queue, tenant in sorted(set(rows)):
                self._tenants().filter(queue=queue, tenant=tenant).update(
                    in_flight=Greatest(F("in_flight") - rows.count((queue, tenant)), 0),
                    blocked=False,
                )
            if limit <= 0:
                return ready
            for queue in sorted({queue for queue, _ in rows}):
                ready += self._dispatch(queue, limit, job_ids[0])
            return ready

    def _sent_again(self, job_ids: list[int], queue: str | None = None) -> list[Ready]:
        """An end sent again after a lost reply: the jobs its first try dispatched into
        the room of ``job_ids`` that have not started; a dispatch's, by its number (on
        ``queue``)."""
        rows = self._jobs().filter(state=DISPATCHED, dispatched_by__in=job_ids).order_by("pk")
        rows = rows if queue is None else rows.filter(queue=queue)
        return [Ready(int(pk), message) for pk, message in rows.values_list("pk", "message")]

    def failures(self, job_id: int) -> int:
        """See :meth:`django_fair_jobs.dispatch.store.Store.failures`."""
        rows = self._jobs().filter(pk=job_id).values_list("publish_failures", flat=True)
        return int(rows.first() or 0)

    def running_rows(self, task_id: str, *, terminated: bool) -> list[tuple[int, Any]]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.running_rows`."""
        states = [DISPATCHED, RUNNING] if terminated else [DISPATCHED]
        rows = self._jobs().filter(task_id=task_id, state__in=states)
        return [(int(job_id), process) for job_id, process in rows.values_list("id", "process_id")]

    def cancel(
        self, queue: str, tenant: str, task_name: str | None, limit: int
    ) -> list[tuple[str, bool]]:
        """See :func:`django_fair_jobs.dispatch.cancel`."""
        with transaction.atomic(using=self.alias):
            list(self._tenants().select_for_update().filter(queue=queue, tenant=tenant))
            states = [SCHEDULED, WAITING, FAILED]
            rows = self._jobs().filter(queue=queue, tenant=tenant, state__in=states)
            if task_name is not None:
                rows = rows.filter(task_name=task_name)
            picked = list(rows.order_by("id").values_list("id", "task_id", "state")[:limit])
            if not picked:
                return []
            self._jobs().filter(pk__in=[pk for pk, _, _ in picked]).delete()
            waiting = sum(1 for _, _, state in picked if state == WAITING)
            head, cap = self._head(queue, tenant)
            self._tenants().filter(queue=queue, tenant=tenant).update(
                waiting=F("waiting") - waiting, head_id=head, cap=cap
            )
            return [(str(task_id), state == FAILED) for _, task_id, state in picked]

    def refresh_capacity(self, slack_per_node: int, timeout: float) -> dict[str, int]:
        """See :func:`django_fair_jobs.dispatch.refresh_capacity`."""
        capacity, nodes = pg_store.live_capacity(self.alias, timeout)
        grown: dict[str, int] = {}
        known = {q.queue: q for q in self._queues()}
        for queue in sorted(set(known) | set(capacity)):
            cap, n = capacity.get(queue, 0), nodes.get(queue, 0)
            row = known.get(queue)
            values = {"capacity": cap, "slack": n * slack_per_node, "nodes": n}
            if row is None or (row.capacity, row.slack, row.nodes) != tuple(values.values()):
                if cap and (row is None or cap + values["slack"] > row.capacity + row.slack):
                    grown[queue] = cap
                self._queues().update_or_create(queue=queue, defaults=values)
        return grown

    def reap(self, timeout: float) -> tuple[int, int]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.reap`."""
        from django_fair_jobs.models import WorkerProcess

        processes = WorkerProcess.objects.using(self.alias)
        live = processes.filter(last_heartbeat_at__gte=Now() - pg_store._interval(timeout))
        live_nodes = set(live.values_list("node_id", flat=True))
        node_of = dict(processes.values_list("id", "node_id"))
        dead = self._jobs().filter(state=RUNNING).exclude(process_id__in=live.values("id"))
        requeued = dropped = 0
        for job_id, process_id, on_loss in list(dead.values_list("id", "process_id", "on_loss")):
            node_gone = node_of.get(process_id) not in live_nodes
            back = on_loss == REQUEUE_ON_LOSS or (on_loss == REQUEUE_IF_NODE_LOST and node_gone)
            # Maintenance dispatches every queue with room afterwards.
            self.end(job_id, process_id, outcome="back" if back else "end", limit=0)
            requeued += back
            dropped += not back
        return requeued, dropped

    def lost(self, lost_after: float) -> list[Ready]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.lost`."""
        served = self._queues().filter(capacity__gt=0).values("queue")
        ready: list[Ready] = []
        with transaction.atomic(using=self.alias):
            stale = self._jobs().filter(state=DISPATCHED, queue__in=served)
            for job in stale:
                wait = timedelta(seconds=lost_after * 2 ** min(job.republished, 6))
                if job.dispatched_at is not None and job.dispatched_at < timezone.now() - wait:
                    self._jobs().filter(pk=job.pk).update(
                        dispatched_at=Now(), republished=F("republished") + 1
                    )
                    ready.append(Ready(int(job.pk), job.message))
        return ready

    def due_queues(self, queues: list[str]) -> list[str]:
        """See :func:`django_fair_jobs.dispatch.due_queues`."""
        now = db.database_now(self.alias)  # a value, as in _due
        due = self._jobs().filter(queue__in=queues, state=SCHEDULED, not_before__lte=now)
        found = set(due.values_list("queue", flat=True))
        lines = self._tenants().filter(queue__in=queues, head_id__isnull=False, blocked=False)
        waiting = set(lines.values_list("queue", flat=True)) - found
        return sorted(found | {queue for queue in waiting if self._room(queue) > 0})

    def queues_with_room(self) -> list[str]:
        """See :meth:`django_fair_jobs.dispatch.store.Store.queues_with_room`."""
        pending = self._jobs().filter(state__in=[SCHEDULED, WAITING])
        queues = sorted(set(pending.values_list("queue", flat=True)))
        return [queue for queue in queues if self._room(queue) > 0]

    def unblock(self, tenant: str | None, queue: str | None) -> list[str]:
        """See :func:`django_fair_jobs.dispatch.unblock`."""
        lines = self._tenants().filter(blocked=True)
        if tenant is not None:
            lines = lines.filter(tenant=tenant)
        if queue is not None:
            lines = lines.filter(queue=queue)
        freed: set[str] = set()
        for line in lines:
            if not self._free(line.queue, line.tenant, line.in_flight, line.cap):
                continue
            self._tenants().filter(pk=line.pk).update(blocked=False)
            freed.add(line.queue)
        return sorted(freed)

    def recount(self) -> list[tuple[Any, ...]]:
        """See :func:`django_fair_jobs.dispatch.recount`: the jobs counted for every line
        in one grouped read; only a line that drifted is written (its head's cap read)."""
        drift: list[tuple[Any, ...]] = []
        with transaction.atomic(using=self.alias):
            counted = {
                (row["queue"], row["tenant"]): (row["waiting"], row["in_flight"], row["head"])
                for row in self._jobs()
                .order_by()
                .values("queue", "tenant")
                .annotate(
                    waiting=Count("id", filter=Q(state=WAITING)),
                    in_flight=Count("id", filter=Q(state__in=[DISPATCHED, RUNNING])),
                    head=Min("id", filter=Q(state=WAITING)),
                )
            }
            for line in self._tenants():
                waiting, in_flight, head = counted.get((line.queue, line.tenant), (0, 0, None))
                if (waiting, in_flight, head) == (line.waiting, line.in_flight, line.head_id):
                    continue
                drift.append(
                    (line.queue, line.tenant, line.waiting, waiting, line.in_flight, in_flight)
                )
                cap = self._jobs().filter(pk=head).values_list("cap", flat=True).first()
                self._tenants().filter(pk=line.pk).update(
                    waiting=waiting, in_flight=in_flight, blocked=False, head_id=head, cap=cap
                )
        return drift

    def in_flight(self) -> dict[str, int]:
        """See :func:`django_fair_jobs.dispatch.in_flight`."""
        flight = self._jobs().filter(state__in=[DISPATCHED, RUNNING])
        counts: dict[str, int] = {}
        for queue in flight.values_list("queue", flat=True):
            counts[queue] = counts.get(queue, 0) + 1
        return dict(sorted(counts.items()))

    def room(self) -> dict[str, int]:
        """See :func:`django_fair_jobs.dispatch.room`."""
        return {
            q: self._room(q)
            for q in self._queues().order_by("queue").values_list("queue", flat=True)
        }

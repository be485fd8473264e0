"""Fair dispatch's storage on PostgreSQL: each step of a job is one call of a function of
``sql/dispatch.sql`` (one round trip), through a named statement of ``dispatch/store.sql``,
as every maintenance statement is."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

from django.db import transaction

from django_fair_jobs import db
from django_fair_jobs.dispatch.models import DISPATCHED, RUNNING
from django_fair_jobs.dispatch.types import BATCH, Job, Ready, Started

MAX_BACKOFF = 60.0
"""Longest wait before a job whose publish failed is tried again (seconds)."""


class Store:
    """The PostgreSQL store of one database alias."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def _rows(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run the named statement ``name`` (see :func:`django_fair_jobs.sql.queries`)."""
        return db.run(self.alias, name, params)

    @staticmethod
    def _ready(rows: list[tuple[Any, ...]]) -> list[Ready]:

        return [Ready(int(job_id), signature) for job_id, signature in rows if job_id is not None]

    def enqueue(self, job: Job) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.enqueue`."""
        return self._ready(
            self._rows(
                "dispatch_enqueue",
                {
                    "queue": job.queue,
                    "tenant": job.tenant,
                    "task_name": job.task_name,
                    "task_id": job.task_id,
                    "signature": job.signature,
                    "not_before": job.not_before,
                    "weight": job.weight,
                    "cap": job.cap,
                },
            )
        )

    def enqueue_many(self, jobs: list[Job]) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.enqueue_many`."""
        return self._ready(
            self._rows(
                "dispatch_enqueue_many",
                {
                    "queues": [j.queue for j in jobs],
                    "tenants": [j.tenant for j in jobs],
                    "task_names": [j.task_name for j in jobs],
                    "task_ids": [j.task_id for j in jobs],
                    "signatures": [j.signature for j in jobs],
                    "not_befores": [j.not_before for j in jobs],
                    "weights": [j.weight for j in jobs],
                    "caps": [j.cap for j in jobs],
                },
            )
        )

    def start(self, job_id: int, process_id: uuid.UUID) -> Started:
        """See :func:`django_fair_jobs.dispatch.start`."""

        rows = self._rows("dispatch_start", {"job": job_id, "process": process_id})
        if not rows:  # the tenant row is gone: the job still started
            return Started("started", None)
        status, cap = rows[0]
        return Started(str(status), None if cap is None else int(cap))

    def end(self, job_id: int, process_id: uuid.UUID, *, delay: float | None) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.end`."""
        return self._ready(
            self._rows(
                "dispatch_end",
                {
                    "job": job_id,
                    "process": process_id,
                    "ended": delay is None,
                    "delay": delay or 0.0,
                    "max": _batch(),
                },
            )
        )

    def requeue(self, job_id: int) -> list[Ready]:
        """A dispatched job whose publish failed goes back to its line after a delay that
        doubles with each failure (at most :data:`MAX_BACKOFF`)."""
        rows = self._rows("dispatch_failures", {"job": job_id})
        failures = int(rows[0][0]) if rows else 0
        delay = min(2.0**failures, MAX_BACKOFF)
        return self._ready(
            self._rows(
                "dispatch_end",
                {"job": job_id, "process": None, "ended": False, "delay": delay, "max": _batch()},
            )
        )

    def dispatch(self, queue: str, limit: int) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.dispatch`."""
        return self._ready(self._rows("dispatch_next", {"queue": queue, "max": limit}))

    def drop(self, task_id: str, *, terminated: bool) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.drop`."""
        states = [DISPATCHED, RUNNING] if terminated else [DISPATCHED]
        rows = self._rows("dispatch_task_rows", {"task_id": task_id, "states": states})
        ready: list[Ready] = []
        for job_id, process_id in rows:
            ready += self._ready(
                self._rows(
                    "dispatch_end",
                    {
                        "job": job_id,
                        "process": process_id,
                        "ended": True,
                        "delay": 0.0,
                        "max": _batch(),
                    },
                )
            )
        return ready

    def cancel(self, queue: str, tenant: str, task_name: str | None, limit: int) -> list[str]:
        """See :func:`django_fair_jobs.dispatch.cancel`."""
        params = {"queue": queue, "tenant": tenant, "task_name": task_name, "max": limit}
        with transaction.atomic(using=self.alias):
            self._rows("dispatch_lock_line", params)
            return [str(task_id) for (task_id,) in self._rows("dispatch_cancel", params)]

    def refresh_capacity(self, slack_per_node: int, timeout: float) -> dict[str, int]:
        """See :func:`django_fair_jobs.dispatch.refresh_capacity`."""
        from django_fair_jobs.dispatch.models import DispatchQueue

        capacity, nodes = live_capacity(self.alias, timeout)
        grown: dict[str, int] = {}
        with transaction.atomic(using=self.alias):
            known = {
                q.queue: q
                for q in DispatchQueue.objects.using(self.alias)
                .select_for_update()
                .order_by("queue")
            }
            for queue in sorted(set(known) | set(capacity)):
                cap, slack = capacity.get(queue, 0), nodes.get(queue, 0) * slack_per_node
                row = known.get(queue)
                if row is None:
                    # The first enqueue on the queue inserts its row too, without this
                    # lock: insert only if absent (waiting for that enqueue to commit),
                    # then set the capacity, rather than fail on the duplicate key.
                    queues = DispatchQueue.objects.using(self.alias)
                    queues.bulk_create(
                        [DispatchQueue(queue=queue, capacity=cap, slack=slack)],
                        ignore_conflicts=True,
                    )
                    queues.filter(queue=queue).update(capacity=cap, slack=slack)
                    if cap:
                        grown[queue] = cap
                elif (row.capacity, row.slack) != (cap, slack):
                    if cap + slack > row.capacity + row.slack:
                        grown[queue] = cap
                    DispatchQueue.objects.using(self.alias).filter(queue=queue).update(
                        capacity=cap, slack=slack
                    )
        return grown

    def reap(self, timeout: float, requeue_tasks: list[str]) -> tuple[int, int]:
        """Running jobs whose process stopped beating: back to line (tasks in
        ``requeue_tasks``) or ended. Returns (requeued, dropped)."""
        rows = self._rows("dispatch_orphans", {"timeout": timeout})
        requeued = dropped = 0
        for job_id, process_id, task_name in rows:
            back = task_name in requeue_tasks
            self._rows(
                "dispatch_end",
                {"job": job_id, "process": process_id, "ended": not back, "delay": 0.0, "max": 0},
            )
            requeued += back
            dropped += not back
        return requeued, dropped

    def lost(self, lost_after: float) -> list[Ready]:
        """Dispatched jobs not started within ``lost_after`` seconds: their message may
        be lost (a purged queue, a publisher that died); returned to be published again,
        their clock restarted."""
        return self._ready(self._rows("dispatch_lost", {"lost_after": lost_after}))

    def due_queues(self, queues: list[str]) -> list[str]:
        """See :func:`django_fair_jobs.dispatch.due_queues`."""
        rows = self._rows("dispatch_due_queues", {"queues": list(queues)})
        return [queue for (queue,) in rows]

    def queues_with_room(self) -> list[str]:
        """Queues with room and jobs waiting (or countdowns that may be due)."""
        rows = self._rows("dispatch_queues_with_room", {})
        return [queue for (queue,) in rows]


def _batch() -> int:

    return BATCH


def live_capacity(alias: str, timeout: float) -> tuple[dict[str, int], dict[str, int]]:
    """``({queue: processes}, {queue: nodes})`` over the processes that beat within
    ``timeout`` seconds (by the database clock)."""
    from django.db.models import F
    from django.db.models.functions import Now

    from django_fair_jobs.models import WorkerProcess

    live = WorkerProcess.objects.using(alias).filter(
        last_heartbeat_at__gte=Now() - _interval(timeout)
    )
    capacity: Counter[str] = Counter()
    nodes: dict[str, set[Any]] = {}
    for queues, concurrency, node_id in live.values_list("queues", "concurrency", F("node_id")):
        for queue in queues or ():
            capacity[queue] += int(concurrency or 1)
            nodes.setdefault(queue, set()).add(node_id)
    return dict(capacity), {queue: len(ids) for queue, ids in nodes.items()}


def _interval(seconds: float) -> Any:
    """``seconds`` as a duration the database subtracts from its own ``now()``."""
    from datetime import timedelta

    from django.db import models

    return models.Value(timedelta(seconds=seconds), output_field=models.DurationField())

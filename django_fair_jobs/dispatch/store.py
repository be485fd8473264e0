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
from django_fair_jobs.dispatch.types import BATCH, Job, Outcome, Ready, Started

MAX_BACKOFF = 60.0
"""Longest wait before a job whose publish failed is tried again (seconds)."""

PUBLISH_ATTEMPTS = 5
"""Publishes a job may fail before it ends in the failed state (a message the broker or
the serializer always refuses), shown by explain, status and the admin."""


_PLURAL = {"on_loss": "on_losses"}


class Store:
    """The PostgreSQL store of one database alias."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def _rows(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run the named statement ``name`` (see :func:`django_fair_jobs.sql.queries`)."""
        return db.run(self.alias, name, params)

    @staticmethod
    def _ready(rows: list[tuple[Any, ...]]) -> list[Ready]:

        return [Ready(int(job_id), message) for job_id, message in rows if job_id is not None]

    @staticmethod
    def _job(job: Job) -> dict[str, Any]:
        return {
            "queue": job.queue,
            "tenant": job.tenant,
            "task_name": job.task_name,
            "task_id": job.task_id,
            "message": job.message,
            "delay": job.delay,
            "not_before": job.not_before,
            "weight": job.weight,
            "cap": job.cap,
            "on_loss": job.on_loss,
        }

    def enqueue(self, job: Job, by: int, *, again: bool = False) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.enqueue`: sent ``again`` with the same
        ``by`` after a lost reply, it answers with what its first try did (its receipt); a
        first try whose ``by`` is a receipt already raises ``IntegrityError``."""
        params = {**self._job(job), "by": by, "again": again}
        return self._ready(self._rows("dispatch_enqueue", params))

    def _columns(self, jobs: list[Job]) -> dict[str, list[Any]]:
        rows = [self._job(j) for j in jobs]
        # One array per column, named as the statements name them (queues, tenants, ...).
        return {_PLURAL.get(key, f"{key}s"): [row[key] for row in rows] for key in rows[0]}

    def stage(self, jobs: list[Job]) -> None:
        """See :func:`django_fair_jobs.dispatch.stage`."""
        self._rows("dispatch_stage", self._columns(jobs))

    def enqueue_many(self, jobs: list[Job]) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.enqueue_many`."""
        return self._ready(self._rows("dispatch_enqueue_many", self._columns(jobs)))

    def start(
        self,
        job_id: int,
        process_id: uuid.UUID,
        *,
        ended: list[int] | None = None,
        async_commit: bool = False,
    ) -> Started:
        """See :func:`django_fair_jobs.dispatch.start`."""
        params = {"job": job_id, "process": process_id, "async_commit": async_commit}
        if not ended:
            ((status, cap, _),) = self._rows("dispatch_start", params)
            return Started(str(status), None if cap is None else int(cap))
        rows = self._rows("dispatch_start_ending", {**params, "jobs": ended, "max": BATCH})
        status, cap = rows[0][0], rows[0][1]
        ready = tuple(Ready(int(row[2]), str(row[3])) for row in rows if row[2] is not None)
        return Started(str(status), None if cap is None else int(cap), ready)

    def confirm(
        self, started: list[int], ended: list[int], process_id: uuid.UUID
    ) -> tuple[bool, int, list[Ready]]:
        """See :func:`django_fair_jobs.dispatch.confirm`. In one transaction: the process's
        row written by a commit that waits for the disk (WAL is flushed in order, so it
        covers every commit before it), the starts sent again (a lost one runs the job's
        row here again; the others write nothing), then the ends (a lost one ends its row
        and dispatches the room it leaves)."""
        ready: list[Ready] = []
        with transaction.atomic(using=self.alias):
            if not self.confirm_beat(process_id):
                return False, 0, []
            redone = self.restart(started, process_id, ended=ended) if started else 0
            if ended:
                ready = self.end_many(ended, process_id)
        return True, redone, ready

    def restart(
        self, job_ids: list[int], process_id: uuid.UUID, *, ended: list[int] | None = None
    ) -> int:
        """See :func:`django_fair_jobs.dispatch.confirm`: the starts made again; returns
        how many a crash had lost (their rows were not running here). ``ended``: the ends
        the same transaction makes again next, whose lines it takes in order first where
        a start takes a line."""
        params = {"jobs": sorted(job_ids), "process": process_id, "ended": sorted(ended or [])}
        rows = self._rows("dispatch_restart", params)
        return sum(1 for (status,) in rows if status == "started")

    def confirm_beat(self, process_id: uuid.UUID) -> bool:
        """See :func:`django_fair_jobs.dispatch.confirm`: the process's row written by a
        commit that waits for the disk; False if the row is gone."""
        return bool(self._rows("dispatch_confirm_beat", {"process": process_id}))

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
        params = {
            "job": job_id, "process": process_id, "outcome": outcome, "delay": delay,
            "block": block, "max": limit, "again": again,
        }  # fmt: skip
        return self._ready(self._rows("dispatch_end", params))

    def end_many(
        self,
        job_ids: list[int],
        process_id: uuid.UUID,
        limit: int = BATCH,
        *,
        async_commit: bool = False,
        again: bool = False,
    ) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.end_many`."""
        params = {
            "jobs": list(job_ids), "process": process_id, "max": limit,
            "async_commit": async_commit, "again": again,
        }  # fmt: skip
        return self._ready(self._rows("dispatch_end_many", params))

    def failures(self, job_id: int) -> int:
        """How often publishing ``job_id`` failed so far."""
        rows = self._rows("dispatch_failures", {"job": job_id})
        return int(rows[0][0]) if rows else 0

    def dispatch(
        self, queue: str, limit: int, by: int | None = None, again: bool = False
    ) -> list[Ready]:
        """See :func:`django_fair_jobs.dispatch.dispatch`: sent ``again``, what the first
        try of dispatch ``by`` dispatched; the lines of new tenants' due jobs
        (``dispatch_make_lines``); then the dispatch."""
        params = {"queue": queue, "max": limit, "by": by}
        sent = again and by is not None
        ready = self._ready(self._rows("dispatch_sent_again", params)) if sent else []
        self._rows("dispatch_make_lines", {"queue": queue})
        return ready + self._ready(self._rows("dispatch_next", params))

    def running_rows(self, task_id: str, *, terminated: bool) -> list[tuple[int, Any]]:
        """``(job id, process id)`` of ``task_id``'s rows dispatched (and running, if
        ``terminated``)."""
        states = [DISPATCHED, RUNNING] if terminated else [DISPATCHED]
        rows = self._rows("dispatch_task_rows", {"task_id": task_id, "states": states})
        return [(int(job_id), process_id) for job_id, process_id in rows]

    def cancel(
        self, queue: str, tenant: str, task_name: str | None, limit: int
    ) -> list[tuple[str, bool]]:
        """See :func:`django_fair_jobs.dispatch.cancel`."""
        params = {"queue": queue, "tenant": tenant, "task_name": task_name, "max": limit}
        with transaction.atomic(using=self.alias):
            self._rows("dispatch_lock_line", params)
            rows = self._rows("dispatch_cancel", params)
            return [(str(task_id), bool(failed)) for task_id, failed in rows]

    def refresh_capacity(self, slack_per_node: int, timeout: float) -> dict[str, int]:
        """See :func:`django_fair_jobs.dispatch.refresh_capacity`: each queue's row in a
        statement of its own, so that no transaction holds two queues' rows."""
        from django_fair_jobs.dispatch.models import DispatchQueue

        capacity, nodes = live_capacity(self.alias, timeout)
        known = DispatchQueue.objects.using(self.alias).values_list("queue", flat=True)
        grown: dict[str, int] = {}
        for queue in sorted(set(known) | set(capacity)):
            cap, n = capacity.get(queue, 0), nodes.get(queue, 0)
            params = {"queue": queue, "capacity": cap, "nodes": n, "slack": n * slack_per_node}
            for _, grew in self._rows("dispatch_set_capacity", params):
                if grew and cap:
                    grown[queue] = cap
        return grown

    def reap(self, timeout: float) -> tuple[int, int]:
        """Running jobs whose process stopped beating: back to line or ended, as Celery
        would (each job's ``on_loss``, stored at ``delay()``). Returns (requeued, dropped)."""
        requeued = dropped = 0
        for job_id, process_id, back in self._rows("dispatch_orphans", {"timeout": timeout}):
            self.end(job_id, process_id, outcome="back" if back else "end", limit=0)
            requeued += bool(back)
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

    def unblock(self, tenant: str | None, queue: str | None) -> list[str]:
        """See :func:`django_fair_jobs.dispatch.unblock`."""
        rows = self._rows("dispatch_unblock", {"tenant": tenant, "queue": queue})
        return sorted({queue for (queue,) in rows})

    def recount(self) -> list[tuple[Any, ...]]:
        """See :func:`django_fair_jobs.dispatch.recount`."""
        return self._rows("dispatch_recount", {})

    def in_flight(self) -> dict[str, int]:
        """See :func:`django_fair_jobs.dispatch.in_flight`."""
        return {str(queue): int(n) for queue, n in self._rows("dispatch_in_flight", {})}

    def prune_receipts(self, seconds: float) -> int:
        """Delete the enqueue receipts older than ``seconds`` (the database's clock);
        returns how many."""
        from django.db.models.functions import Now

        from django_fair_jobs.dispatch.models import DispatchReceipt

        old = DispatchReceipt.objects.using(self.alias).filter(
            stored_at__lt=Now() - _interval(seconds)
        )
        return int(old.delete()[0])

    def room(self) -> dict[str, int]:
        """See :func:`django_fair_jobs.dispatch.room`."""
        return {str(queue): int(n or 0) for queue, n in self._rows("dispatch_room", {})}


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

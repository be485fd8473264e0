"""Mechanism D, queue concurrency limits: at most N jobs of a queue at once across the
cluster (``max_jobs``) and P on each worker node (``max_jobs_per_worker``); 0 pauses.

Limits are :class:`~django_fair_jobs.models.QueueLimit` rows, edited at runtime in the
admin or with ``manage.py fair_jobs_limit``; ``FAIR_JOBS_QUEUE_LIMITS`` and
``FAIR_JOBS_QUEUE_LIMITS_PER_WORKER`` only seed the queues that have no row. A job of a
limited queue takes its place in the queue and its tenant slot (if it has a tenant) in
one statement, both or neither; a blocked job is parked in the queue's line and woken
when a place frees, through the same slot, lease and reaping machinery as tenant slots
(:mod:`django_fair_jobs.slots`). A queue without a limit costs nothing: each process
keeps the set of limited queues and re-reads it at most once a second.

Plain Celery tasks are limited too with ``FAIR_JOBS_LIMIT_PLAIN_TASKS = True``: the worker
wraps every task that is not a ``FairTask`` at start-up (:func:`install`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from django_fair_jobs import db, events, identity, messages
from django_fair_jobs.conf import MAX_LIMIT, fair_settings, is_limit
from django_fair_jobs.errors import (
    LimitError as LimitError,
)
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.queue_limits.store import UNCHANGED

if TYPE_CHECKING:
    from celery import Celery

    from django_fair_jobs.models import QueueLimit

logger = logging.getLogger("django_fair_jobs.queue_limits")

REFRESH_SECONDS = 1.0
"""How often a process re-reads which queues are limited. A limit set on a queue that had
none applies within this time; changes to a limited queue's values apply at once (every
acquire reads them under the row lock)."""


class _Cache:
    def __init__(self) -> None:
        self.pid = -1
        self.loaded_at = 0.0
        self.queues: frozenset[str] = frozenset()
        self.lock = threading.Lock()


_cache = _Cache()


def limited_queues(*, refresh: bool = False) -> frozenset[str]:
    """The queues that have a limit, as this process last read them (at most
    ``REFRESH_SECONDS`` ago). The first read of a process seeds the settings' limits."""
    now = time.monotonic()
    if not refresh and _cache.pid == os.getpid() and now - _cache.loaded_at < REFRESH_SECONDS:
        return _cache.queues

    with _cache.lock:
        if _cache.pid != os.getpid():
            seed()
        _cache.queues = frozenset(queue_store.limits())
        _cache.loaded_at, _cache.pid = now, os.getpid()
        return _cache.queues


def is_limited(queue: str) -> bool:
    """True if ``queue`` has a cluster-wide or per-worker limit (0 included), or is still
    draining jobs taken under one.

    If the database cannot be read, the last set read stands; a process that never read
    it answers True, so the job goes through the slot path, which postpones it through the
    broker until the database is back (a limit is never skipped for want of a read)."""
    from django.db import DatabaseError

    try:
        return queue in limited_queues()
    except DatabaseError:
        logger.warning("Could not read the queue limits; using the last ones read")
        if _cache.pid != os.getpid():
            return True
        _cache.loaded_at = time.monotonic()  # retry after REFRESH_SECONDS, not per job
        return queue in _cache.queues


def validate(value: Any, what: str) -> int | None:
    """Return ``value`` as a limit (None: no limit), or raise :class:`LimitError`."""
    if value is None:
        return None
    if not is_limit(value):
        raise LimitError(
            f"{what} must be a whole number from 0 (0 pauses the queue) to {MAX_LIMIT}, or "
            f"None for no limit; got {value!r}."
        )
    return value


def seed() -> list[str]:
    """Store ``FAIR_JOBS_QUEUE_LIMITS`` and ``FAIR_JOBS_QUEUE_LIMITS_PER_WORKER`` for the
    queues that have no stored limits (runtime changes survive restarts). Returns the
    queues seeded."""

    seeded = queue_store.seed(
        dict(fair_settings.QUEUE_LIMITS), dict(fair_settings.QUEUE_LIMITS_PER_WORKER)
    )
    if seeded:
        logger.info("Queue limits seeded from settings for %s", ", ".join(seeded))
    return seeded


def set_limits(
    queue: str,
    *,
    max_jobs: Any = UNCHANGED,
    max_jobs_per_worker: Any = UNCHANGED,
    app: Celery | None = None,
    user: str = "",
    source: str = "python",
) -> QueueLimit:
    """Store limits for ``queue`` (None: no limit; 0: paused; a limit not given is left as
    it is) and wake the parked jobs that the new limits let start, at once. Each change
    is recorded in the limit history with ``user`` and ``source``."""
    from django_fair_jobs.models import LimitChange, QueueLimit

    if not queue or not isinstance(queue, str):
        raise LimitError("A queue limit needs a queue name.")
    for name, value in (("max_jobs", max_jobs), ("max_jobs_per_worker", max_jobs_per_worker)):
        if value is not UNCHANGED:
            validate(value, name)
    before = QueueLimit.objects.filter(queue=queue).first()
    row = queue_store.set_limits(queue, max_jobs=max_jobs, max_jobs_per_worker=max_jobs_per_worker)
    for name in ("max_jobs", "max_jobs_per_worker"):
        LimitChange.record(
            queue=queue, field=name, old=getattr(before, name, None), new=getattr(row, name),
            user=user,
            source=source,
        )  # fmt: skip
    wake_waiting(queue_ids={row.pk}, app=app)
    _cache.loaded_at = 0.0  # this process sees the change at once
    events.limit_changed.send(sender=QueueLimit, tenant=None, queue=queue, app=app)
    return row


def reset(
    queues: list[str] | None = None,
    app: Celery | None = None,
    *,
    user: str = "",
    source: str = "python",
) -> list[QueueLimit]:
    """Make the stored limits of ``queues`` (default: every stored or configured queue)
    what the settings say; a queue the settings do not name gets no limit."""
    from django_fair_jobs.models import QueueLimit

    max_jobs, per_worker = fair_settings.QUEUE_LIMITS, fair_settings.QUEUE_LIMITS_PER_WORKER
    names = queues or sorted(
        set(QueueLimit.objects.values_list("queue", flat=True)) | set(max_jobs) | set(per_worker)
    )
    return [
        set_limits(
            name,
            app=app,
            max_jobs=max_jobs.get(name),
            max_jobs_per_worker=per_worker.get(name),
            user=user,
            source=source,
        )
        for name in names
    ]


def park(
    *,
    queue: str,
    tenant: str | None,
    limit: int,
    task_id: str,
    task_name: str,
    signature: str,
    woken: bool,
) -> str:
    """Park a job in ``queue``'s line if it is still blocked; see ``park_limited``."""

    return queue_store.try_park(
        queue=queue, tenant=tenant, limit=limit, task_id=task_id, task_name=task_name,
        signature=signature, node_id=identity.current_node_id(), woken=woken,
    )  # fmt: skip


def wake_line(queue_limit_id: int, limit: int = 1, app: Celery | None = None) -> int:
    """Wake up to ``limit`` jobs of a queue's line that can start now; returns how many
    (0 inside the caller's ``atomic()``: the wake-up waits for the commit, see
    :func:`django_fair_jobs.slots.wake`)."""
    from django.db import router

    from django_fair_jobs.models import QueueLimit

    if db.after_commit(
        lambda: wake_line(queue_limit_id, limit, app), router.db_for_write(QueueLimit)
    ):
        return 0
    woken = 0
    while woken < limit:
        job = queue_store.wake_one(queue_limit_id)
        if job is None:
            break
        messages.publish_woken(job, app=app)
        woken += 1
    return woken


def wake_waiting(queue_ids: set[int] | None = None, app: Celery | None = None) -> int:
    """Wake as many parked jobs as the queues have room for (all queues, or ``queue_ids``):
    after a limit is raised, a reap, or a missed wake-up. Returns how many were woken."""

    live_nodes = identity.live_nodes(fair_settings.WORKER_TIMEOUT)
    woken = 0
    for queue_id, room in queue_store.with_waiting_room(live_nodes):
        if queue_ids is None or queue_id in queue_ids:
            woken += wake_line(queue_id, limit=room, app=app)
    return woken


def queue_status() -> list[dict[str, Any]]:
    """Per stored queue: its limits, jobs running (in all and per worker node name), jobs
    parked in its line and the age of the oldest, in seconds of the database clock."""
    from django.db.models import Count, Min, Q

    from django_fair_jobs.models import QueueLimit, WorkerProcess

    now = db.database_now()
    names = {
        str(node_id): node for node_id, node in WorkerProcess.objects.values_list("node_id", "node")
    }
    waiting = Q(parked__woken_at__isnull=True)
    rows = QueueLimit.objects.order_by("queue").annotate(
        parked_count=Count("parked", filter=waiting),
        oldest=Min("parked__parked_at", filter=waiting),
    )
    status = []
    for row in rows:
        by_node: dict[str, int] = {}
        for node_id, n in sorted(row.running.items()):
            name = names.get(node_id, f"gone node {node_id[:8]}")
            by_node[name] = by_node.get(name, 0) + int(n)
        oldest = row.oldest
        status.append(
            {
                "queue": row.queue,
                "max_jobs": row.max_jobs,
                "max_jobs_per_worker": row.max_jobs_per_worker,
                "paused": row.max_jobs == 0 or row.max_jobs_per_worker == 0,
                "running": row.current_jobs,
                "running_by_node": by_node,
                "parked": row.parked_count,
                "oldest_parked_seconds": None
                if oldest is None
                else round(max((now - oldest).total_seconds(), 0.0), 1),
                "deferred_total": row.deferred_total,
            }
        )
    return status

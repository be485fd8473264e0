"""The chaos suite's workload: one task per mechanism, each recording its own start and end
(database clock) in JobRun.

The records are written the way a job that must survive a database outage writes: on a
lost connection it reconnects and tries again. Without that, the workload itself would
fail during a PostgreSQL restart, and the suite would measure the job, not the library.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery import shared_task
from django.db import InterfaceError, OperationalError, connection
from django.db.models.functions import Now

from tests.testapp.models import JobRun
from tests.testapp.tasks import TenantFromFirstArg

T = TypeVar("T")

SLOT_LIMIT = 2
"""``chaos_slot``: jobs one tenant runs at once on the ``chaos`` queue."""
SLOW_LIMIT = 1
"""``chaos_reroute``: a rerouted tenant's jobs at once on ``chaos_slow``."""
QUEUE_LIMIT = 2
"""``chaos_plain``: jobs at once on ``chaos_limited``, all nodes together (the workers'
``FAIR_JOBS_QUEUE_LIMITS``)."""
DISPATCH_LIMIT = 2
"""``chaos_dispatched``: a tenant's jobs at once (fair dispatch with a cap)."""
OVERRUN_LIMIT = 1
"""``chaos_overrun``: its tenant's jobs at once."""
HARD_TIME_LIMIT = 2
"""``chaos_overrun``'s hard time limit: the pool kills the child running it."""


def _retrying(write: Callable[[], T]) -> T:
    """Run ``write``, reconnecting and retrying for up to a minute while the database is
    down or the connection was terminated."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return write()
        except (OperationalError, InterfaceError):
            if time.monotonic() > deadline:
                raise
            connection.close()
            time.sleep(0.2)


def _run(task: Any, tenant: str, duration: float) -> str:
    run = _retrying(
        lambda: JobRun.objects.create(
            task_id=task.request.id,
            tenant=tenant,
            queue=(task.request.delivery_info or {}).get("routing_key") or "",
            pid=os.getpid(),
            retries=task.request.retries,
            started_at=Now(),
        )
    )
    try:
        time.sleep(duration)
    except BaseException:
        # Cut off (the pool's SIGTERM at the hard time limit raises here): record when the
        # job's code stopped, marked as not finished.
        JobRun.objects.filter(pk=run.pk).update(finished_at=Now(), interrupted=True)
        raise
    _retrying(lambda: JobRun.objects.filter(pk=run.pk).update(finished_at=Now()))
    return "done"


@shared_task(base=TenantFromFirstArg, bind=True, queue="chaos", fair_max_jobs=SLOT_LIMIT)
def chaos_slot(self: Any, tenant: str, duration: float) -> str:
    """Tenant slots: a tenant runs at most ``SLOT_LIMIT`` at once."""
    return _run(self, tenant, duration)


@shared_task(
    base=TenantFromFirstArg,
    bind=True,
    queue="chaos",
    fair_dispatch=True,
    fair_max_jobs=DISPATCH_LIMIT,
)
def chaos_dispatched(self: Any, tenant: str, duration: float) -> str:
    """Fair dispatch: waits in its tenant's line until a worker frees; a tenant runs at most
    ``DISPATCH_LIMIT`` at once."""
    return _run(self, tenant, duration)


@shared_task(
    base=TenantFromFirstArg,
    bind=True,
    queue="chaos",
    fair_slots=False,
    fair_reroute=[{"queue": "chaos_slow", "threshold": 3, "per": 300, "max_jobs": SLOW_LIMIT}],
)
def chaos_reroute(self: Any, tenant: str, duration: float) -> str:
    """Rerouting: a tenant's fourth job in five minutes goes to ``chaos_slow``, where it
    runs at most ``SLOW_LIMIT`` at once."""
    return _run(self, tenant, duration)


@shared_task(
    base=TenantFromFirstArg,
    bind=True,
    queue="chaos",
    fair_slots=False,
    fair_plan={"enqueue_interval": 0.5, "enqueue_jobs": 6, "latency_threshold": 60},
)
def chaos_planned(self: Any, tenant: str, duration: float) -> str:
    """The planner: waits in its tenant's virtual queue until a planner run promotes it."""
    return _run(self, tenant, duration)


@shared_task(bind=True, queue="chaos_limited")
def chaos_plain(self: Any, tenant: str, duration: float) -> str:
    """A plain task on a queue limited to ``QUEUE_LIMIT`` at once across nodes."""
    return _run(self, tenant, duration)


@shared_task(
    base=TenantFromFirstArg,
    bind=True,
    queue="chaos",
    fair_max_jobs=OVERRUN_LIMIT,
    time_limit=HARD_TIME_LIMIT,
)
def chaos_overrun(self: Any, tenant: str, duration: float) -> str:
    """Runs past its hard time limit: the pool kills the child, and the job is not retried
    (Celery acknowledges a job that timed out); its slot comes back by the reap."""
    return _run(self, tenant, duration)

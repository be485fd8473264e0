"""Test tasks: each records its own start and end (database clock) in JobRun."""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task
from django.db.models.functions import Now

from django_fair_jobs import FairTask
from tests.testapp.models import JobRun


class TenantFromFirstArg(FairTask):
    """The tenant is the first positional argument."""

    @classmethod
    def fair_tenant(cls, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs.get("tenant")


def _run(task: Any, tenant: str, duration: float) -> str:
    run = JobRun.objects.create(
        task_id=task.request.id,
        tenant=tenant,
        queue=(task.request.delivery_info or {}).get("routing_key") or "",
        pid=__import__("os").getpid(),
        retries=task.request.retries,
        started_at=Now(),
    )
    time.sleep(duration)
    JobRun.objects.filter(pk=run.pk).update(finished_at=Now())
    return f"{tenant}:done"


def _spin(task: Any, tenant: str, seconds: float) -> str:
    """Burn CPU in pure Python for ``seconds``, recording the run like ``_run``."""
    run = JobRun.objects.create(
        task_id=task.request.id, tenant=tenant, pid=__import__("os").getpid(), started_at=Now()
    )
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += sum(i * i for i in range(1000))
    JobRun.objects.filter(pk=run.pk).update(finished_at=Now())
    return f"{tenant}:done"


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_max_jobs=3)
def limited3(self: Any, tenant: str, duration: float = 0.05) -> str:
    """A job limited to 3 at once per tenant."""
    return _run(self, tenant, duration)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", max_retries=1)
def limited1(self: Any, tenant: str, duration: float = 0.05) -> str:
    """A job at the default limit (1) with max_retries=1."""
    return _run(self, tenant, duration)


@shared_task(
    base=TenantFromFirstArg,
    bind=True,
    queue="fair",
    fair_on_limit="retry",
    fair_retry_countdown=0.2,
    max_retries=0,
)
def limited1_retry(self: Any, tenant: str, duration: float = 0.05) -> str:
    """A job at the default limit that defers by re-publishing with a countdown."""
    return _run(self, tenant, duration)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", max_retries=3)
def retries_once(self: Any, tenant: str, duration: float = 0.05) -> str:
    """Fails on its first run and calls self.retry(): the retry competes for the slot."""
    if self.request.retries == 0:
        JobRun.objects.create(
            task_id=self.request.id,
            tenant=tenant,
            pid=0,
            retries=0,
            started_at=Now(),
            finished_at=Now(),
            queue="retry-marker",
        )
        raise self.retry(countdown=0.1)
    return _run(self, tenant, duration)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair")
def fails(self: Any, tenant: str) -> str:
    """Always raises: its slot must still come back."""
    raise RuntimeError("boom")


@shared_task(base=FairTask, bind=True, queue="fair")
def no_tenant(self: Any, value: int) -> int:
    """A fair task whose class resolves no tenant."""
    return value * 2


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair")
def spin(self: Any, tenant: str, seconds: float) -> str:
    """CPU-bound for ``seconds``: the heartbeat thread must keep beating meanwhile."""
    return _spin(self, tenant, seconds)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", soft_time_limit=1)
def overruns(self: Any, tenant: str) -> str:
    """Sleeps past its soft time limit: SoftTimeLimitExceeded is raised inside run()."""
    time.sleep(5)
    return "unreachable"


_SLOW = [{"queue": "fair_slow", "threshold": 2, "per": 60}]


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_slots=False, fair_reroute=_SLOW)
def rerouted(self: Any, tenant: str, duration: float = 0.05) -> str:
    """Rerouting only: a tenant's third job within a minute goes to ``fair_slow``."""
    return _run(self, tenant, duration)


@shared_task(
    base=TenantFromFirstArg,
    bind=True,
    queue="fair",
    fair_slots=False,
    fair_reroute=[{"queue": "fair_slow", "threshold": 2, "per": 60, "max_jobs": 1}],
)
def rerouted_capped(self: Any, tenant: str, duration: float = 0.05) -> str:
    """Like ``rerouted``, but a tenant runs at most one rerouted job at a time."""
    return _run(self, tenant, duration)


@shared_task(
    base=TenantFromFirstArg,
    bind=True,
    queue="fair",
    fair_slots=False,
    max_retries=3,
    fair_reroute=[{"queue": "fair_slow", "threshold": 1, "per": 60}],
)
def rerouted_retries_once(self: Any, tenant: str, duration: float = 0.05) -> str:
    """Calls self.retry() on its first run: the retry must not be counted again."""
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return _run(self, tenant, duration)


@shared_task(bind=True, queue="limited")
def plain_job(self: Any, tenant: str, duration: float = 0.05) -> str:
    """A plain Celery task (no FairTask): limited only through the worker's hook."""
    return _run(self, tenant, duration)


@shared_task(base=TenantFromFirstArg, bind=True, queue="limited", fair_max_jobs=2)
def fair_limited(self: Any, tenant: str, duration: float = 0.05) -> str:
    """A fair task on a limited queue: its tenant slot and its queue place go together."""
    return _run(self, tenant, duration)


@shared_task(bind=True, queue="limited")
def plain_spin(self: Any, tenant: str, seconds: float) -> str:
    """CPU-bound plain task: the heartbeat of its process must keep beating meanwhile."""
    return _spin(self, tenant, seconds)


PLAN_WEIGHTS: dict[str, float] = {}
"""Weights of the ``planned`` task's tenants (tests set them); a tenant not named weighs 1."""


def plan_weights(tenants: list[str]) -> dict[str, float]:
    """``tenant_weights`` of ``planned``: called with the tenants that have jobs due."""
    return {tenant: PLAN_WEIGHTS.get(tenant, 1) for tenant in tenants}


@shared_task(
    base=TenantFromFirstArg,
    bind=True,
    queue="fair",
    fair_slots=False,
    fair_plan={
        "enqueue_interval": 0.5,
        "enqueue_jobs": 100,
        "tenant_weights": "tests.testapp.tasks.plan_weights",
        "latency_threshold": 30,
    },
)
def planned(self: Any, tenant: str, duration: float = 0.01) -> str:
    """A planned job: it waits in its tenant's virtual queue until a planner promotes it."""
    return _run(self, tenant, duration)


_CONNECTIONS: list[Any] = []
"""Every database connection ``connection_serial`` has seen, kept alive so that each
keeps its place (an id could be reused once a connection is freed)."""


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair")
def connection_serial(self: Any, tenant: str) -> str:
    """Which database connection this job ran on: the server's backend pid on PostgreSQL,
    else the connection's serial number in this worker process."""
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
            return f"pid {cursor.fetchone()[0]}"
    raw = connection.connection
    if not any(seen is raw for seen in _CONNECTIONS):
        _CONNECTIONS.append(raw)
    return f"serial {next(i for i, seen in enumerate(_CONNECTIONS) if seen is raw)}"


DISPATCH_WEIGHTS: dict[str, float] = {}
"""Weights of the dispatched tasks' tenants (tests set them); a tenant not named weighs 1."""


def dispatch_weights(tenants: list[str]) -> dict[str, float]:
    """``tenant_weights`` of the dispatched tasks."""
    return {tenant: DISPATCH_WEIGHTS.get(tenant, 1) for tenant in tenants}


DISPATCH: dict[str, Any] = {"tenant_weights": "tests.testapp.tasks.dispatch_weights"}


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=DISPATCH)
def dispatched(self: Any, tenant: str, duration: float = 0.01) -> str:
    """A job of fair dispatch: it waits in its tenant's line until a worker frees."""
    return _run(self, tenant, duration)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=True, fair_max_jobs=2)
def dispatched_capped(self: Any, tenant: str, duration: float = 0.05) -> str:
    """Fair dispatch with a tenant cap of 2."""
    return _run(self, tenant, duration)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=True, max_retries=2)
def dispatched_retrying(self: Any, tenant: str, duration: float = 0.01) -> str:
    """Fair dispatch; the first run asks for a retry in 0.2 s (max_retries 2)."""
    result = _run(self, tenant, duration)
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)
    return result


@shared_task(bind=True, queue="fair", fair_dispatch=True, base=TenantFromFirstArg, acks_late=True)
def dispatched_late(self: Any, tenant: str, duration: float = 0.01) -> str:
    """Fair dispatch of an ``acks_late`` task: a job whose worker dies runs again."""
    return _run(self, tenant, duration)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=True, max_retries=2)
def dispatched_retry_in_atomic(self: Any, tenant: str) -> str:
    """Fair dispatch; the first run asks for a retry from inside its own ``atomic()``."""
    from django.db import transaction

    if self.request.retries == 0:
        with transaction.atomic():
            JobRun.objects.create(task_id=self.request.id, tenant=tenant, pid=0, started_at=Now())
            raise self.retry(countdown=60)
    return tenant


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=True, acks_late=False)
def dispatched_early(self: Any, tenant: str) -> str:
    """Fair dispatch of a task acknowledged at start (the suite's default is acks_late)."""
    return _run(self, tenant, 0.0)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=True, acks_late=True)
def dispatched_rejecting(self: Any, tenant: str) -> str:
    """Fair dispatch; the first delivery gives its message back (``Reject(requeue=True)``)."""
    from celery.exceptions import Reject

    if not (self.request.delivery_info or {}).get("redelivered"):
        raise Reject("not now", requeue=True)
    return tenant


class TenantFromKeyword(FairTask):
    """The tenant is the ``tenant`` keyword argument (chains pass results positionally)."""

    @classmethod
    def fair_tenant(cls, *args: Any, **kwargs: Any) -> Any:
        return kwargs.get("tenant")


@shared_task(bind=True, queue="fair", fair_dispatch=True, base=TenantFromKeyword)
def dispatched_add(self: Any, value: int, *, tenant: str) -> int:
    """Fair dispatch in a chain: records its run and returns ``value + 1``."""
    _run(self, tenant, 0.0)
    return value + 1


@shared_task(base=FairTask, bind=True, queue="fair", fair_dispatch=True)
def dispatched_no_tenant(self: Any, value: int) -> int:
    """A dispatched task whose class resolves no tenant: its jobs share one line."""
    return value * 2


@shared_task(base=FairTask, bind=True, queue="fair", fair_dispatch=True, fair_max_jobs=1)
def dispatched_no_tenant_capped(self: Any, value: int) -> int:
    """The same with a per-tenant cap, which a job without a tenant is not under."""
    return value * 2


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=True)
def dispatched_lineage(self: Any, tenant: str, duration: float = 0.0) -> list[str | None]:
    """Fair dispatch; returns the parent and root ids its message carried."""
    _run(self, tenant, duration)
    return [self.request.parent_id, self.request.root_id]


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", max_retries=3)
def retries_now(self: Any, tenant: str) -> str:
    """Calls self.retry() with no countdown on its first run."""
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return f"{tenant}:done"


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair")
def shrugs_off_soft_limit(self: Any, tenant: str, duration: float) -> str:
    """Catches ``SoftTimeLimitExceeded`` (what ``revoke(terminate=True, signal="SIGUSR1")``
    raises in a prefork child) and works on for its whole ``duration``: a terminate that
    does not stop the job."""
    return _shrug(self, tenant, duration)


@shared_task(base=TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=True)
def dispatched_shrugs_off_soft_limit(self: Any, tenant: str, duration: float) -> str:
    """:func:`shrugs_off_soft_limit` with fair dispatch (no cap: it holds no slot)."""
    return _shrug(self, tenant, duration)


def _shrug(task: Any, tenant: str, duration: float) -> str:
    from contextlib import suppress

    from celery.exceptions import SoftTimeLimitExceeded

    run = JobRun.objects.create(
        task_id=task.request.id, tenant=tenant, pid=__import__("os").getpid(), started_at=Now()
    )
    deadline = time.monotonic() + duration
    while (left := deadline - time.monotonic()) > 0:
        with suppress(SoftTimeLimitExceeded):  # cleanup, as such tasks do, then go on
            time.sleep(left)
    JobRun.objects.filter(pk=run.pk).update(finished_at=Now())
    return f"{tenant}:done"

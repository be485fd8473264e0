"""The benchmark's jobs: the same work as a plain Celery task and as FairTasks.

Each job sleeps or burns CPU for its planned duration, then writes one :class:`JobRecord`
with its own start and end times. Worker processes started by the benchmark also save how
many statements they sent to the library's tables when they exit.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task
from celery.signals import (
    task_postrun,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)

from bench import statements
from bench.models import JobRecord, StatementCount
from django_fair_jobs import FairTask


def burn(seconds: float) -> None:
    """Keep a CPU busy for ``seconds`` of wall time."""
    deadline = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < deadline:
        for i in range(1000):
            x += i * i


def work(
    *, run: str, mode: str, job: int, tenant: str, enqueued_at: float, seconds: float, kind: str
) -> None:
    """Do one job's work and record when it ran."""
    started = time.time()
    if kind == "cpu":
        burn(seconds)
    elif seconds > 0:
        time.sleep(seconds)
    finished = time.time()
    JobRecord.objects.create(
        run=run,
        mode=mode,
        job=job,
        tenant=tenant,
        enqueued_at=enqueued_at,
        started_at=started,
        finished_at=finished,
        pid=os.getpid(),
    )


class PerTenant(FairTask):
    """Fair per the job's ``tenant`` keyword; a task with tenant slots takes its limit from
    ``FAIR_JOBS_DEFAULT_MAX_JOBS``."""

    @classmethod
    def fair_tenant(cls, *args: Any, **kwargs: Any) -> Any:
        return kwargs.get("tenant")


@shared_task(name="bench.plain_job", ignore_result=True)
def plain_job(**kwargs: Any) -> None:
    """A plain Celery task: FIFO, whoever enqueues most takes every worker."""
    work(**kwargs)


@shared_task(base=PerTenant, name="bench.slots_job", ignore_result=True, fair_dispatch=False)
def slots_job(**kwargs: Any) -> None:
    """The same job as a FairTask with tenant slots (mechanism A)."""
    work(**kwargs)


@shared_task(base=PerTenant, name="bench.reroute_job", ignore_result=True, fair_slots=False)
def reroute_job(**kwargs: Any) -> None:
    """The same job as a FairTask that only reroutes (mechanism B); the benchmark sets its
    rules for each run (see ``bench.modes``)."""
    work(**kwargs)


@shared_task(base=PerTenant, name="bench.queue_limits_job", ignore_result=True, fair_slots=False)
def queue_limits_job(**kwargs: Any) -> None:
    """Rerouting only, to a slow queue the benchmark caps with a queue limit (mechanism D)."""
    work(**kwargs)


def tenant_weights(tenants: list[str]) -> dict[str, float]:
    """The scenario's tenant weights (``BENCH_WEIGHTS``, JSON, set by the runner for the
    publisher and the workers); a tenant not named weighs 1."""
    import json

    weights = json.loads(os.environ.get("BENCH_WEIGHTS") or "{}")
    return {t: float(weights.get(t, 1.0)) for t in tenants}


PLAN: dict[str, Any] = {
    "enqueue_interval": 0.2,
    "enqueue_jobs": 50,
    "latency_threshold": 0.2,
    "tenant_weights": tenant_weights,
}
"""The benchmark's fair plan: every 0.2 s up to 50 jobs (a little more than 4 workers run
in that time), held back while the oldest promoted job has waited over 0.2 s, so the
broker's queue stays short and a new tenant's job is never far from the front; the
scenario's weights."""


@shared_task(
    base=PerTenant, name="bench.planner_job", ignore_result=True, fair_slots=False, fair_plan=PLAN
)
def planner_job(**kwargs: Any) -> None:
    """The same job through the fair planner only (mechanism C), equal weights."""
    work(**kwargs)


@shared_task(base=PerTenant, name="bench.combined_job", ignore_result=True, fair_plan=PLAN)
def combined_job(**kwargs: Any) -> None:
    """The same job with every mechanism: the planner, tenant slots, rerouting and the
    capped slow queue: the recommended combination."""
    work(**kwargs)


@shared_task(
    base=PerTenant,
    name="bench.dispatch_job",
    ignore_result=True,
    fair_dispatch={"tenant_weights": tenant_weights},
)
def dispatch_job(**kwargs: Any) -> None:
    """The same job through fair dispatch: it waits in its tenant's line in the database
    and is published when a worker process of its queue frees; the scenario's weights."""
    work(**kwargs)


def _configure_from_env() -> None:
    """In the benchmark's worker processes: the run's queue and rerouting rules of the
    mode's task, which the publisher sets at runtime (queues are per run). Workers need
    them too: a planner promotes jobs from a worker, and rules count at that publish."""
    import json

    from bench.modes import MODES

    mode, queue = os.environ.get("BENCH_MODE"), os.environ.get("BENCH_QUEUE")
    if not mode or not queue or mode not in MODES:
        return
    task = {
        t.name: t for t in (queue_limits_job, reroute_job, combined_job, planner_job, dispatch_job)
    }.get(MODES[mode].task)
    # Only this mode's task plans: other modes' planners would poll for nothing.
    for planned in (planner_job, combined_job):
        if planned is not task:
            setattr(planned, "fair_plan", None)  # noqa: B010
    if task is not None:
        setattr(task, "queue", queue)  # noqa: B010
        setattr(task, "fair_reroute", json.loads(os.environ.get("BENCH_RULES") or "[]"))  # noqa: B010


_configure_from_env()


def _save_count(**_: Any) -> None:
    run, mode = os.environ.get("BENCH_RUN"), os.environ.get("BENCH_MODE")
    if run and mode:
        StatementCount.objects.create(
            run=run,
            mode=mode,
            pid=os.getpid(),
            statements=statements.count(),
            on_path=statements.on_path_to_last_job(),
            commits=statements.commits(),
        )


@worker_process_init.connect
def _reset_count(**_: Any) -> None:
    statements.reset()


@task_postrun.connect
def _job_ended(**_: Any) -> None:
    # The library sends a job's statements in the task's __call__, before this signal.
    statements.job_ended()


# A prefork child saves its count as it exits; the main process (or a solo or threads
# pool, which runs the jobs itself) as the worker shuts down.
worker_process_shutdown.connect(_save_count)
worker_shutdown.connect(_save_count)

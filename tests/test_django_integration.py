"""What Celery's Django integration gives every task, kept by FairTask: publishing when
the transaction commits, and publishing from async views."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
from celery.contrib.django.task import DjangoTask
from django.db import connection, transaction
from django.test import AsyncClient

from django_fair_jobs.models import PlannedJob, TenantWindow
from django_fair_jobs.task import FairTask
from tests.conftest import Worker, wait_for
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = pytest.mark.django_db(transaction=True)


def _tenant(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def _ran(tenant: str) -> bool:
    return JobRun.objects.filter(tenant=tenant, finished_at__isnull=False).exists()


def test_fair_task__is_a_django_task() -> None:
    assert issubclass(FairTask, DjangoTask)
    assert isinstance(tasks.limited3, DjangoTask)


@pytest.mark.workers
def test_delay_on_commit__commit__job_runs_after_commit(
    start_worker: Callable[..., Worker],
) -> None:
    tenant = _tenant("committed")
    worker = start_worker()
    with transaction.atomic():
        tasks.limited3.delay_on_commit(tenant, 0.01)
        tasks.limited3.apply_async_on_commit((tenant, 0.01))
        # Nothing is published before the commit: no worker can have started it.
        assert not JobRun.objects.filter(tenant=tenant).exists()
    wait_for(
        lambda: JobRun.objects.filter(tenant=tenant, finished_at__isnull=False).count() == 2,
        60,
        f"both on-commit jobs of {tenant} to run\n{worker.output()}",
    )


@pytest.mark.workers
def test_delay_on_commit__rollback__nothing_published(start_worker: Callable[..., Worker]) -> None:
    rolled_back, after = _tenant("rolled-back"), _tenant("after")
    start_worker(concurrency=1)
    with transaction.atomic():
        tasks.limited3.delay_on_commit(rolled_back, 0.01)
        tasks.limited3.apply_async_on_commit((rolled_back, 0.01))
        transaction.set_rollback(True)
    # A job published after the rollback runs; one worker process takes jobs in order, so
    # a job published at the rollback would have run before it.
    tasks.limited3.delay(after, 0.01)
    wait_for(lambda: _ran(after), 60, f"the job of {after} to run")
    assert not JobRun.objects.filter(tenant=rolled_back).exists()


def test_async_view__publishes_rerouted_and_planned_jobs() -> None:
    tenant = _tenant("async")
    response = asyncio.run(AsyncClient().get(f"/publish/{tenant}/"))
    assert response.status_code == 200, response.content
    ids = response.json()
    # The rerouting rule counted the enqueue, and the planned job waits in its tenant's
    # virtual queue: both statements ran, from the event loop's publish.
    assert TenantWindow.objects.filter(tenant=tenant).exists()
    assert PlannedJob.objects.filter(task_id=ids["planned"], tenant=tenant).exists()


def _serials(count: int) -> list[str]:
    # One at a time: each job starts after the previous one ended.
    return [
        str(tasks.connection_serial.delay(_tenant("conn")).get(timeout=60)) for _ in range(count)
    ]


_REUSE = {"CELERY_DB_REUSE_MAX": "1000", "CONN_HEALTH_CHECKS": "true"}


@pytest.mark.workers
def test_worker_connection__reused_between_jobs_within_conn_max_age(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker(pool="solo", concurrency=1, extra_env={**_REUSE, "CONN_MAX_AGE": "600"})
    first, *rest = _serials(3)
    assert rest == [first, first]
    if connection.vendor != "postgresql":
        return
    # The server drops the connection between two jobs (a restart, a failover, an idle
    # timeout): the next job checks it before use and reconnects instead of failing.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [int(first.split()[1])])
    wait_for(lambda: not _backend_alive(int(first.split()[1])), 10, "the backend to be terminated")
    after = _serials(1)[0]
    assert after != first


def _backend_alive(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
        return bool(cursor.fetchone()[0])


@pytest.mark.workers
def test_worker_connection__conn_max_age_0__new_connection_per_job(
    start_worker: Callable[..., Worker],
) -> None:
    # Celery keeps connections (CELERY_DB_REUSE_MAX), but CONN_MAX_AGE = 0 means "one
    # connection per unit of work", as per request in Django: each job gets its own.
    start_worker(pool="solo", concurrency=1, extra_env={**_REUSE, "CONN_MAX_AGE": "0"})
    serials = _serials(3)
    assert len(set(serials)) == 3, serials

"""What the dispatch tests share: a broker that collects what is published, a queue's
capacity set by hand, a process's ledger of its own, and a job's message run as a worker
runs it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery.exceptions import Ignore

from django_fair_jobs import dispatch, headers, queue_limits
from django_fair_jobs.dispatch.models import DispatchJob, DispatchQueue
from tests.conftest import run_as_worker
from tests.testapp import tasks


@pytest.fixture
def collected(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Nothing reaches a broker: the jobs dispatched are collected (row ids)."""
    out: list[int] = []

    def collect(app: Any, ready: list[dispatch.Ready]) -> int:
        out.extend(r.job_id for r in ready)
        return len(ready)

    monkeypatch.setattr(dispatch, "publish", collect)
    queue_limits._cache.loaded_at = 0.0
    yield out
    queue_limits._cache.loaded_at = 0.0


def set_capacity(capacity: int, queue: str = "fair") -> None:
    """``queue``'s capacity, as maintenance sets it from live worker processes."""
    DispatchQueue.objects.update_or_create(queue=queue, defaults={"capacity": capacity})


def job_of(task_id: str) -> DispatchJob:
    """The row of the dispatched job ``task_id``."""
    return DispatchJob.objects.get(task_id=task_id)


def deliver(job: DispatchJob, task: Any = tasks.dispatched, **delivery: Any) -> str:
    """Run a dispatched job's message as a worker would: "ran", or "not run" when the
    delivery is acknowledged without running (``Ignore``)."""
    try:
        run_as_worker(
            task, (job.tenant,), task_id=job.task_id, headers={headers.DISPATCH: job.pk},
            **delivery,
        )  # fmt: skip
    except Ignore:
        return "not run"
    return "ran"

"""Sliding-window rerouting with real worker processes: retries, tasks sent by name, chains,
the slow queue's share and a rule's max_jobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import chain

from tests.conftest import Worker, wait_for
from tests.reroute.test_store import window_total
from tests.test_workers import max_overlap, wait_finished
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = pytest.mark.django_db(transaction=True)


# -- real workers -----------------------------------------------------------------------------

pytest_workers = pytest.mark.workers


@pytest_workers
def test_worker__retry_of_a_rerouted_job_stays_and_is_not_counted(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker(queues="fair,fair_slow")
    first = tasks.rerouted_retries_once.delay("acme")
    second = tasks.rerouted_retries_once.delay("acme")
    assert second.get(timeout=60) == "acme:done" and first.get(timeout=60) == "acme:done"
    assert window_total("acme") == 2
    runs = dict(JobRun.objects.values_list("task_id", "queue"))
    assert runs == {first.id: "fair", second.id: "fair_slow"}


@pytest_workers
def test_worker__send_task_by_name_counted_at_delivery_and_rerouted(
    start_worker: Callable[..., Worker], celery_app: Any
) -> None:
    start_worker(queues="fair,fair_slow")
    ids = [celery_app.send_task(tasks.rerouted.name, ("acme",), queue="fair").id for _ in range(4)]
    wait_finished(ids)
    queues = sorted(JobRun.objects.filter(task_id__in=ids).values_list("queue", flat=True))
    assert queues == ["fair", "fair", "fair_slow", "fair_slow"]
    assert window_total("acme") == 4
    assert JobRun.objects.count() == 4  # each ran once


@pytest_workers
def test_worker__chain_links_are_counted_as_they_are_published(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker(queues="fair,fair_slow")
    result = chain(
        tasks.rerouted.si("acme", 0), tasks.rerouted.si("acme", 0), tasks.rerouted.si("acme", 0)
    ).delay()
    result.get(timeout=60)
    assert window_total("acme") == 3
    queues = list(JobRun.objects.order_by("started_at").values_list("queue", flat=True))
    assert queues == ["fair", "fair", "fair_slow"]


@pytest_workers
def test_worker__slow_queue_gets_a_bounded_share_then_full_speed(
    start_worker: Callable[..., Worker],
) -> None:
    """The documented setup: every worker consumes the normal and the slow queue. While
    normal jobs wait, the greedy tenant's rerouted jobs get at most about half of the
    starts; once the normal queue is empty, they use every process."""
    start_worker(queues="fair,fair_slow", concurrency=2)
    greedy = [tasks.rerouted.delay("greedy", 0.2).id for _ in range(32)]
    wait_for(lambda: JobRun.objects.filter(tenant="greedy").count() >= 4, 30, "greedy to start")
    small = [tasks.rerouted.delay(f"small{i}", 0.2).id for i in range(10)]
    wait_finished(greedy + small, timeout=120)
    starts = list(JobRun.objects.order_by("started_at", "id").values_list("tenant", "queue"))
    first_small = next(i for i, (t, _) in enumerate(starts) if t.startswith("small"))
    last_small = max(i for i, (t, _) in enumerate(starts) if t.startswith("small"))
    between = starts[first_small : last_small + 1]
    slow_between = sum(1 for _, q in between if q == "fair_slow")
    # Round robin between the two queues, give or take one prefetched message per process.
    assert slow_between <= 10 + 2, starts
    assert last_small < len(starts) - 10, "small jobs waited for the greedy backlog"
    slow_runs = [
        (s, e)
        for s, e, q in JobRun.objects.values_list("started_at", "finished_at", "queue")
        if q == "fair_slow" and e is not None
    ]
    assert max_overlap(slow_runs) == 2  # full speed when nothing else waits


@pytest_workers
def test_worker__rule_max_jobs_caps_rerouted_jobs_per_tenant(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker(queues="fair,fair_slow", concurrency=3)
    ids = [tasks.rerouted_capped.delay("acme", 0.15).id for _ in range(8)]
    wait_finished(ids)
    runs = list(JobRun.objects.values_list("started_at", "finished_at", "queue"))
    assert sorted(q for _, _, q in runs) == ["fair"] * 2 + ["fair_slow"] * 6
    assert max_overlap([(s, e) for s, e, q in runs if q == "fair_slow" and e is not None]) == 1

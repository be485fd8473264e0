"""Fair dispatch with real Celery worker processes, a real broker and the real database."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from celery import chain, shared_task

from django_fair_jobs import dispatch, explanations
from django_fair_jobs.dispatch.models import (
    DISPATCHED,
    FAILED,
    RUNNING,
    WAITING,
    DispatchJob,
    DispatchQueue,
    DispatchTenant,
)
from django_fair_jobs.models import ParkedJob
from tests.conftest import Worker, wait_for
from tests.test_workers import max_overlap, wait_finished
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]

FAST = {"FAIR_JOBS_HEARTBEAT_INTERVAL": "0.5", "FAIR_JOBS_WORKER_TIMEOUT": "3"}
"""Worker settings that make maintenance run every half second."""


def intervals(tenant: str | None = None) -> list[tuple[datetime, datetime]]:
    rows = JobRun.objects.filter(finished_at__isnull=False)
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    return [
        (r.started_at, r.finished_at)
        for r in rows
        if r.started_at is not None and r.finished_at is not None
    ]


def wait_capacity(processes: int) -> None:
    """Wait until the queue's capacity counts every started process: before that, a test
    of how jobs share the processes would see fewer of them than it started."""
    wait_for(
        lambda: DispatchQueue.objects.filter(queue="fair", capacity=processes).exists(),
        30,
        f"the queue's capacity to reach {processes}",
    )


def settled() -> bool:
    """Every row gone and every counter back to zero."""
    return (
        not DispatchJob.objects.exists()
        and not DispatchTenant.objects.filter(in_flight__gt=0).exists()
        and not DispatchTenant.objects.filter(waiting__gt=0).exists()
    )


def test_jobs_run__results_as_usual__rows_and_counters_settle(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker("d", concurrency=2, extra_env=FAST)
    results = [tasks.dispatched.delay(f"t{i % 3}") for i in range(12)]
    assert [r.get(timeout=60) for r in results] == [f"t{i % 3}:done" for i in range(12)]
    wait_for(settled, 20, "dispatch rows and counters to settle")
    assert JobRun.objects.count() == 12


def test_jobs_enqueued_before_any_worker__run_when_one_starts(
    start_worker: Callable[..., Worker],
) -> None:
    ids = [tasks.dispatched.delay("early").id for _ in range(5)]
    assert DispatchJob.objects.count() == 5  # nothing consumes the queue yet: they wait
    start_worker("d", concurrency=2, extra_env=FAST)
    wait_finished(ids, timeout=60)


def test_work_conserving__no_process_idles_while_eligible_work_waits(
    start_worker: Callable[..., Worker],
) -> None:
    # Sampled throughout a run: whenever jobs wait (no tenant has a cap), the queue is
    # full (in flight == capacity + slack) within a bound; an idle slot that stays idle
    # while work waits fails the test. The bound is half the maintenance interval, so
    # that only dispatch at enqueue and at each job's end can keep it.
    start_worker("d", concurrency=2, extra_env=FAST)
    wait_capacity(2)
    ids = [tasks.dispatched.delay(f"t{i % 4}", 0.05).id for i in range(60)]
    idle_since: float | None = None
    worst = 0.0
    while JobRun.objects.filter(task_id__in=ids, finished_at__isnull=False).count() < len(ids):
        queue = DispatchQueue.objects.get(queue="fair")
        waiting = DispatchJob.objects.filter(state=1).exists()
        in_flight = dispatch.in_flight().get("fair", 0)
        if waiting and in_flight < queue.capacity + queue.slack:
            idle_since = idle_since or time.monotonic()
            worst = max(worst, time.monotonic() - idle_since)
        else:
            idle_since = None
        time.sleep(0.01)
    assert worst < 0.25, f"a slot stayed free for {worst:.2f} s while jobs waited"
    wait_for(settled, 20, "dispatch rows and counters to settle")


def test_two_nodes_with_a_tenant_cap__never_exceeded__nothing_parked(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker("n1", concurrency=2, extra_env=FAST)
    start_worker("n2", concurrency=2, extra_env=FAST)
    wait_capacity(4)
    parked, flight = [], []
    stop = threading.Event()

    def watch() -> None:
        from django.db import connections

        try:
            while not stop.is_set():
                parked.append(ParkedJob.objects.count())
                flight.append(DispatchJob.objects.filter(state__in=[DISPATCHED, RUNNING]).count())
                time.sleep(0.05)
        finally:
            connections.close_all()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        ids = [tasks.dispatched_capped.delay("capped", 0.1).id for _ in range(12)]
        ids += [tasks.dispatched_capped.delay("other", 0.1).id for _ in range(4)]
        wait_finished(ids, timeout=90)
    finally:
        stop.set()
        watcher.join()
    assert max_overlap(intervals("capped")) <= 2
    assert max(parked) == 0
    # The cap is a filter: while capped waited at its cap, other's jobs were dispatched
    # into the room left (counted from the rows: which process runs a message and when
    # is the broker's and the machine's, and a loaded machine's delivery made the
    # processes' own overlap a race of the test).
    assert max(flight) >= 3


def test_retry__back_through_the_line__runs_again_and_succeeds(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker("d", concurrency=2, extra_env=FAST)
    result = tasks.dispatched_retrying.delay("r")
    assert result.get(timeout=60) == "r:done"
    runs = JobRun.objects.filter(task_id=result.id).order_by("started_at")
    assert [r.retries for r in runs] == [0, 1]
    wait_for(settled, 20, "dispatch rows and counters to settle")


def test_d1__many_retries_with_short_countdowns__no_deadlock__each_runs_twice(
    start_worker: Callable[..., Worker],
) -> None:
    # Countdowns coming due while other jobs end: the due step used to wait for other
    # tenants' lines while its end held the queue's row (84 to 156 "deadlock detected" per
    # run of 240 such jobs on 4 processes).
    worker = start_worker("d", concurrency=4, extra_env=FAST)
    ids = [tasks.dispatched_retrying.delay(f"r{i % 8}", 0.005).id for i in range(120)]
    wait_for(
        lambda: (
            JobRun.objects.filter(task_id__in=ids, retries=1, finished_at__isnull=False)
            .values("task_id")
            .distinct()
            .count()
            == len(ids)
        ),
        120,
        "every job to run, retry and run again",
    )
    wait_for(settled, 20, "dispatch rows and counters to settle")
    assert "deadlock detected" not in worker.output()


def test_d18__revoke_terminate__job_survives__its_room_held_until_it_ends(
    start_worker: Callable[..., Worker],
) -> None:
    # A dispatched job without a cap holds no slot lease, through which the terminate's
    # handler found its pool process: its row was dropped at once, so the room it still
    # used went to the next job while it ran on. One process, no slack: one room.
    worker = start_worker(
        "d", pool="prefork", concurrency=1, extra_env={**FAST, "FAIR_JOBS_DISPATCH_SLACK": "0"}
    )
    victim = tasks.dispatched_shrugs_off_soft_limit.delay("v", 4)
    wait_for(lambda: JobRun.objects.filter(task_id=victim.id).exists(), 30, "the victim to start")
    follower = tasks.dispatched.delay("f")
    victim.revoke(terminate=True, signal="SIGUSR1")
    wait_for(lambda: "Terminating" in worker.output(), 20, "the worker to signal the victim")
    states: set[int] = set()
    while not JobRun.objects.filter(task_id=victim.id, finished_at__isnull=False).exists():
        victim_row = DispatchJob.objects.filter(task_id=victim.id).first()
        follower_row = DispatchJob.objects.filter(task_id=follower.id).first()
        assert victim_row is not None, "the terminated job's row went while it still ran"
        if follower_row is not None:
            states.add(follower_row.state)
        time.sleep(0.05)
    assert states == {WAITING}, "the room of the job that survived went to another"
    assert follower.get(timeout=30) == "f:done"
    wait_for(settled, 20, "dispatch rows and counters to settle")


def test_chain__each_link_dispatched__result_flows(start_worker: Callable[..., Worker]) -> None:
    start_worker("d", concurrency=2, extra_env=FAST)
    result = chain(
        tasks.dispatched_add.s(0, tenant="c"),
        tasks.dispatched_add.s(tenant="c"),
        tasks.dispatched_add.s(tenant="c"),
    ).delay()
    assert result.get(timeout=60) == 3
    assert JobRun.objects.filter(tenant="c").count() == 3


def test_purged_queue__messages_lost__published_again_and_run(
    start_worker: Callable[..., Worker], celery_app: Any
) -> None:
    # Dispatched into a capacity that a worker left behind, then the broker loses them.
    DispatchQueue.objects.create(queue="fair", capacity=2, slack=0)
    ids = [tasks.dispatched.delay("lost").id for _ in range(4)]
    assert DispatchJob.objects.filter(state=2).count() == 2
    with celery_app.connection_for_write() as conn:
        conn.default_channel.queue_purge("fair")
    start_worker("d", concurrency=2, extra_env={**FAST, "FAIR_JOBS_DISPATCH_LOST_AFTER": "1"})
    wait_finished(ids, timeout=60)
    wait_for(settled, 20, "dispatch rows and counters to settle")


def test_worker_killed_mid_job__acks_late_job_runs_again__the_line_goes_on(
    start_worker: Callable[..., Worker],
) -> None:
    doomed = start_worker("doomed", concurrency=1, extra_env=FAST)
    # Long enough to be killed mid-run; its second run is waited out by the teardown.
    long = tasks.dispatched_late.delay("k", 4)
    wait_for(lambda: JobRun.objects.filter(task_id=long.id).exists(), 30, "the long job to start")
    others = [tasks.dispatched.delay("k2").id for _ in range(3)]
    doomed.kill()
    start_worker("rescuer", concurrency=2, extra_env=FAST)
    wait_finished(others, timeout=60)
    # The killed job's row went back to its line once its process stopped beating.
    wait_for(lambda: JobRun.objects.filter(task_id=long.id).count() >= 2, 60, "a second run")


def test_countdown_on_an_idle_queue__dispatched_when_due__not_at_the_next_heartbeat(
    start_worker: Callable[..., Worker],
) -> None:
    # Maintenance would come a minute later: only the due poll can dispatch the job soon.
    slow = {"FAIR_JOBS_HEARTBEAT_INTERVAL": "60", "FAIR_JOBS_WORKER_TIMEOUT": "120"}
    start_worker("d", concurrency=1, extra_env=slow)
    result = tasks.dispatched.apply_async(("later",), countdown=1)
    assert DispatchJob.objects.get(task_id=result.id).state == 0  # scheduled, not due yet
    assert result.get(timeout=20) == "later:done"
    run = JobRun.objects.get(task_id=result.id)
    assert run.started_at is not None
    # Its row ends with the job, flushed by its process's flusher thread just after.
    wait_for(lambda: not DispatchJob.objects.filter(task_id=result.id).exists(), 10, "its end")


def test_lineage__a_job_published_at_another_jobs_end__keeps_its_own_parent_and_root(
    start_worker: Callable[..., Worker],
) -> None:
    # One process and no slack: b waits in line and is published by a's end, inside a's
    # run. Its message must say what Celery would have said at b's delay(): no parent.
    start_worker("d", concurrency=1, extra_env={**FAST, "FAIR_JOBS_DISPATCH_SLACK": "0"})
    a = tasks.dispatched_lineage.delay("a", 1.0)
    wait_for(lambda: JobRun.objects.filter(task_id=a.id).exists(), 30, "a to start")
    b = tasks.dispatched_lineage.delay("b")
    assert DispatchJob.objects.get(task_id=b.id).state == 1  # waiting behind a
    assert a.get(timeout=30) == [None, a.id]
    parent, root = b.get(timeout=30)
    assert parent is None and root == b.id, (parent, root, a.id)


@shared_task(base=tasks.TenantFromFirstArg, bind=True, queue="fair", fair_dispatch=True)
def unregistered(self: Any, tenant: str) -> str:
    """A task of the publisher only: the test's workers never import this module."""
    return tenant


def test_a_task_no_worker_knows__its_jobs_end_failed__their_room_goes_to_others(
    start_worker: Callable[..., Worker],
) -> None:
    # A deploy whose workers lag its publishers: Celery rejects a message of a task it has
    # not registered. Its job must not keep its place in flight (2 processes and 1 of
    # slack: three such jobs would stall the queue until the lost-message repair).
    worker = start_worker("d", concurrency=2, extra_env=FAST)
    unknown = [unregistered.delay("u").id for _ in range(3)]
    wait_for(
        lambda: DispatchJob.objects.filter(task_id__in=unknown, state=FAILED).count() == 3,
        30, "the jobs of the unregistered task to end failed",
    )  # fmt: skip
    assert "Received unregistered task" in worker.output()
    failures = DispatchJob.objects.filter(task_id__in=unknown).values_list("failure", flat=True)
    assert set(failures) == {"unregistered"}
    known = [tasks.dispatched.delay("k").id for _ in range(3)]
    wait_finished(known, timeout=30)
    explained = explanations.explain(unknown[0])
    assert explained.state == "failed"
    assert "no task of that name" in explained.summary

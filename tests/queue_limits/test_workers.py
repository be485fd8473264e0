"""Queue limits under real Celery worker nodes, a real broker and the real database."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from django.core.management import call_command

from django_fair_jobs import queue_limits
from django_fair_jobs.db import database_now
from django_fair_jobs.models import ParkedJob, QueueLimit, SlotLease, TenantQueueSlot, WorkerProcess
from tests.conftest import Worker, wait_for
from tests.test_workers import max_overlap, wait_finished
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]

PLAIN = {"FAIR_JOBS_LIMIT_PLAIN_TASKS": "true"}


def runs(ids: list[str], pids: list[int] | None = None) -> list[tuple[datetime, datetime]]:
    rows = JobRun.objects.filter(task_id__in=ids, finished_at__isnull=False)
    if pids is not None:
        rows = rows.filter(pid__in=pids)
    return [(s, e) for s, e in rows.values_list("started_at", "finished_at")]  # type: ignore[misc]


def node_pids(worker: Worker) -> list[int]:
    return [worker.proc.pid, *worker.child_pids()]


def assert_queue_idle(queue: str = "limited") -> None:
    """Nothing is held or waiting on ``queue`` any more, and its counters agree."""
    wait_for(
        lambda: (
            not SlotLease.objects.filter(queue_limit__queue=queue).exists()
            and not ParkedJob.objects.filter(queue_limit__queue=queue).exists()
        ),
        20,
        f"leases and parked jobs of {queue} to be gone",
    )
    row = QueueLimit.objects.get(queue=queue)
    assert (row.current_jobs, row.running, row.parked_jobs) == (0, {}, 0)


def test_global_limit__shared_by_two_nodes(start_worker: Callable[..., Worker]) -> None:
    # LF-11: limit 3 across two nodes of 2 processes each: 3 run, the 4th process waits.
    queue_limits.set_limits("limited", max_jobs=3)
    a = start_worker("a", concurrency=2, queues="limited", extra_env=PLAIN)
    b = start_worker("b", concurrency=2, queues="limited", extra_env=PLAIN)
    ids = [tasks.plain_job.delay("t", 0.4).id for _ in range(12)]
    wait_finished(ids)
    assert max_overlap(runs(ids)) == 3
    assert runs(ids, node_pids(a)) and runs(ids, node_pids(b))
    assert JobRun.objects.filter(task_id__in=ids).count() == 12  # each ran once
    assert_queue_idle()


def test_per_worker_limit__counts_by_node(start_worker: Callable[..., Worker]) -> None:
    queue_limits.set_limits("limited", max_jobs_per_worker=1)
    a = start_worker("a", concurrency=3, queues="limited", extra_env=PLAIN)
    b = start_worker("b", pool="threads", concurrency=3, queues="limited", extra_env=PLAIN)
    ids = [tasks.plain_job.delay("t", 0.3).id for _ in range(10)]
    wait_finished(ids)
    assert max_overlap(runs(ids, node_pids(a))) == 1
    assert max_overlap(runs(ids, node_pids(b))) == 1
    assert max_overlap(runs(ids)) == 2
    assert_queue_idle()


def test_both_limits__each_holds(start_worker: Callable[..., Worker]) -> None:
    queue_limits.set_limits("limited", max_jobs=3, max_jobs_per_worker=2)
    a = start_worker("a", concurrency=3, queues="limited", extra_env=PLAIN)
    b = start_worker("b", concurrency=3, queues="limited", extra_env=PLAIN)
    ids = [tasks.plain_job.delay("t", 0.3).id for _ in range(14)]
    wait_finished(ids)
    assert max_overlap(runs(ids)) == 3
    assert max(max_overlap(runs(ids, node_pids(a))), max_overlap(runs(ids, node_pids(b)))) == 2
    assert_queue_idle()


def test_limit_one__serialises(start_worker: Callable[..., Worker]) -> None:
    queue_limits.set_limits("limited", max_jobs=1)
    start_worker("a", concurrency=4, queues="limited", extra_env=PLAIN)
    ids = [tasks.plain_job.delay("t", 0.1).id for _ in range(6)]
    wait_finished(ids)
    assert max_overlap(runs(ids)) == 1
    assert_queue_idle()


def test_limit_zero__pauses__other_queues_carry_on__raising_it_resumes(
    start_worker: Callable[..., Worker],
) -> None:
    queue_limits.set_limits("limited", max_jobs=0)
    # Beats (and so maintenance sweeps) 20 s apart: what starts within 10 s of the change
    # was woken by the change itself.
    slow_sweep = {**PLAIN, "FAIR_JOBS_HEARTBEAT_INTERVAL": "20", "FAIR_JOBS_WORKER_TIMEOUT": "60"}
    start_worker("a", concurrency=2, queues="limited,fair", extra_env=slow_sweep)
    paused = [tasks.plain_job.delay("p", 0.01).id for _ in range(3)]
    wait_for(lambda: QueueLimit.objects.get(queue="limited").parked_jobs == 3, 20, "3 parked")
    # The worker meanwhile runs the jobs of its other queue.
    other = [tasks.limited3.delay("o", 0.01).id for _ in range(3)]
    wait_finished(other)
    assert not JobRun.objects.filter(task_id__in=paused).exists()
    call_command("fair_jobs_limit", "limited", "--max-jobs", "2")
    wait_finished(paused, timeout=10)
    assert_queue_idle()


def test_limit_zero__running_jobs_finish(start_worker: Callable[..., Worker]) -> None:
    queue_limits.set_limits("limited", max_jobs=2)
    start_worker("a", concurrency=2, queues="limited", extra_env=PLAIN)
    running = [tasks.plain_job.delay("r", 1.5).id for _ in range(2)]
    wait_for(lambda: JobRun.objects.filter(task_id__in=running).count() == 2, 20, "2 running")
    queue_limits.set_limits("limited", max_jobs=0)
    later = tasks.plain_job.delay("r", 0.01).id
    wait_finished(running)
    wait_for(lambda: ParkedJob.objects.filter(task_id=later).exists(), 20, "later parked")
    assert not JobRun.objects.filter(task_id=later).exists()


def test_limits__independent_per_queue__unlimited_queue_untouched(
    start_worker: Callable[..., Worker],
) -> None:
    queue_limits.set_limits("limited", max_jobs=1)
    start_worker("a", concurrency=4, queues="limited,fair", extra_env=PLAIN)
    limited = [tasks.plain_job.delay("l", 0.3).id for _ in range(4)]
    free = [tasks.limited3.delay(f"f{i}", 0.3).id for i in range(4)]
    wait_finished(limited + free)
    assert max_overlap(runs(limited)) == 1
    assert max_overlap(runs(free)) >= 2  # not held back by the other queue's limit
    assert not SlotLease.objects.filter(queue_limit__isnull=False, task_id__in=free).exists()
    assert not QueueLimit.objects.filter(queue="fair").exists()


def test_plain_tasks__not_limited_without_the_opt_in(start_worker: Callable[..., Worker]) -> None:
    queue_limits.set_limits("limited", max_jobs=1)
    start_worker("a", concurrency=3, queues="limited")
    ids = [tasks.plain_job.delay("x", 0.4).id for _ in range(3)]
    wait_finished(ids)
    assert max_overlap(runs(ids)) >= 2
    assert QueueLimit.objects.get(queue="limited").deferred_total == 0


def test_tenant_slot_and_queue_limit__both_or_neither(start_worker: Callable[..., Worker]) -> None:
    # fair_limited: 2 per tenant; the queue: 3 in all. Each job takes both or waits.
    queue_limits.set_limits("limited", max_jobs=3)
    start_worker("a", concurrency=3, queues="limited")
    start_worker("b", pool="threads", concurrency=3, queues="limited")
    ids = [tasks.fair_limited.delay(tenant, 0.2).id for tenant in ["g"] * 8 + ["s1", "s2"] * 3]
    half_held = 0
    deadline = time.monotonic() + 90
    while JobRun.objects.filter(task_id__in=ids, finished_at__isnull=False).count() < len(ids):
        assert time.monotonic() < deadline, "jobs did not finish"
        # Every lease of this queue holds both, and the counters match the leases.
        half_held += SlotLease.objects.filter(task_id__in=ids, slot__isnull=True).count()
        half_held += SlotLease.objects.filter(task_id__in=ids, queue_limit__isnull=True).count()
        time.sleep(0.05)
    assert half_held == 0
    assert max_overlap(runs(ids)) == 3
    greedy = JobRun.objects.filter(task_id__in=ids, tenant="g").values_list(
        "started_at", "finished_at"
    )
    assert max_overlap(greedy) <= 2  # type: ignore[arg-type]
    assert_queue_idle()
    assert not TenantQueueSlot.objects.filter(current_jobs__gt=0).exists()


def test_sigkill__node_reaped_within_timeout__then_parked_jobs_run(
    start_worker: Callable[..., Worker], settings: Any
) -> None:
    queue_limits.set_limits("limited", max_jobs=2)
    victim = start_worker("victim", concurrency=2, queues="limited", extra_env=PLAIN)
    for _ in range(2):
        tasks.plain_job.delay("k", 60)
    wait_for(lambda: QueueLimit.objects.get(queue="limited").current_jobs == 2, 20, "2 held")
    # The survivor does not consume the limited queue: it reaps every queue anyway (LF-26).
    survivor = start_worker("survivor", concurrency=2, queues="fair", extra_env=PLAIN)
    waiting = [tasks.plain_job.delay("k", 0.01).id for _ in range(3)]
    victim.kill()
    killed_at = time.monotonic()
    bound = settings.FAIR_JOBS_WORKER_TIMEOUT + settings.FAIR_JOBS_HEARTBEAT_INTERVAL + 2
    wait_for(
        lambda: QueueLimit.objects.get(queue="limited").current_jobs == 0,
        bound + 5,
        "the dead node's places to be reaped",
    )
    assert time.monotonic() - killed_at <= bound
    assert QueueLimit.objects.get(queue="limited").running == {}
    # A new node (new identity) runs what waited; the old node's messages are gone with it.
    start_worker("newcomer", concurrency=2, queues="limited", extra_env=PLAIN)
    wait_finished(waiting, timeout=30)
    assert survivor.proc.poll() is None
    assert not WorkerProcess.objects.filter(pid__in=victim.children).exists()


def test_runtime_change__survives_restart__settings_do_not_overwrite_it(
    start_worker: Callable[..., Worker],
) -> None:
    seeded = {"FAIR_JOBS_QUEUE_LIMITS": '{"limited": 3}', **PLAIN}
    first = start_worker("a", concurrency=3, queues="limited", extra_env=seeded)
    assert QueueLimit.objects.get(queue="limited").max_jobs == 3  # seeded at start-up
    call_command("fair_jobs_limit", "limited", "--max-jobs", "1")
    first.stop()
    start_worker("a2", concurrency=3, queues="limited", extra_env=seeded)
    assert QueueLimit.objects.get(queue="limited").max_jobs == 1  # kept over the settings
    ids = [tasks.plain_job.delay("t", 0.2).id for _ in range(4)]
    wait_finished(ids)
    assert max_overlap(runs(ids)) == 1


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_busy_worker__cpu_bound_job__heartbeat_not_starved_never_over_admitted(
    start_worker: Callable[..., Worker], settings: Any, pool: str
) -> None:
    # limit_fetch #157: a starved heartbeat got a live worker reaped and over-admitted.
    queue_limits.set_limits("limited", max_jobs=1)
    start_worker("busy", pool=pool, concurrency=2, queues="limited", extra_env=PLAIN)
    if pool == "solo":
        # A solo worker cannot start the follower while it spins: a second node consumes
        # the queue, so that admitting the follower beside spin is possible, and refused.
        start_worker("idle", pool="solo", concurrency=1, queues="limited", extra_env=PLAIN)
    spin = tasks.plain_spin.delay("cpu", settings.FAIR_JOBS_WORKER_TIMEOUT * 2)
    spinner = wait_for(
        lambda: JobRun.objects.filter(task_id=spin.id).values_list("pid", flat=True).first(),
        20,
        "spin to start",
    )
    follower = tasks.plain_job.delay("cpu", 0.01)
    stalest = 0.0
    refused = False
    while not JobRun.objects.filter(task_id=spin.id, finished_at__isnull=False).exists():
        # The process that runs spin (a solo or threads worker's main process) beats.
        beats = WorkerProcess.objects.filter(pid=spinner).values_list(
            "last_heartbeat_at", flat=True
        )
        now = database_now()
        stalest = max([stalest, *((now - beat).total_seconds() for beat in beats)])
        from django_fair_jobs.maintenance import run_maintenance

        run_maintenance()  # a reaper is at hand all along
        # Follower first, then spin's finish: spin records its finish before it gives its
        # place back, so a follower that started (or was parked) while spin had not
        # finished overlapped it.
        parked = ParkedJob.objects.filter(task_id=follower.id).exists()
        started = JobRun.objects.filter(task_id=follower.id).exists()
        done = JobRun.objects.filter(task_id=spin.id, finished_at__isnull=False).exists()
        assert not started or done, "over-admitted"
        refused = refused or (parked and not done)
        time.sleep(0.1)
    # The follower was delivered and refused while spin held the place: the check above
    # had something to catch.
    assert refused, "the follower was never refused while spin ran"
    assert stalest < settings.FAIR_JOBS_WORKER_TIMEOUT
    wait_finished([follower.id], timeout=30)
    assert max_overlap(runs([spin.id, follower.id])) == 1


def test_limit_cleared_while_jobs_wait__each_runs_once(
    start_worker: Callable[..., Worker], settings: Any
) -> None:
    queue_limits.set_limits("limited", max_jobs=0)
    start_worker("a", concurrency=2, queues="limited", extra_env=PLAIN)
    ids = [tasks.plain_job.delay("c", 0.01).id for _ in range(2)]
    wait_for(lambda: QueueLimit.objects.get(queue="limited").parked_jobs == 2, 20, "2 parked")
    call_command("fair_jobs_limit", "limited", "--clear")
    wait_finished(ids, timeout=20)
    # Past the timeout a woken row left behind would be woken (and run) again.
    time.sleep(settings.FAIR_JOBS_WORKER_TIMEOUT + 2 * settings.FAIR_JOBS_HEARTBEAT_INTERVAL)
    assert not ParkedJob.objects.exists()
    assert JobRun.objects.filter(task_id__in=ids).count() == 2

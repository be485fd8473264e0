"""Tenant slots under real Celery worker processes, a real broker and the real database."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import pytest
from celery.result import AsyncResult
from django.db import connection
from django.db.models import QuerySet

from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess
from tests.conftest import Worker, wait_for
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]


def max_overlap(runs: Iterable[tuple[datetime, datetime]]) -> int:
    """The largest number of intervals open at once (ends sort before starts at a tie)."""
    events: list[tuple[datetime, int]] = []
    for start, end in runs:
        events += [(start, 1), (end, -1)]
    events.sort(key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def at_the_peak(tenant: str) -> str:
    """The finished runs of ``tenant`` open at once at the peak of their overlap (task id,
    process id, retries, start and end), for the message of a failed overlap assertion: a
    bound broken under faults is then told from the rows, not guessed at."""
    runs = [
        (t, p, n, s, e)
        for t, p, n, s, e in _finished(tenant).values_list(
            "task_id", "pid", "retries", "started_at", "finished_at"
        )
        if e is not None  # filtered to not null: this tells the type checker
    ]
    peak = max_overlap((r[3], r[4]) for r in runs)
    for *_, moment, _end in sorted(runs, key=lambda r: r[3]):
        open_then = [r for r in runs if r[3] <= moment < r[4]]
        if len(open_then) == peak:
            return f"{peak} open at {moment:%H:%M:%S.%f}: " + "; ".join(
                f"{t} pid {p} retries {n} {s:%H:%M:%S.%f}-{e:%H:%M:%S.%f}"
                for t, p, n, s, e in open_then
            )
    return f"peak {peak}"


def _finished(tenant: str) -> QuerySet[JobRun]:
    """The runs of ``tenant`` that finished (its retries' markers left out)."""
    return JobRun.objects.filter(tenant=tenant, finished_at__isnull=False).exclude(
        queue="retry-marker"
    )


def finished_runs(tenant: str) -> list[tuple[datetime, datetime]]:
    return [
        (s, e)  # type: ignore[misc]  # finished_at is filtered to not null
        for s, e in _finished(tenant).values_list("started_at", "finished_at")
    ]


def assert_all_released(tenant: str) -> None:
    """No lease, parked row or slot count is left over."""
    wait_for(
        lambda: (
            not SlotLease.objects.filter(slot__tenant=tenant).exists()
            and not ParkedJob.objects.filter(slot__tenant=tenant).exists()
        ),
        20,
        f"leases and parked jobs of {tenant} to be gone",
    )
    counters = list(
        TenantQueueSlot.objects.filter(tenant=tenant).values_list("current_jobs", "parked_jobs")
    )
    assert counters and all(c == (0, 0) for c in counters), counters


def wait_finished(ids: list[str], timeout: float = 90) -> None:
    wait_for(
        lambda: (
            JobRun.objects.filter(task_id__in=ids, finished_at__isnull=False)
            .exclude(queue="retry-marker")
            .count()
            >= len(ids)
        ),
        timeout,
        f"{len(ids)} jobs to finish",
    )


def test_race__two_nodes_eight_threads__limit_three_never_exceeded(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker("a", pool="threads", concurrency=8)
    start_worker("b", pool="threads", concurrency=8)
    ids = [tasks.limited3.delay("hot", 0.03).id for _ in range(80)]
    wait_finished(ids)
    runs = finished_runs("hot")
    per_task = Counter(JobRun.objects.filter(tenant="hot").values_list("task_id", flat=True))
    assert set(per_task) == set(ids)
    assert max(per_task.values()) == 1, "a job ran twice"
    assert max_overlap(runs) <= 3
    assert_all_released("hot")
    assert TenantQueueSlot.objects.get(tenant="hot").deferred_total > 0


@pytest.mark.skipif(connection.vendor != "postgresql", reason="handoff runs on PostgreSQL only")
@pytest.mark.parametrize("order", ["runs of one tenant", "tenants interleaved"])
def test_race__slot_handoff_on__limit_held_every_job_once_slots_back(
    start_worker: Callable[..., Worker], order: str
) -> None:
    # Processes keep a finished job's slot for their next job (FAIR_JOBS_SLOT_HANDOFF):
    # the limit holds across two nodes, a job of another tenant takes no kept slot (it
    # releases it as it acquires its own; interleaved, nearly every job does, and
    # processes trade slots both ways at once), and every kept slot comes back once no
    # job takes it.
    handoff = {"FAIR_JOBS_SLOT_HANDOFF": "5"}
    start_worker("a", pool="prefork", concurrency=4, extra_env=handoff)
    start_worker("b", pool="threads", concurrency=4, extra_env=handoff)
    if order == "runs of one tenant":
        ids = [tasks.limited3.delay("hot", 0.02).id for _ in range(60)]
        ids += [tasks.limited3.delay(f"cold{i % 3}", 0.02).id for i in range(15)]
    else:
        ids = [tasks.limited3.delay("hot" if i % 2 else f"cold{i % 3}", 0.02).id for i in range(90)]
    wait_finished(ids)
    per_task = Counter(JobRun.objects.values_list("task_id", flat=True))
    assert set(per_task) == set(ids)
    assert max(per_task.values()) == 1, "a job ran twice"
    for tenant in ("hot", "cold0", "cold1", "cold2"):
        assert max_overlap(finished_runs(tenant)) <= 3, tenant
    # Every slot kept after the run comes back within the setting's seconds.
    for tenant in ("hot", "cold0", "cold1", "cold2"):
        assert_all_released(tenant)
    # Kept: a last job, alone and below its limit, leaves its slot held by its process
    # (checked once the run's own kept slots are back: those are held for up to 5 s).
    last = tasks.limited3.delay("last", 0.02).id
    wait_finished([last])
    assert list(SlotLease.objects.values_list("task_id", flat=True)) == [last]
    assert_all_released("last")


def test_race__async_release_on__limit_held_every_job_once_slots_back(
    start_worker: Callable[..., Worker],
) -> None:
    # Releases that commit without waiting for the disk (FAIR_JOBS_ASYNC_RELEASE; on other
    # databases than PostgreSQL the setting changes nothing): the same guarantees.
    release_async = {"FAIR_JOBS_ASYNC_RELEASE": "true"}
    start_worker("a", pool="prefork", concurrency=4, extra_env=release_async)
    start_worker("b", pool="threads", concurrency=4, extra_env=release_async)
    ids = [tasks.limited3.delay("hot", 0.02).id for _ in range(60)]
    wait_finished(ids)
    per_task = Counter(JobRun.objects.values_list("task_id", flat=True))
    assert set(per_task) == set(ids)
    assert max(per_task.values()) == 1, "a job ran twice"
    assert max_overlap(finished_runs("hot")) <= 3
    assert_all_released("hot")
    assert TenantQueueSlot.objects.get(tenant="hot").deferred_total > 0


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_pools__limit_held_and_every_job_runs(
    start_worker: Callable[..., Worker], pool: str
) -> None:
    start_worker("p", pool=pool, concurrency=1 if pool == "solo" else 4)
    ids = [tasks.limited1.delay("t", 0.02).id for _ in range(12)]
    wait_finished(ids)
    assert max_overlap(finished_runs("t")) == 1
    assert all(AsyncResult(i).get(timeout=30) == "t:done" for i in ids)
    assert_all_released("t")


def test_small_tenant__not_stuck_behind_greedy_one(start_worker: Callable[..., Worker]) -> None:
    start_worker("w", pool="threads", concurrency=4)
    greedy = [tasks.limited1.delay("greedy", 0.05).id for _ in range(40)]
    small = tasks.limited1.delay("small", 0.01).id
    wait_finished([small])
    greedy_done = JobRun.objects.filter(task_id__in=greedy, finished_at__isnull=False).count()
    # FIFO would run all 40 greedy jobs first (one at a time: 2 s); fairness lets the small
    # tenant's job through while the greedy tenant is held at one slot.
    assert greedy_done < 40
    wait_finished(greedy)
    assert max_overlap(finished_runs("greedy")) == 1


def test_deferral__does_not_consume_max_retries(start_worker: Callable[..., Worker]) -> None:
    start_worker("w", pool="threads", concurrency=4)
    # Each job holds the tenant's only slot for 0.5 s, far longer than the others take to
    # arrive, so at least the 3 that the worker takes at once beside it are deferred.
    ids = [tasks.limited1.delay("d", 0.5).id for _ in range(6)]  # max_retries=1
    results: list[Any] = [AsyncResult(i).get(timeout=60) for i in ids]
    assert results == ["d:done"] * 6
    assert all(AsyncResult(i).state == "SUCCESS" for i in ids)
    assert set(JobRun.objects.filter(tenant="d").values_list("retries", flat=True)) == {0}
    assert TenantQueueSlot.objects.get(tenant="d").deferred_total >= 3
    assert_all_released("d")


def test_deferral_retry_mode__many_deferrals_still_success(
    start_worker: Callable[..., Worker],
) -> None:
    start_worker("w", pool="threads", concurrency=4)
    ids = [tasks.limited1_retry.delay("r", 0.5).id for _ in range(5)]  # max_retries=0
    assert [AsyncResult(i).get(timeout=60) for i in ids] == ["r:done"] * 5
    assert max_overlap(finished_runs("r")) == 1
    assert TenantQueueSlot.objects.get(tenant="r").deferred_total >= 3
    assert ParkedJob.objects.count() == 0
    assert_all_released("r")


def test_self_retry__releases_slot_and_retry_competes(start_worker: Callable[..., Worker]) -> None:
    start_worker("w", pool="prefork", concurrency=2)
    ids = [tasks.retries_once.delay("x", 0.05).id for _ in range(3)]
    assert [AsyncResult(i).get(timeout=60) for i in ids] == ["x:done"] * 3
    assert set(
        JobRun.objects.filter(tenant="x")
        .exclude(queue="retry-marker")
        .values_list("retries", flat=True)
    ) == {1}
    assert max_overlap(finished_runs("x")) == 1
    assert_all_released("x")


def test_failing_job__gives_its_slot_back(start_worker: Callable[..., Worker]) -> None:
    start_worker("w", pool="prefork", concurrency=2)
    failing: list[AsyncResult[Any]] = [tasks.fails.delay("f") for _ in range(3)]
    for result in failing:
        with pytest.raises(RuntimeError):
            result.get(timeout=60)
    ok = tasks.limited1.delay("f", 0.01)
    assert ok.get(timeout=60) == "f:done"
    assert_all_released("f")


def test_sigkill__slots_reclaimed_within_timeout_and_parked_jobs_run(
    start_worker: Callable[..., Worker], settings: Any
) -> None:
    victim = start_worker("victim", pool="prefork", concurrency=2)
    long_jobs = [tasks.limited3.delay("k", 30).id for _ in range(2)]  # one per child
    wait_for(
        lambda: TenantQueueSlot.objects.filter(tenant="k", current_jobs=2).exists(),
        20,
        "victim to hold 2 slots",
    )
    waiting = [tasks.limited3.delay("k", 0.01).id for _ in range(4)]
    victim.kill()
    killed_at = time.monotonic()
    survivor = start_worker("survivor", pool="prefork", concurrency=2)
    # Slots held by the dead node come back within timeout + one interval (+ start slack).
    bound = settings.FAIR_JOBS_WORKER_TIMEOUT + settings.FAIR_JOBS_HEARTBEAT_INTERVAL + 5
    wait_for(
        lambda: not SlotLease.objects.filter(task_id__in=long_jobs[:2]).exists(),
        bound,
        "dead worker's leases to be reaped",
    )
    assert time.monotonic() - killed_at <= bound
    wait_finished(waiting[:3], timeout=60)
    assert max_overlap(finished_runs("k")) <= 3
    assert survivor.proc.poll() is None
    assert victim.children
    assert not WorkerProcess.objects.filter(pid__in=victim.children).exists()


def test_warm_shutdown__running_job_finishes_and_releases(
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker("w", pool="prefork", concurrency=2)
    job = tasks.limited1.delay("s", 1.0)
    wait_for(lambda: JobRun.objects.filter(task_id=job.id).exists(), 20, "job to start")
    worker.stop()
    assert JobRun.objects.get(task_id=job.id).finished_at is not None
    assert_all_released("s")
    assert WorkerProcess.objects.count() == 0


def test_bad_setting__worker_refuses_to_start(broker_env: dict[str, str]) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "-P", "solo",
         "-Q", "fair", "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=ROOT, env={**broker_env, "FAIR_JOBS_ON_LIMIT": "drop"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "fair_jobs.E002" in proc.stderr
    assert " ready." not in proc.stderr + proc.stdout


def test_explicit_tenant__wins_over_fair_tenant(start_worker: Callable[..., Worker]) -> None:
    start_worker("w", pool="threads", concurrency=2)
    tasks.limited3.apply_async(("acme", 0.01), fair_tenant="t1").get(timeout=30)
    # celery-types only knows Celery's own options; fair_tenant is ours.
    tasks.limited3.s("acme", 0.01).set(fair_tenant="t2").delay().get(timeout=30)  # type: ignore[call-arg]
    tasks.limited3.delay("acme", 0.01).get(timeout=30)
    assert set(TenantQueueSlot.objects.values_list("tenant", flat=True)) == {"t1", "t2", "acme"}


def test_missing_tenant__runs_unthrottled_with_one_warning(
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker("w", pool="threads", concurrency=2)
    results = [tasks.no_tenant.delay(i) for i in range(5)]
    assert [r.get(timeout=30) for r in results] == [0, 2, 4, 6, 8]
    assert worker.output().count("ran without a tenant") == 1
    assert not TenantQueueSlot.objects.exists()


def test_send_task_by_name__tenant_resolved_in_worker(
    start_worker: Callable[..., Worker], celery_app: Any
) -> None:
    start_worker("w", pool="threads", concurrency=2)
    result = celery_app.send_task(tasks.limited3.name, ("byname", 0.01), queue="fair")
    assert result.get(timeout=30) == "byname:done"
    assert TenantQueueSlot.objects.filter(tenant="byname").exists()


def test_stale_holder__reaped_while_frozen__late_release_frees_nothing(
    start_worker: Callable[..., Worker],
) -> None:
    import os
    import signal

    frozen = start_worker("frozen", pool="prefork", concurrency=1)
    stale = tasks.limited1.delay("st", 6.0).id
    wait_for(lambda: JobRun.objects.filter(task_id=stale).exists(), 20, "job 1 to start")
    (child,) = frozen.child_pids()
    os.kill(child, signal.SIGSTOP)  # its heartbeat thread stops with it
    try:
        start_worker("healthy", pool="prefork", concurrency=2)
        successor = tasks.limited1.delay("st", 4.0).id
        # The frozen holder is reaped and the parked successor is woken and started.
        wait_for(
            lambda: JobRun.objects.filter(task_id=successor).exists(),
            30,
            "the successor to start after the frozen holder was reaped",
        )
    finally:
        os.kill(child, signal.SIGCONT)
    wait_finished([stale], timeout=30)  # the stale job ends and releases late: fenced
    third = tasks.limited1.delay("st", 0.01).id
    wait_finished([successor, third], timeout=30)
    runs = {r.task_id: r for r in JobRun.objects.filter(tenant="st")}
    # Had the stale release freed a slot, the third job would have started beside the
    # successor; it must wait for the successor to finish.
    successor_end = runs[successor].finished_at
    assert successor_end is not None
    assert runs[third].started_at >= successor_end
    assert "was reaped while alive; re-registering" in frozen.output()
    assert_all_released("st")


def test_stale_copy_of_woken_job__dropped_not_run(
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker("w", pool="threads", concurrency=2)
    # A copy of a wake-up whose job already started: no parked row carries wake 1.
    stale = tasks.limited1.apply_async(("sc", 0.01), fair_wake=1)
    fresh = tasks.limited1.delay("sc", 0.01)
    assert fresh.get(timeout=30) == "sc:done"
    wait_for(
        lambda: "stale copy of a woken job dropped" in worker.output(),
        20,
        "the stale copy to be dropped",
    )
    assert not JobRun.objects.filter(task_id=stale.id).exists()
    assert stale.state == "PENDING"


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_live_worker__cpu_bound_job_longer_than_timeout__keeps_its_lease(
    start_worker: Callable[..., Worker], settings: Any, pool: str
) -> None:
    start_worker("w", pool=pool, concurrency=2)
    slow = tasks.spin.delay("cpu", settings.FAIR_JOBS_WORKER_TIMEOUT * 2)
    follower = tasks.spin.delay("cpu", 0.01)
    # Wait until the slow job runs (it may first be parked behind the follower and woken:
    # a woken job's reservation changes token when the job claims it).
    wait_for(lambda: JobRun.objects.filter(task_id=slow.id).exists(), 20, "slow to start")
    lease = SlotLease.objects.get(task_id=slow.id)
    assert lease.process_id is not None
    while not slow.ready():
        # Meanwhile maintenance runs (in the worker, and here): a live holder is never reaped.
        from django_fair_jobs.maintenance import run_maintenance

        run_maintenance()
        # Lease first, then the finish record: the job records its finish before it
        # releases, so "lease gone, job not finished" can only mean it was reaped.
        held = SlotLease.objects.filter(pk=lease.pk, token=lease.token).exists()
        finished = JobRun.objects.filter(task_id=slow.id, finished_at__isnull=False).exists()
        assert held or finished, "a live worker's lease was reaped"
        time.sleep(0.5)
    assert follower.get(timeout=30) == "cpu:done"
    assert max_overlap(finished_runs("cpu")) == 1
    assert_all_released("cpu")


def test_soft_time_limit__releases_slot(start_worker: Callable[..., Worker]) -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    start_worker("w", pool="prefork", concurrency=2)
    over = tasks.overruns.delay("soft")
    with pytest.raises(SoftTimeLimitExceeded):
        over.get(timeout=30)
    assert tasks.limited1.delay("soft", 0.01).get(timeout=30) == "soft:done"
    assert_all_released("soft")


def test_revoke__parked_job__drops_its_row_and_frees_the_slot(
    start_worker: Callable[..., Worker], celery_app: Any
) -> None:
    start_worker("w", pool="prefork", concurrency=2)
    holder = tasks.limited1.delay("rv", 1.5)
    wait_for(lambda: JobRun.objects.filter(task_id=holder.id).exists(), 20, "holder to start")
    parked = tasks.limited1.delay("rv", 0.01)
    wait_for(lambda: ParkedJob.objects.filter(task_id=parked.id).exists(), 20, "park")
    parked.revoke()
    assert holder.get(timeout=30) == "rv:done"
    # Woken, then refused as revoked: its reservation must not hold the slot until reaped.
    wait_for(
        lambda: not ParkedJob.objects.filter(task_id=parked.id).exists(),
        10,
        "the revoked job's parked row to go",
    )
    assert tasks.limited1.delay("rv", 0.01).get(timeout=10) == "rv:done"
    assert not JobRun.objects.filter(task_id=parked.id).exists()
    assert_all_released("rv")


def test_revoke_terminate__running_job__slot_back_before_timeout(
    start_worker: Callable[..., Worker], settings: Any
) -> None:
    start_worker("w", pool="prefork", concurrency=2)
    victim = tasks.limited1.delay("rt", 30)
    wait_for(lambda: JobRun.objects.filter(task_id=victim.id).exists(), 20, "victim to start")
    victim.revoke(terminate=True)
    started = time.monotonic()
    wait_for(
        lambda: not SlotLease.objects.filter(task_id=victim.id).exists(),
        settings.FAIR_JOBS_WORKER_TIMEOUT + settings.FAIR_JOBS_HEARTBEAT_INTERVAL + 5,
        "the terminated job's lease to go",
    )
    assert time.monotonic() - started < settings.FAIR_JOBS_WORKER_TIMEOUT
    assert tasks.limited1.delay("rt", 0.01).get(timeout=30) == "rt:done"


def test_database_unreachable__job_postponed_through_broker_not_lost(
    start_worker: Callable[..., Worker],
) -> None:
    cut_off = start_worker(
        "cutoff", pool="threads", concurrency=2,
        extra_env={"DATABASE_URL": "postgres://postgres@127.0.0.1:1/unreachable"},
    )  # fmt: skip
    job = tasks.limited1_retry.delay("db", 0.01)  # fair_retry_countdown=0.2
    wait_for(
        lambda: "database unavailable" in cut_off.output(),
        30,
        "the cut-off worker to postpone the job",
    )
    assert "raised unexpected" not in cut_off.output()
    cut_off.stop()  # its countdown copy goes back to the broker unacknowledged
    start_worker("healthy", pool="threads", concurrency=2)
    assert job.get(timeout=60) == "db:done"
    assert JobRun.objects.filter(task_id=job.id).count() == 1
    assert_all_released("db")

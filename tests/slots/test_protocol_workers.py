"""Protocol defects that need real worker processes and a real fault to show: the job
runs in a ``celery worker`` started by the test, against the real database and broker."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings as django_settings

from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess
from tests.conftest import Worker, wait_for
from tests.faults import SilentProxy
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]


@pytest.fixture
def broker_proxy() -> Iterator[SilentProxy]:
    """A proxy in front of the test broker that a test can silence."""
    proxy = SilentProxy(django_settings.CELERY_BROKER_URL)
    yield proxy
    proxy.close()


def test_broker_stops_answering_during_maintenance__heartbeat_goes_on__no_lease_reaped(
    broker_proxy: SilentProxy, start_worker: Callable[..., Worker], settings: Any
) -> None:
    # broker_proxy comes first, so that it is torn down last: a worker whose broker
    # vanished before it stopped would wait out its whole shutdown timeout.
    # The worker's maintenance pass publishes the wake-ups it finds. With the broker silent,
    # each publish blocks; when the pass ran on the heartbeat's thread, the process stopped
    # beating, another process reaped it while its job still ran, and the job's slot went
    # to another job (the tenant's limit exceeded).
    timeout = settings.FAIR_JOBS_WORKER_TIMEOUT
    start_worker(
        "w", pool="threads", concurrency=3, extra_env={"CELERY_BROKER_URL": broker_proxy.url}
    )
    running = tasks.limited1.delay("hb", timeout * 4).id
    holder = tasks.limited1.delay("wk", timeout * 4).id
    wait_for(
        lambda: JobRun.objects.filter(task_id__in=[running, holder]).count() == 2,
        30,
        "two jobs to run",
    )
    # Published only now: sent with the others, it could start before the holder, run at
    # once and leave nothing parked.
    waiting = tasks.limited1.delay("wk", 0.01).id
    wait_for(lambda: ParkedJob.objects.filter(task_id=waiting).exists(), 30, "a job to park")
    lease = SlotLease.objects.get(task_id=running)
    assert lease.process_id is not None
    broker_proxy.go_silent()
    # A limit raised without its wake-up (as a crashed admin request leaves it): the next
    # maintenance pass finds the waiting job a place and publishes its wake-up.
    TenantQueueSlot.objects.filter(tenant="wk").update(max_jobs=2)
    deadline = time.monotonic() + timeout * 2.5
    try:
        while time.monotonic() < deadline:
            # What any other process's maintenance does: reap processes silent too long.
            lease_store.reap(timeout=timeout)
            assert SlotLease.objects.filter(pk=lease.pk, token=lease.token).exists(), (
                "the live worker was reaped: its heartbeat waited on the broker"
            )
            time.sleep(0.3)
        assert WorkerProcess.objects.filter(id=lease.process_id).exists()
    finally:
        broker_proxy.answer()
    wait_for(
        lambda: (
            JobRun.objects.filter(
                task_id__in=[running, holder, waiting], finished_at__isnull=False
            ).count()
            == 3
        ),
        60,
        "every job to finish once the broker answers",
    )
    assert JobRun.objects.filter(task_id__in=[running, holder, waiting]).count() == 3
    # A job records its end in its own body and gives its lease back just after: wait for
    # that, never for a lease left behind (the wait fails then).
    wait_for(lambda: not SlotLease.objects.exists(), 30, "every lease to be given back")


def test_revoke_terminate_with_a_signal_the_job_survives__lease_kept__limit_holds(
    start_worker: Callable[..., Worker],
) -> None:
    # revoke(terminate=True) used to drop the job's lease as soon as the revoke was
    # announced; with a signal the job survives (SIGUSR1 raises SoftTimeLimitExceeded,
    # which tasks catch to clean up) the job ran on without a lease, and the next job of
    # its tenant started beside it: a limit of 1 exceeded.
    worker = start_worker("w", pool="prefork", concurrency=2)
    survivor = tasks.shrugs_off_soft_limit.delay("tt", 3.0)
    wait_for(lambda: JobRun.objects.filter(task_id=survivor.id).exists(), 20, "it to start")
    survivor.revoke(terminate=True, signal="SIGUSR1")
    time.sleep(0.5)  # the revoke reaches the worker
    assert SlotLease.objects.filter(task_id=survivor.id).exists(), worker.output()
    follower = tasks.limited1.delay("tt", 0.01)
    assert follower.get(timeout=30) == "tt:done"
    runs = {r.task_id: r for r in JobRun.objects.filter(tenant="tt")}
    survivor_end = runs[survivor.id].finished_at
    assert survivor_end is not None, "the survivor was stopped after all"
    assert runs[follower.id].started_at >= survivor_end, "the follower ran beside it"
    assert not SlotLease.objects.exists()

"""What maintenance and a worker's start do for fair dispatch (D8, D15, D16, D20 and D21 of
the dispatch review): registration tried again until the database answers, the
lost-message repair bounded, the reap as Celery would redeliver, Celery's clocks, and
counts recounted with their drift logged."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError
from django.utils import timezone
from kombu.utils.json import loads

from django_fair_jobs import db, dispatch, identity
from django_fair_jobs.dispatch.models import DISPATCHED, WAITING, DispatchJob, DispatchTenant
from django_fair_jobs.maintenance import passes, threads
from django_fair_jobs.models import WorkerProcess
from tests.conftest import wait_for
from tests.dispatch.conftest import job_of, set_capacity
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("engine", "collected"),
]


def test_d8__workers_started_before_the_database__register_once_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tries: list[int] = []

    def down_twice(node: str | None = None) -> uuid.UUID:
        tries.append(1)
        if len(tries) < 3:
            raise OperationalError("connection refused")
        return uuid.uuid4()

    monkeypatch.setattr(identity, "current_process_id", down_twice)
    monkeypatch.setattr(identity, "registered_process_id", lambda: None)
    monkeypatch.setattr(passes, "dispatch_into_new_capacity", lambda: 0)
    monkeypatch.setattr(threads, "REGISTER_RETRY_FIRST", 0.01)
    threads.start_process()
    wait_for(lambda: len(tries) >= 3, 10, "registration to be tried until it works")
    assert len(tries) == 3  # and not after it worked


def stale_dispatched(seconds: float) -> DispatchJob:
    """A job dispatched ``seconds`` ago and not started."""
    job = job_of(tasks.dispatched.delay("acme").id)
    assert job.state == DISPATCHED
    DispatchJob.objects.filter(pk=job.pk).update(
        dispatched_at=timezone.now() - timedelta(seconds=seconds)
    )
    return job


def test_d15__lost_message_repair__backs_off_with_each_copy() -> None:
    from django_fair_jobs.dispatch import _store

    set_capacity(1)
    job = stale_dispatched(1.5)
    assert [r.job_id for r in _store().lost(1.0)] == [job.pk]
    DispatchJob.objects.filter(pk=job.pk).update(
        dispatched_at=timezone.now() - timedelta(seconds=1.5)
    )
    assert _store().lost(1.0) == []  # the second copy waits twice as long
    DispatchJob.objects.filter(pk=job.pk).update(
        dispatched_at=timezone.now() - timedelta(seconds=2.5)
    )
    assert [r.job_id for r in _store().lost(1.0)] == [job.pk]


def test_d15__lost_message_repair__not_while_no_worker_consumes_the_queue() -> None:
    from django_fair_jobs.dispatch import _store

    set_capacity(1)
    stale_dispatched(10)
    set_capacity(0)  # every worker of the queue is gone
    assert _store().lost(1.0) == []


def test_d15__a_maintenance_pass_publishes_a_lost_message_again(
    settings: Any, collected: list[int]
) -> None:
    # The lost-message repair is the pass's: a job dispatched and never started (its
    # message purged, its publisher dead) is published again by it while a live worker
    # consumes its queue.
    from django_fair_jobs.maintenance import run_maintenance

    settings.FAIR_JOBS_DISPATCH_LOST_AFTER = 1.0
    identity.register_process(
        process_id=uuid.uuid4(), node="n@h", hostname="h", pid=1, queues=["fair"]
    )
    set_capacity(1)
    job = stale_dispatched(1.5)
    collected.clear()
    report = run_maintenance(timeout=60.0)
    assert report.dispatch_republished == 1
    assert collected == [job.pk]


def running_under(task: Any, node_alive: bool) -> DispatchJob:
    """A job of ``task`` running under a process that stopped beating; another process of
    the same node still beats if ``node_alive``."""
    set_capacity(1)
    job = job_of(task.delay("acme").id)
    node, dead = uuid.uuid4(), uuid.uuid4()
    for pid in (dead, uuid.uuid4()) if node_alive else (dead,):
        identity.register_process(process_id=pid, node="n@h", hostname="h", pid=1, node_id=node)
    WorkerProcess.objects.filter(pk=dead).update(
        last_heartbeat_at=db.database_now() - timedelta(seconds=600)
    )
    assert dispatch.start(job.pk, dead).status == "started"
    return job


@pytest.mark.parametrize(
    ("task", "node_alive", "back"),
    [
        (tasks.dispatched_early, False, False),  # Celery acknowledged it at start
        (tasks.dispatched_late, True, False),  # a lost pool child: acknowledged, FAILURE
        (tasks.dispatched_late, False, True),  # the node is gone: the broker redelivers
    ],
)
def test_d16__the_reap_does_what_celery_would(task: Any, node_alive: bool, back: bool) -> None:
    from django_fair_jobs.dispatch import _store

    job = running_under(task, node_alive)
    assert _store().reap(60.0) == ((1, 0) if back else (0, 1))
    assert DispatchJob.objects.filter(pk=job.pk).exists() is back


@pytest.mark.parametrize("leases_reaped_first", [False, True])
@pytest.mark.parametrize(
    ("node_alive", "back"),
    [
        (True, False),  # a lost pool child: acknowledged, FAILURE
        (False, True),  # the node is gone: the broker redelivers
    ],
)
def test_d16__in_a_maintenance_pass__the_reap_still_does_what_celery_would(
    node_alive: bool, back: bool, leases_reaped_first: bool
) -> None:
    # The pass also reaps the leases of dead processes, which deletes their rows, the only
    # record of their nodes: without it a lost pool child's acks_late job would go back to
    # its line and run again after Celery failed it. A process that crosses the timeout
    # between the pass's two reaps (or a reap run by hand beside the pass) is dead to the
    # lease reap first (leases_reaped_first): its row stays while it has a running job.
    from django_fair_jobs.leases import store as lease_store
    from django_fair_jobs.maintenance import run_maintenance

    job = running_under(tasks.dispatched_late, node_alive)
    dead = DispatchJob.objects.get(pk=job.pk).process_id
    if leases_reaped_first:
        lease_store.reap(timeout=60.0)
    report = run_maintenance(timeout=60.0)
    assert (report.dispatch_requeued, report.dispatch_dropped) == ((1, 0) if back else (0, 1))
    assert DispatchJob.objects.filter(pk=job.pk).exists() is back
    run_maintenance(timeout=60.0)  # its jobs reaped, the dead row goes
    assert dead is not None and not WorkerProcess.objects.filter(pk=dead).exists()


def test_d20__a_numeric_expires__counts_from_delay() -> None:
    set_capacity(0)
    job = job_of(tasks.dispatched.apply_async(("acme",), expires=60).id)
    expires = loads(job.message)["headers"]["expires"]
    assert isinstance(expires, str)
    at = datetime.fromisoformat(expires)
    assert timezone.now() + timedelta(seconds=50) < at < timezone.now() + timedelta(seconds=61)


def test_d20__a_countdown__by_the_databases_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    set_capacity(0)
    skewed = timezone.now() + timedelta(minutes=5)  # the publisher's clock is 5 min fast
    monkeypatch.setattr(timezone, "now", lambda: skewed)
    job = job_of(tasks.dispatched.apply_async(("acme",), countdown=10).id)
    assert job.not_before is not None
    due = job.not_before - db.database_now()
    assert timedelta(seconds=5) < due < timedelta(seconds=11), due


def test_d21__counts_that_drifted__recounted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    set_capacity(0)
    for _ in range(3):
        tasks.dispatched.delay("acme")
    DispatchTenant.objects.filter(tenant="acme").update(waiting=7, in_flight=2)
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs.dispatch"):
        assert dispatch.recount() == 1
    line = DispatchTenant.objects.get(tenant="acme")
    assert (line.waiting, line.in_flight) == (3, 0)
    assert "counted 7 waiting and 2 in flight" in caplog.text
    assert dispatch.recount() == 0


def test_d21__a_maintenance_pass_recounts_the_lines() -> None:
    # The recount is maintenance's: a pass that left it out would leave a drifted count
    # (a line that looks full, or empty) until someone called it by hand.
    from django_fair_jobs.maintenance import run_maintenance

    set_capacity(0)
    for _ in range(3):
        tasks.dispatched.delay("acme")
    DispatchTenant.objects.filter(tenant="acme").update(waiting=7, in_flight=2)
    run_maintenance(timeout=60.0)
    assert dispatch.recount() == 0  # nothing drifted left
    line = DispatchTenant.objects.get(tenant="acme")
    assert line.waiting + line.in_flight == 3


def test_d21__a_head_that_drifted__set_from_the_jobs_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A line is chosen by its head (its oldest waiting job): one whose head was lost while
    # its jobs wait would never be chosen. Maintenance sets it from the job rows, as it
    # does the counts, and logs it.
    set_capacity(0)
    ids = [tasks.dispatched.delay("acme").id for _ in range(3)]
    first = job_of(ids[0])
    DispatchTenant.objects.filter(tenant="acme").update(head_id=None)
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs.dispatch"):
        assert dispatch.recount() == 1
    line = DispatchTenant.objects.get(tenant="acme")
    assert (line.waiting, line.in_flight, line.head_id) == (3, 0, first.pk)
    assert "had lost its head" in caplog.text
    assert dispatch.recount() == 0
    set_capacity(1)
    assert [r.job_id for r in dispatch.dispatch("fair")] == [first.pk]


def test_reap_command__its_timeout_reaches_fair_dispatch__the_report_says_what_it_did(
    settings: Any,
) -> None:
    # The process silent for 5 s is dead by --timeout 2, not by the setting's 60 s; the
    # report used to leave fair dispatch's part of the pass out.
    from io import StringIO

    from django.core.management import call_command

    settings.FAIR_JOBS_WORKER_TIMEOUT = 60.0
    job = running_under(tasks.dispatched_late, node_alive=False)
    WorkerProcess.objects.filter(last_heartbeat_at__lt=db.database_now()).update(
        last_heartbeat_at=db.database_now() - timedelta(seconds=5)
    )
    out = StringIO()
    call_command("fair_jobs_reap", "--timeout", "2", stdout=out)
    assert DispatchJob.objects.get(pk=job.pk).state == WAITING  # back in its line
    assert "fair dispatch: put 1 job(s) of dead workers back in line" in out.getvalue()

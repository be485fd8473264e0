"""Every failure path of a dispatched job, as for tenant slots (D4, D5, D6, D9, D13, D17,
D18 and D19 of the dispatch review): no job is lost, no room or slot leaks, and nothing
loops, whatever fails where."""

from __future__ import annotations

import socket
import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery.exceptions import Reject, Retry
from django.conf import settings
from django.db import OperationalError, transaction

from django_fair_jobs import admission, dispatch, explanations, identity, signals, status
from django_fair_jobs.dispatch.models import (
    DISPATCHED,
    FAILED,
    RUNNING,
    SCHEDULED,
    WAITING,
    DispatchJob,
)
from django_fair_jobs.maintenance import threads
from django_fair_jobs.models import TenantQueueSlot, WorkerProcess
from tests.dispatch.conftest import deliver, job_of, set_capacity
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("engine", "in_process_worker", "collected"),
]


def test_d4__retry_inside_the_jobs_atomic__the_retry_is_kept() -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched_retry_in_atomic.delay("acme").id)
    with pytest.raises(Retry):
        deliver(job, tasks.dispatched_retry_in_atomic)
    assert not JobRun.objects.exists()  # the job's transaction rolled back...
    (retry,) = DispatchJob.objects.filter(task_id=job.task_id)  # ...its retry did not
    assert retry.state == SCHEDULED and retry.pk != job.pk


def test_d5__the_start_commits_and_its_reply_is_lost__the_job_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    real, cut = dispatch.start, list[int]()

    def start_then_cut(job_id: int, process: uuid.UUID, **kwargs: Any) -> dispatch.Started:
        started = real(job_id, process, **kwargs)
        if not cut:
            cut.append(job_id)
            raise OperationalError("server closed the connection unexpectedly")
        return started

    monkeypatch.setattr(dispatch, "start", start_then_cut)
    monkeypatch.setattr(admission, "REPLY_RETRY_DELAYS", (0.0, 0.0))
    assert deliver(job) == "ran"
    assert JobRun.objects.filter(task_id=job.task_id).count() == 1
    assert not DispatchJob.objects.filter(pk=job.pk).exists()  # ended: no room held


def test_d5__a_second_copy_delivered_to_the_process_running_it__not_run_again() -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    process = identity.current_process_id()
    assert dispatch.start(job.pk, process).status == "started"
    admission.ends.mark_running(job.task_id)  # the first copy runs here now
    try:
        assert deliver(job) == "not run"
    finally:
        admission.ends.unmark_running(job.task_id)
    assert DispatchJob.objects.get(pk=job.pk).state == RUNNING


def test_d6__broker_down__one_delay_makes_one_publish_attempt(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    monkeypatch.undo()  # the real publish, against a broker that refuses every message
    attempts: list[str] = []

    def refuse(self: Any, body: Any, **kwargs: Any) -> None:
        attempts.append(body[0][0])
        raise OperationalError("[Errno 111] Connection refused")

    monkeypatch.setattr("kombu.messaging.Producer.publish", refuse)
    set_capacity(0)
    for i in range(30):
        tasks.dispatched.delay(f"t{i}")
    set_capacity(31)
    tasks.dispatched.delay("late")  # dispatches 31 jobs, and the broker is down
    assert len(attempts) == 1
    assert DispatchJob.objects.count() == 31  # nothing lost
    assert DispatchJob.objects.filter(publish_failures=1).count() == 1


def test_d9__the_fence_fails__the_job_goes_back__no_slot_leaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched_capped.delay("acme").id)
    real = admission.acquire

    def acquire_then_cut(**kwargs: Any) -> Any:
        real(**kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(admission, "acquire", acquire_then_cut)
    assert deliver(job, tasks.dispatched_capped) == "not run"
    assert DispatchJob.objects.get(pk=job.pk).state in (WAITING, DISPATCHED)
    admission.retry_pending_releases()  # the heartbeat gives back what the acquire took
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 0


def test_d13__reject_requeue__the_row_waits_for_the_redelivered_copy() -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched_rejecting.delay("acme").id)
    with pytest.raises(Reject):
        deliver(job, tasks.dispatched_rejecting)
    assert DispatchJob.objects.filter(task_id=job.task_id).exists()
    again = DispatchJob.objects.get(task_id=job.task_id)
    assert deliver(again, tasks.dispatched_rejecting, redelivered=True) == "ran"
    assert not DispatchJob.objects.filter(task_id=job.task_id).exists()


def test_d17__an_end_that_failed__done_at_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    real = dispatch.end
    monkeypatch.setattr(
        dispatch, "end", lambda *a, **k: (_ for _ in ()).throw(OperationalError("down"))
    )
    assert deliver(job) == "ran"
    assert DispatchJob.objects.get(pk=job.pk).state == RUNNING  # its end is kept
    monkeypatch.setattr(dispatch, "end", real)
    process = identity.current_process_id()
    ident = identity.Identity(process_id=process, node="bad@host", pid=0)
    monkeypatch.setattr(identity, "current", lambda: ident)
    threads.shutdown()
    assert not DispatchJob.objects.filter(pk=job.pk).exists()


def test_d18__a_terminated_job_without_a_slot__its_pool_process_is_found() -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    child = uuid.uuid4()
    identity.register_process(process_id=child, node="n@h", hostname=socket.gethostname(), pid=4242)
    assert dispatch.start(job.pk, child).status == "started"
    # revoke(terminate=True) drops its row only once this process is gone.
    assert signals._pool_pids_running(job.task_id) == [4242]
    assert WorkerProcess.objects.filter(pk=child).exists()


def test_d19__a_job_no_broker_takes__ends_failed__explain_says_so(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    from django.utils import timezone

    monkeypatch.undo()

    def refuse(self: Any, body: Any, **kwargs: Any) -> None:
        raise ValueError("the serializer refuses it")

    monkeypatch.setattr("kombu.messaging.Producer.publish", refuse)
    set_capacity(1)
    task_id = tasks.dispatched.delay("poison").id
    for _ in range(10):
        DispatchJob.objects.filter(task_id=task_id, state=SCHEDULED).update(
            not_before=timezone.now() - timedelta(seconds=1)
        )
        dispatch.publish(celery_app, dispatch.dispatch("fair"))
    row = DispatchJob.objects.get(task_id=task_id)
    assert (row.state, row.publish_failures, row.failure) == (FAILED, 5, "publish")
    explained = explanations.explain(task_id)
    assert explained.state == "failed" and "could not be published" in explained.summary
    assert dispatch.in_flight() == {}  # it holds no room
    assert "1 FAILED (see the admin)" in status.as_text(status.snapshot())
    # Once its cause is removed, the operator puts it back in line (the admin's action).
    monkeypatch.setattr("kombu.messaging.Producer.publish", lambda self, *a, **k: None)
    assert dispatch.put_back_failed(celery_app, [row.pk]) == 1
    assert DispatchJob.objects.get(pk=row.pk).state == DISPATCHED


def test_d19__set_aside_by_an_outage__then_refused_as_unregistered__explain_names_the_task(
    celery_app: Any,
) -> None:
    # explain told the two causes of a failed job apart by its count of failed publishes:
    # a job an outage had set aside PUBLISH_ATTEMPTS times or more (it never fails for an
    # outage, test_d6), then rejected by a worker that had no such task, was explained as
    # a message the broker refused, and the operator looked for the wrong cause.
    from django_fair_jobs.dispatch.store import PUBLISH_ATTEMPTS

    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    DispatchJob.objects.filter(pk=job.pk).update(publish_failures=PUBLISH_ATTEMPTS + 2)
    dispatch.unregistered(celery_app, job.pk, tasks.dispatched.name)
    summary = explanations.explain(job.task_id).summary
    assert "no task of that name" in summary and "could not be published" not in summary
    row = DispatchJob.objects.get(pk=job.pk)
    # Its rejection is not a failed publish: the count stays what the outage left.
    assert (row.state, row.publish_failures) == (FAILED, PUBLISH_ATTEMPTS + 2)
    assert row.failure == "unregistered"
    # Put back in line, it starts afresh: no failure, no count of failed publishes.
    assert dispatch.put_back_failed(celery_app, [row.pk]) == 1
    row = DispatchJob.objects.get(pk=row.pk)
    assert (row.failure, row.publish_failures) == ("", 0)


def test_unregistered__the_room_it_leaves_goes_to_the_next_job_at_once(
    celery_app: Any, collected: list[int]
) -> None:
    # A job a worker rejects (no such task there) ends failed, and its room is dispatched
    # then, not left until the due poll or the lost-message repair finds it.
    set_capacity(1)
    first = job_of(tasks.dispatched.delay("acme").id)
    second = job_of(tasks.dispatched.delay("beta").id)
    assert DispatchJob.objects.get(pk=second.pk).state == WAITING  # behind the room
    collected.clear()
    dispatch.unregistered(celery_app, first.pk, tasks.dispatched.name)
    assert DispatchJob.objects.get(pk=first.pk).state == FAILED
    assert collected == [second.pk]
    assert DispatchJob.objects.get(pk=second.pk).state == DISPATCHED


@pytest.mark.parametrize("terminated", [False, True])
def test_revoked__its_row_goes__the_room_it_leaves_goes_to_the_next_job_at_once(
    celery_app: Any, collected: list[int], terminated: bool
) -> None:
    # A revoked job's message dropped by a worker (or its running job terminated, its
    # process gone) leaves room: the next job in line is dispatched then, not left until
    # the due poll or the maintenance pass finds the room.
    set_capacity(1)
    first = job_of(tasks.dispatched.delay("acme").id)
    second = job_of(tasks.dispatched.delay("beta").id)
    if terminated:
        assert dispatch.start(first.pk, identity.current_process_id()).status == "started"
    collected.clear()
    dispatch.drop(celery_app, first.task_id, terminated=terminated)
    assert not DispatchJob.objects.filter(pk=first.pk).exists()
    assert collected == [second.pk]


def test_put_back_failed__a_job_that_has_not_failed_is_left_as_it_is(celery_app: Any) -> None:
    # The admin's action, or a script, may name a job that a worker runs or that is on its
    # way to one: only a failed job goes back in line (else it would run twice, and its
    # line's counts would drift).
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    assert DispatchJob.objects.get(pk=job.pk).state == DISPATCHED
    assert dispatch.put_back_failed(celery_app, [job.pk]) == 0
    assert DispatchJob.objects.get(pk=job.pk).state == DISPATCHED


def test_failed_job_put_back_inside_atomic__dispatched_as_the_caller_commits(
    celery_app: Any, collected: list[int]
) -> None:
    # The admin's action runs inside the request's transaction under ATOMIC_REQUESTS. The
    # put-back dispatched inside it, where the job was not due yet (due from the update's
    # own time, after the transaction's start), so it waited for the due poll; and a
    # dispatch there would publish before the put-back commits, or though it rolls back.
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    dispatch.unregistered(celery_app, job.pk, tasks.dispatched.name)
    collected.clear()
    with transaction.atomic():
        assert dispatch.put_back_failed(celery_app, [job.pk]) == 1
        assert collected == []  # nothing published before the commit
    assert collected == [job.pk]
    assert DispatchJob.objects.get(pk=job.pk).state == DISPATCHED
    # Rolled back, it is not put back and nothing is published.
    dispatch.unregistered(celery_app, job.pk, tasks.dispatched.name)
    collected.clear()
    with transaction.atomic():
        dispatch.put_back_failed(celery_app, [job.pk])
        transaction.set_rollback(True)  # the request failed
    assert collected == []
    assert DispatchJob.objects.get(pk=job.pk).state == FAILED


def test_d6__a_broker_outage_past_the_tries__the_job_waits_it_out__never_fails(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    # A broker that cannot be reached is not the job's fault: through an outage longer
    # than PUBLISH_ATTEMPTS tries, the job goes aside again and again (its wait doubling
    # up to a minute) and is published once the broker answers. It ended failed at the
    # fifth try, for an operator to put back by hand.
    from celery import Celery
    from django.utils import timezone

    from django_fair_jobs.dispatch.store import MAX_BACKOFF, PUBLISH_ATTEMPTS

    monkeypatch.undo()  # the real publish
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/0")  # Celery reads it first
    down = Celery("down", set_as_current=False)  # nothing listens on port 1
    down.conf.task_publish_retry_policy = {"max_retries": 1, "interval_start": 0}
    set_capacity(0)
    task_id = tasks.dispatched.delay("acme").id
    set_capacity(1)
    for _ in range(PUBLISH_ATTEMPTS + 2):
        DispatchJob.objects.filter(task_id=task_id, state__in=(SCHEDULED, WAITING)).update(
            state=SCHEDULED, not_before=timezone.now() - timedelta(seconds=1)
        )
        assert dispatch.publish(down, dispatch.dispatch("fair")) == 0
    row = DispatchJob.objects.get(task_id=task_id)
    assert row.state == SCHEDULED and row.publish_failures == PUBLISH_ATTEMPTS + 2
    assert row.not_before is not None
    # Its wait doubles up to MAX_BACKOFF, never past it (2 ** 7 s would be two minutes).
    assert row.not_before > timezone.now() + timedelta(seconds=MAX_BACKOFF - 5)
    assert row.not_before < timezone.now() + timedelta(seconds=MAX_BACKOFF + 5)
    assert dispatch.in_flight() == {}  # aside, it holds no room
    # The broker answers: the job is published, once.
    sent: list[str] = []
    monkeypatch.setattr(
        "kombu.messaging.Producer.publish", lambda self, body, **k: sent.append(body[0][0])
    )
    DispatchJob.objects.filter(pk=row.pk).update(not_before=timezone.now() - timedelta(seconds=1))
    assert dispatch.publish(celery_app, dispatch.dispatch("fair")) == 1
    assert DispatchJob.objects.get(pk=row.pk).state == DISPATCHED and len(sent) == 1


@pytest.mark.skipif(
    not settings.CELERY_BROKER_URL.startswith("redis://"), reason="a Redis error reply"
)
def test_d19__a_broker_that_answers_and_refuses_the_message__the_job_ends_failed(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    # Redis answers, and refuses the push: the queue's key holds a string. kombu's retry
    # wraps the error reply in the same OperationalError as a lost connection; taken for
    # an outage, the job went aside every minute, for ever, and never showed as failed.
    import redis
    from django.utils import timezone

    from django_fair_jobs.dispatch.store import PUBLISH_ATTEMPTS

    monkeypatch.undo()  # the real publish, to the real broker
    client = redis.Redis.from_url(celery_app.conf.broker_url)
    set_capacity(0)
    task_id = tasks.dispatched.delay("acme").id
    set_capacity(1)
    client.set("fair", "not a list")
    try:
        for _ in range(PUBLISH_ATTEMPTS + 2):
            DispatchJob.objects.filter(task_id=task_id, state=SCHEDULED).update(
                not_before=timezone.now() - timedelta(seconds=1)
            )
            dispatch.publish(celery_app, dispatch.dispatch("fair"))
    finally:
        client.delete("fair")
    row = DispatchJob.objects.get(task_id=task_id)
    assert (row.state, row.publish_failures, row.failure) == (FAILED, PUBLISH_ATTEMPTS, "publish")


def test_published_by_a_process_that_does_not_know_the_task__the_mark_goes_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A maintenance pass run by manage.py fair_jobs_reap (or any process that does not
    # import the task's module) sent the job by name without its row's mark: a worker ran
    # it on the slot path, its row stayed dispatched, and the lost-message repair ran it
    # a second time (seen in the chaos suite).
    from celery import Celery

    from django_fair_jobs import headers

    monkeypatch.undo()
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr("kombu.messaging.Producer.publish", lambda self, *a, **k: sent.append(k))
    set_capacity(0)
    job = job_of(tasks.dispatched.delay("acme").id)
    set_capacity(1)
    ready = dispatch.dispatch("fair")
    stranger = Celery("stranger", set_as_current=False)  # the suite's app stays current
    monkeypatch.delitem(stranger.tasks, tasks.dispatched.name)  # it does not know the task
    assert dispatch.publish(stranger, ready) == 1
    (options,) = sent
    assert options["headers"][headers.DISPATCH] == job.pk
    assert options["headers"][headers.TENANT] == "acme"  # the stored headers are kept

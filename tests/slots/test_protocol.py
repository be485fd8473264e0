"""Defects of the slot, queue-limit and planner protocol found in review, each reproduced
on the real database (and the real broker where it takes part), in-process: the job runs
through ``FairTask.__call__`` as a worker runs a delivered message."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery.exceptions import Ignore, Retry
from celery.signals import before_task_publish

from django_fair_jobs import identity
from django_fair_jobs.models import QueueLimit, SlotLease, TenantQueueSlot
from tests.conftest import run_as_worker
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def test_self_retry__slot_given_back_before_the_retry_is_published(
    in_process_worker: uuid.UUID, broker_env: dict[str, str]
) -> None:
    # A retry with no countdown (autoretry_for with backoff and jitter can give ~0 s) can
    # start on another process at once: if the lease were still held, that copy would be
    # a 'duplicate' and wait a whole FAIR_JOBS_WORKER_TIMEOUT.
    held_at_publish: list[bool] = []

    def watch(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("id") == "retrying":
            held_at_publish.append(SlotLease.objects.filter(task_id="retrying").exists())

    before_task_publish.connect(watch, weak=False)
    try:
        with pytest.raises(Retry):
            run_as_worker(tasks.retries_now, ("acme",), task_id="retrying", headers={})
    finally:
        before_task_publish.disconnect(watch)
    assert held_at_publish == [False]
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 0
    assert not SlotLease.objects.exists()


@pytest.mark.parametrize("queue_limited", [False, True])
def test_acquire_committed_but_its_reply_lost__slot_not_leaked__the_job_runs(
    queue_limited: bool,
    in_process_worker: uuid.UUID,
    broker_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The acquire commits on the server, then the connection drops before the reply (a
    # failover, a PgBouncer restart): the process postpones the job, but the lease is
    # held by this live process under a token nobody has. Every later copy of the job
    # used to be a 'duplicate' for as long as this process lived, and a tenant with
    # limit 1 stayed blocked.
    from django.db import OperationalError

    from django_fair_jobs import admission, queue_limits

    if queue_limited:  # the queue path: a place in the queue and the tenant slot
        queue_limits.set_limits("fair", max_jobs=2)
        monkeypatch.setattr(queue_limits, "is_limited", lambda queue: queue == "fair")
    real_acquire = admission.acquire

    def commit_then_lose_the_reply(**kwargs: Any) -> Any:
        real_acquire(**kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(admission, "acquire", commit_then_lose_the_reply)
    with pytest.raises(Ignore):  # postponed through the broker
        run_as_worker(tasks.limited1, ("acme", 0), task_id="lost-reply", headers={})
    monkeypatch.setattr(admission, "acquire", real_acquire)
    assert SlotLease.objects.filter(task_id="lost-reply").exists()  # the orphan
    # The copy postponed through the broker comes back to this process or another one.
    # Either way it runs, once this process gave the orphan back: at its next heartbeat,
    # or at once if the copy starts here first.
    admission.retry_pending_releases()
    assert not SlotLease.objects.exists()
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 0
    assert list(QueueLimit.objects.values_list("current_jobs", "running")) == (
        [(0, {})] if queue_limited else []
    )
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="lost-reply", headers={}) == (
        "acme:done"
    )
    assert not SlotLease.objects.exists()


def test_acquire_reply_lost__the_copy_starts_here_before_the_heartbeat__it_runs(
    in_process_worker: uuid.UUID, broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.db import OperationalError

    from django_fair_jobs import admission

    real_acquire = admission.acquire

    def commit_then_lose_the_reply(**kwargs: Any) -> Any:
        real_acquire(**kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(admission, "acquire", commit_then_lose_the_reply)
    with pytest.raises(Ignore):
        run_as_worker(tasks.limited1, ("acme", 0), task_id="lost-reply", headers={})
    monkeypatch.setattr(admission, "acquire", real_acquire)
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="lost-reply", headers={}) == (
        "acme:done"
    )
    assert not SlotLease.objects.exists()
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 0


@pytest.fixture
def committed_at_publish(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[Callable[[], object]], list[bool]]:
    """``committed_at_publish(check)`` runs ``check`` from another connection each time a
    message goes to the broker (kombu's ``Producer.publish``) and returns the list of its
    answers. Another connection sees only what is committed, as a worker does; a check
    that waits on a row lock held across the publish fails the test."""
    import threading

    from django.db import connection
    from kombu.messaging import Producer

    checks: list[tuple[Callable[[], object], list[bool]]] = []
    real = Producer.publish

    def publish(self: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
        for check, seen in checks:

            def look(check: Callable[[], object] = check, seen: list[bool] = seen) -> None:
                try:
                    seen.append(bool(check()))
                finally:
                    connection.close()  # this thread's own connection

            thread = threading.Thread(target=look)
            thread.start()
            thread.join(10)
            assert not thread.is_alive(), "a row lock was held across the publish"
        return real(self, body, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", publish)

    def start(check: Callable[[], object]) -> list[bool]:
        seen: list[bool] = []
        checks.append((check, seen))
        return seen

    return start


def test_limit_raised_inside_atomic__wake_up_published_after_the_commit(
    in_process_worker: uuid.UUID, broker_env: dict[str, str], committed_at_publish: Any
) -> None:
    # An admin save and ATOMIC_REQUESTS run the change inside atomic(). The wake-up used to
    # reserve the slot and publish at once: the woken copy reached a worker before the
    # commit, saw no reservation, and was dropped or parked again behind its own
    # reservation, so the tenant waited a whole WORKER_TIMEOUT.
    from django.db import transaction

    from django_fair_jobs import slots
    from django_fair_jobs.models import ParkedJob

    slots.set_tenant_limit("acme", "fair", 0)  # paused: the job parks
    with pytest.raises(Ignore):
        run_as_worker(tasks.limited1, ("acme", 0), task_id="parked", headers={})
    seen = committed_at_publish(
        lambda: ParkedJob.objects.filter(task_id="parked", woken_at__isnull=False).exists()
    )
    with transaction.atomic():
        slots.set_tenant_limit("acme", "fair", 1)
        assert seen == []  # nothing published before the commit
    assert seen == [True]


def test_queue_limit_raised_inside_atomic__wake_up_published_after_the_commit(
    in_process_worker: uuid.UUID,
    broker_env: dict[str, str],
    committed_at_publish: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db import transaction

    from django_fair_jobs import queue_limits
    from django_fair_jobs.models import ParkedJob

    queue_limits.set_limits("fair", max_jobs=0)
    monkeypatch.setattr(queue_limits, "is_limited", lambda queue: queue == "fair")
    with pytest.raises(Ignore):
        run_as_worker(tasks.limited1, ("acme", 0), task_id="parked", headers={})
    seen = committed_at_publish(
        lambda: ParkedJob.objects.filter(task_id="parked", woken_at__isnull=False).exists()
    )
    with transaction.atomic():
        queue_limits.set_limits("fair", max_jobs=1)
        assert seen == []
    assert seen == [True]


def test_dispatched_job_enqueued_inside_atomic__published_after_the_commit(
    broker_env: dict[str, str], committed_at_publish: Any
) -> None:
    # Published before the commit, the job's message reached a worker that could not see
    # its row, and it waited for the lost-message repair. On a rollback nothing is sent.
    from django.db import transaction

    from django_fair_jobs.dispatch.models import DispatchJob, DispatchQueue

    DispatchQueue.objects.create(queue="fair", capacity=2, slack=0)
    seen = committed_at_publish(lambda: DispatchJob.objects.filter(tenant="acme").exists())
    with transaction.atomic():
        tasks.dispatched.delay("acme")
        assert seen == []
    assert seen == [True]

    def enqueue_then_roll_back() -> None:
        with transaction.atomic():
            tasks.dispatched.delay("rolled-back")
            raise RuntimeError

    with pytest.raises(RuntimeError):
        enqueue_then_roll_back()
    assert seen == [True]
    assert not DispatchJob.objects.filter(tenant="rolled-back").exists()


def test_admin_raises_a_limit__wake_up_published_after_its_transaction_commits(
    in_process_worker: uuid.UUID,
    broker_env: dict[str, str],
    committed_at_publish: Any,
    client: Any,
) -> None:
    # The admin's change view saves inside atomic(): the real publish, not a patched one.
    from django.contrib.auth.models import User

    from django_fair_jobs import slots
    from django_fair_jobs.models import ParkedJob

    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    slot = slots.set_tenant_limit("acme", "fair", 0)
    with pytest.raises(Ignore):
        run_as_worker(tasks.limited1, ("acme", 0), task_id="parked", headers={})
    seen = committed_at_publish(
        lambda: ParkedJob.objects.filter(task_id="parked", woken_at__isnull=False).exists()
    )
    response = client.post(
        f"/admin/fair_jobs/tenantqueueslot/{slot.pk}/change/",
        {"max_jobs": "1", **{f"leases-{k}": v for k, v in
                             {"TOTAL_FORMS": "0", "INITIAL_FORMS": "0", "MIN_NUM_FORMS": "0",
                              "MAX_NUM_FORMS": "1000"}.items()}},
    )  # fmt: skip
    assert response.status_code == 302, response.content[:500]
    assert seen == [True]


def test_side_connection_cut_between_two_enqueues__the_next_enqueue_still_works(
    broker_env: dict[str, str],
) -> None:
    # Enqueues of a rerouted task inside atomic() are counted on a second connection of the
    # thread, which Django's request cycle never checks. After a database or pooler restart
    # the first enqueue on each thread raised OperationalError to the caller.
    from django.db import connection, transaction

    from django_fair_jobs.models import TenantWindow
    from django_fair_jobs.reroute import store as reroute_store
    from tests.conftest import is_postgres

    with transaction.atomic():
        tasks.rerouted.delay("acme")
    side = getattr(reroute_store._side_connections, "default", None)
    if is_postgres():
        assert side is not None and side.connection is not None
        with connection.cursor() as cursor:  # what a restart does to it
            cursor.execute("SELECT pg_terminate_backend(%s)", [side.connection.info.backend_pid])
    else:
        assert side is None  # SQLite counts in the caller's transaction
    try:
        with transaction.atomic():
            tasks.rerouted.delay("acme")
    finally:
        reroute_store._forget_side_connection("default")  # the test database can be dropped
    assert TenantWindow.objects.get(tenant="acme").total == 2


@pytest.mark.django_db(transaction=True)
def test_heartbeat__a_shutdown_between_its_wake_and_its_beat__does_not_register_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The heartbeat wakes, then the process shuts down (stops the heartbeat, retires its
    # row) before the beat: the beat finds no row. That is not a reap of a live process,
    # and re-registering would leave the row of a process that is gone, counted as live
    # capacity until it is reaped a worker timeout later.
    import os
    import threading

    from django.test import override_settings

    from django_fair_jobs.maintenance import threads
    from django_fair_jobs.models import WorkerProcess

    ident = identity.Identity(process_id=uuid.uuid4(), pid=os.getpid(), node="n@h")
    identity.register_row(ident)
    real_beat = identity.beat

    def beat_after_a_shutdown(process_id: uuid.UUID) -> bool:
        ident.stop.set()
        identity.retire_process(process_id)
        return real_beat(process_id)

    monkeypatch.setattr(identity, "beat", beat_after_a_shutdown)
    with override_settings(FAIR_JOBS_HEARTBEAT_INTERVAL=0.01):
        beating = threading.Thread(target=threads._heartbeat_loop, args=(ident,))
        beating.start()
        beating.join(10)
    assert not beating.is_alive()
    assert not WorkerProcess.objects.filter(pk=ident.process_id).exists()

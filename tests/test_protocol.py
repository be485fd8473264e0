"""Defects of the slot, queue-limit and planner protocol found in review, each reproduced
on the real database (and the real broker where it takes part), in-process: the job runs
through ``FairTask.__call__`` as a worker runs a delivered message."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery.exceptions import Ignore, Retry
from celery.signals import before_task_publish

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

    from django_fair_jobs import limits, slots

    if queue_limited:  # the queue path: a place in the queue and the tenant slot
        limits.set_limits("fair", max_jobs=2)
        monkeypatch.setattr(limits, "is_limited", lambda queue: queue == "fair")
    real_acquire = slots.acquire

    def commit_then_lose_the_reply(**kwargs: Any) -> Any:
        real_acquire(**kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(slots, "acquire", commit_then_lose_the_reply)
    with pytest.raises(Ignore):  # postponed through the broker
        run_as_worker(tasks.limited1, ("acme", 0), task_id="lost-reply", headers={})
    monkeypatch.setattr(slots, "acquire", real_acquire)
    assert SlotLease.objects.filter(task_id="lost-reply").exists()  # the orphan
    # The copy postponed through the broker comes back to this process or another one.
    # Either way it runs, once this process gave the orphan back: at its next heartbeat,
    # or at once if the copy starts here first.
    slots.retry_pending_releases()
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

    from django_fair_jobs import slots

    real_acquire = slots.acquire

    def commit_then_lose_the_reply(**kwargs: Any) -> Any:
        real_acquire(**kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(slots, "acquire", commit_then_lose_the_reply)
    with pytest.raises(Ignore):
        run_as_worker(tasks.limited1, ("acme", 0), task_id="lost-reply", headers={})
    monkeypatch.setattr(slots, "acquire", real_acquire)
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="lost-reply", headers={}) == (
        "acme:done"
    )
    assert not SlotLease.objects.exists()
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 0

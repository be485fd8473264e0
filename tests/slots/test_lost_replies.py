"""Lost replies on the slot protocol, seen through a PgBouncer restart
(tests/deploy/test_pgbouncer.py): the statement commits and its reply is cut. The next try
of the job's admission reads what the rows say happened: a lease its cut acquire took is
given back (a woken copy then starts afresh, its parked row being gone), and a job whose park
committed is found parked, with no second copy in the broker."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis
from celery.exceptions import Ignore
from django.db import OperationalError

from django_fair_jobs import admission, headers, slots
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.models import ParkedJob, SlotLease
from django_fair_jobs.slots import store as slot_store
from tests.conftest import run_as_worker
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def _park_and_wake(pid: uuid.UUID) -> None:
    holder = slot_store.try_acquire(
        tenant="acme", queue="fair", task_id="holder", limit=1, process_id=pid, timeout=60
    ).grant
    assert holder is not None
    with pytest.raises(Ignore):  # parked: the tenant is at its limit
        run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers={})
    assert ParkedJob.objects.filter(task_id="j").exists()
    slot_store.release(holder)
    assert holder.slot_id is not None
    slots.wake(holder.slot_id, limit=1)  # reserves the slot for "j", publishes its copy


def _cut_once(target: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make ``target.name`` commit and then lose its reply, once: a restart of the database
    or of PgBouncer cuts the connection after the statement committed. Returns the list
    that counts the calls."""
    real = getattr(target, name)
    calls: list[int] = []

    def commit_then_lose_the_reply(**kwargs: Any) -> Any:
        calls.append(1)
        answer = real(**kwargs)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return answer

    monkeypatch.setattr(target, name, commit_then_lose_the_reply)
    return calls


def test_woken_claim_committed_reply_lost__the_job_runs_in_the_same_delivery(
    in_process_worker: uuid.UUID, broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _park_and_wake(in_process_worker)
    woken = {headers.WAKE: ParkedJob.objects.get(task_id="j").wake_count}
    calls = _cut_once(admission, "acquire", monkeypatch)
    # The claim committed (its parked row is gone) and its reply was cut: the next try
    # gives the lease back and admits the job as a fresh start, not as a stale copy.
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers=woken) == "acme:done"
    assert len(calls) == 2
    assert not ParkedJob.objects.filter(task_id="j").exists()
    assert not SlotLease.objects.exists()


def test_park_committed_reply_lost__the_job_is_parked_once__runs_once(
    in_process_worker: uuid.UUID,
    broker_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    holder = slot_store.try_acquire(
        tenant="acme", queue="fair", task_id="holder", limit=1, process_id=in_process_worker,
        timeout=60,
    ).grant  # fmt: skip
    assert holder is not None
    _cut_once(slot_store, "try_park", monkeypatch)
    # The park committed and its reply was cut: the next try finds the job parked, and the
    # delivery ends without a second copy in the broker.
    with pytest.raises(Ignore):
        run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers={})
    assert ParkedJob.objects.filter(task_id="j").count() == 1
    slot_store.release(holder)
    assert holder.slot_id is not None
    slots.wake(holder.slot_id, limit=1)
    woken = {headers.WAKE: ParkedJob.objects.get(task_id="j").wake_count}
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers=woken) == "acme:done"
    assert not SlotLease.objects.exists()
    assert not ParkedJob.objects.exists()
    # The broker holds the wake's copy (run above by hand) and no other copy of the job
    # that would run it again (the suite's broker is Redis: a queue is a list).
    from django.conf import settings

    assert redis.Redis.from_url(settings.CELERY_BROKER_URL).llen("fair") == 1


def test_woken_claim_committed__database_gone_past_the_tries__its_copy_runs_here_later(
    in_process_worker: uuid.UUID, broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _park_and_wake(in_process_worker)
    woken = {headers.WAKE: ParkedJob.objects.get(task_id="j").wake_count}
    real_acquire, real_drop = admission.acquire, lease_store.drop_held_by
    calls: list[int] = []

    def committed_then_unreachable(**kwargs: Any) -> Any:
        if not calls:
            real_acquire(**kwargs)  # the claim commits; every reply and later try fails
        calls.append(1)
        raise OperationalError("server closed the connection unexpectedly")

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise OperationalError("could not connect to server")

    monkeypatch.setattr(admission, "acquire", committed_then_unreachable)
    monkeypatch.setattr(lease_store, "drop_held_by", unreachable)
    with pytest.raises(Ignore):  # postponed through the broker, still marked woken
        run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers=woken)
    # Every try failed: the first, one at once on a new connection, one after each delay.
    assert len(calls) == 2 + len(admission.REPLY_RETRY_DELAYS)
    monkeypatch.setattr(admission, "acquire", real_acquire)
    monkeypatch.setattr(lease_store, "drop_held_by", real_drop)
    # Its copy comes back to this process before the heartbeat gave the lease back: the
    # lease shows the claim committed, so the copy starts afresh instead of being dropped.
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers=woken) == "acme:done"
    assert not SlotLease.objects.exists()


def test_woken_claim_committed__the_heartbeat_releases_its_lease_between_tries__it_runs(
    in_process_worker: uuid.UUID, broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _park_and_wake(in_process_worker)
    woken = {headers.WAKE: ParkedJob.objects.get(task_id="j").wake_count}
    _cut_once(admission, "acquire", monkeypatch)
    beats: list[float] = []

    def heartbeat_meanwhile(seconds: float) -> None:
        beats.append(seconds)
        admission.retry_pending_releases()  # the maintenance thread, during the wait

    # time.sleep itself: the admission's wait between tries is the first call.
    monkeypatch.setattr(time, "sleep", heartbeat_meanwhile)
    # The heartbeat gave the claim's lease back before the next try could: that try still
    # knows the claim took the parked row, and starts the job afresh.
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers=woken) == "acme:done"
    assert beats[:1] == [0.0]  # one try after the cut, at once on a new connection
    assert not SlotLease.objects.exists()


def test_a_lost_reply_noted__a_copy_running_here_keeps_its_own_lease(process: uuid.UUID) -> None:
    # The heartbeat releases the leases of acquires whose reply was lost; a copy of the
    # job that acquired since and runs here holds its own lease under the same task id.
    # Released, the slot would admit one job more than the tenant's cap while it runs.
    from django_fair_jobs.admission import ends
    from django_fair_jobs.models import TenantQueueSlot

    task_id = str(uuid.uuid4())
    grant = slot_store.try_acquire(
        tenant="acme", queue="q", task_id=task_id, limit=1, process_id=process, timeout=60
    ).grant
    assert grant is not None
    ends.note_uncertain(task_id, process)  # an earlier statement's reply was lost
    ends.mark_running(task_id)  # the copy that holds the grant runs here
    try:
        admission.retry_pending_releases()
        assert SlotLease.objects.filter(task_id=task_id).count() == 1
        assert TenantQueueSlot.objects.get(tenant="acme", queue="q").current_jobs == 1
    finally:
        ends.unmark_running(task_id)
        ends.LEDGER.uncertain.clear()

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


def _acquire_lost_past_the_tries(
    monkeypatch: pytest.MonkeyPatch, task_id: str, delivery: dict[str, Any]
) -> None:
    """Deliver job ``task_id`` of tenant acme here: its acquire commits, then the database
    is gone for its reply and every later try, so the delivery is postponed through the
    broker and the lease it took stays for the heartbeat to release."""
    real_acquire, real_drop = admission.acquire, lease_store.drop_held_by
    committed: list[Any] = []

    def committed_then_unreachable(**kwargs: Any) -> Any:
        if not committed:
            committed.append(real_acquire(**kwargs))
        raise OperationalError("server closed the connection unexpectedly")

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("could not connect to server")

    monkeypatch.setattr(admission, "REPLY_RETRY_DELAYS", (0.0, 0.0))
    monkeypatch.setattr(admission, "acquire", committed_then_unreachable)
    monkeypatch.setattr(lease_store, "drop_held_by", unreachable)
    with pytest.raises(Ignore):  # postponed through the broker
        run_as_worker(tasks.limited1, ("acme", 0), task_id=task_id, headers=delivery)
    monkeypatch.setattr(admission, "acquire", real_acquire)
    monkeypatch.setattr(lease_store, "drop_held_by", real_drop)
    assert SlotLease.objects.filter(task_id=task_id).exists()  # the acquire committed


@pytest.mark.usefixtures("broker_env", "fresh_ledger", "in_process_worker")
def test_a_woken_claim_whose_reply_was_lost__runs_once__a_stale_copy_after_it_dropped(
    monkeypatch: pytest.MonkeyPatch, in_process_worker: uuid.UUID
) -> None:
    """A woken copy whose claim committed with its reply lost runs as a fresh start, once:
    that lets one copy through, not every later one. A second copy of the woken message
    delivered here afterwards is stale (its parked row is gone) and is dropped, never run
    a second time."""
    _park_and_wake(in_process_worker)
    woken = {headers.WAKE: ParkedJob.objects.get(task_id="j").wake_count}
    calls = _cut_once(admission, "acquire", monkeypatch)
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers=woken) == "acme:done"
    assert len(calls) == 2  # the claim committed, its reply cut; the next try ran it
    with pytest.raises(Ignore):  # stale: dropped, not run again
        run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers=woken)
    assert not SlotLease.objects.exists() and not ParkedJob.objects.exists()


@pytest.mark.usefixtures("broker_env", "fresh_ledger", "in_process_worker")
def test_a_fresh_jobs_lost_acquire_released_by_the_heartbeat__a_stale_woken_copy_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The heartbeat's release of the lease of a fresh job's acquire whose reply was lost
    frees no parked row (the job had none, unlike a woken copy's claim): a stale woken copy
    of that job delivered here later is still dropped, not run as a fresh start; the job's
    postponed copy then runs, once."""
    _acquire_lost_past_the_tries(monkeypatch, "j", {})
    admission.retry_pending_releases()  # the heartbeat
    assert not SlotLease.objects.exists()
    with pytest.raises(Ignore):  # a woken copy whose parked row is gone: stale
        run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers={headers.WAKE: 1})
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers={}) == "acme:done"


@pytest.mark.usefixtures("broker_env", "fresh_ledger", "in_process_worker")
def test_a_woken_claim_released_by_the_heartbeat__its_copy_runs__after_later_releases_too(
    monkeypatch: pytest.MonkeyPatch, in_process_worker: uuid.UUID
) -> None:
    """A woken copy's claim that committed with its reply lost, its lease released by the
    heartbeat, took the job's parked row: the copy postponed meanwhile (still woken) runs
    as a fresh start when it comes back here, also after later heartbeats released the
    leases of other lost replies; dropped as stale, the job would be lost."""
    _park_and_wake(in_process_worker)
    woken = {headers.WAKE: ParkedJob.objects.get(task_id="j").wake_count}
    _acquire_lost_past_the_tries(monkeypatch, "j", woken)
    assert not ParkedJob.objects.filter(task_id="j").exists()  # the claim took it
    admission.retry_pending_releases()  # the heartbeat releases the claim's lease
    _acquire_lost_past_the_tries(monkeypatch, "k", {})  # another job's lost reply
    admission.retry_pending_releases()  # the next heartbeat releases that lease
    assert not SlotLease.objects.exists()
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers=woken) == "acme:done"

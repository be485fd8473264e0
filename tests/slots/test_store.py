"""The slot protocol against the real database: acquire, park, release, wake, fence."""

from __future__ import annotations

import uuid

import pytest

from django_fair_jobs import identity, maintenance
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.leases.types import Grant
from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess
from django_fair_jobs.slots import store as slot_store

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]


def acquire(
    process: uuid.UUID, task_id: str, tenant: str = "acme", queue: str = "q", limit: int = 2
) -> Grant | None:
    return slot_store.try_acquire(
        tenant=tenant,
        queue=queue,
        task_id=task_id,
        limit=limit,
        process_id=process,
        timeout=60,
    ).grant


def _slot(grant: Grant | None) -> int:
    assert grant is not None and grant.slot_id is not None
    return grant.slot_id


def status(process: uuid.UUID, task_id: str, limit: int = 2) -> str:
    return slot_store.try_acquire(
        tenant="acme", queue="q", task_id=task_id, limit=limit, process_id=process, timeout=60
    ).status


def slot(tenant: str = "acme", queue: str = "q") -> TenantQueueSlot:
    found: TenantQueueSlot = TenantQueueSlot.objects.get(tenant=tenant, queue=queue)
    return found


def park(task_id: str, tenant: str = "acme", limit: int = 2) -> str:
    return slot_store.try_park(
        tenant=tenant,
        queue="q",
        task_id=task_id,
        task_name="t",
        limit=limit,
        signature=f'{{"task": "t", "options": {{"task_id": "{task_id}"}}}}',
    )


def test_acquire__new_tenant__creates_row_and_lease(process: uuid.UUID) -> None:
    grant = acquire(process, "j1")
    assert grant is not None
    row = slot()
    assert (row.current_jobs, row.max_jobs, row.default_max_jobs) == (1, None, 2)
    assert list(SlotLease.objects.values_list("task_id", "process_id")) == [("j1", process)]


def test_acquire__at_limit__returns_none_and_counts_nothing(process: uuid.UUID) -> None:
    assert acquire(process, "j1") is not None
    assert acquire(process, "j2") is not None
    assert acquire(process, "j3") is None
    assert slot().current_jobs == 2
    assert SlotLease.objects.count() == 2


def test_acquire__queue_aware__other_queue_has_its_own_slot(process: uuid.UUID) -> None:
    assert acquire(process, "j1", queue="imports", limit=1) is not None
    assert acquire(process, "j2", queue="syncs", limit=1) is not None
    assert acquire(process, "j3", queue="imports", limit=1) is None


def test_acquire__row_override_beats_task_default(process: uuid.UUID) -> None:
    assert acquire(process, "j1", limit=1) is not None
    TenantQueueSlot.objects.filter(tenant="acme").update(max_jobs=3)
    assert acquire(process, "j2", limit=1) is not None
    assert acquire(process, "j3", limit=1) is not None
    assert acquire(process, "j4", limit=1) is None


def test_acquire__override_zero__pauses_tenant(process: uuid.UUID) -> None:
    assert acquire(process, "j1") is not None
    TenantQueueSlot.objects.filter(tenant="acme").update(max_jobs=0)
    assert acquire(process, "j2") is None


def test_acquire__task_default_change__reaches_rows_without_override(process: uuid.UUID) -> None:
    assert acquire(process, "j1", limit=1) is not None
    assert acquire(process, "j2", limit=1) is None
    assert acquire(process, "j2", limit=2) is not None


def test_acquire__duplicate_while_holder_alive__refused(process: uuid.UUID) -> None:
    assert acquire(process, "j1") is not None
    assert status(process, "j1") == "duplicate"
    assert slot().current_jobs == 1
    assert SlotLease.objects.count() == 1


def test_acquire__redelivery_after_holder_died__claims_lease_no_second_slot(
    process: uuid.UUID,
) -> None:
    first = acquire(process, "j1")
    WorkerProcess.objects.filter(pk=process).update(last_heartbeat_at="2000-01-01T00:00:00Z")
    other = uuid.uuid4()
    identity.register_process(process_id=other, node="b@host", hostname="host", pid=2)
    again = acquire(other, "j1")
    assert first is not None and again is not None
    assert first.token != again.token
    assert slot().current_jobs == 1
    assert list(SlotLease.objects.values_list("process_id", flat=True)) == [other]


def test_release__frees_slot_once(process: uuid.UUID) -> None:
    grant = acquire(process, "j1")
    assert grant is not None
    assert slot_store.release(grant) == 0
    assert slot_store.release(grant) is None
    assert slot().current_jobs == 0
    assert SlotLease.objects.count() == 0


def test_release__stale_holder_after_takeover__releases_nothing(process: uuid.UUID) -> None:
    stale = acquire(process, "j1")
    WorkerProcess.objects.filter(pk=process).update(last_heartbeat_at="2000-01-01T00:00:00Z")
    fresh = acquire(uuid.uuid4(), "j1")  # a redelivery took the lease over
    assert stale is not None and fresh is not None
    assert slot_store.release(stale) is None
    assert slot().current_jobs == 1
    assert slot_store.release(fresh) == 0
    assert slot().current_jobs == 0


def test_release__stale_holder_after_reap__does_not_free_second_slot(process: uuid.UUID) -> None:
    stale = acquire(process, "j1", limit=1)
    assert stale is not None
    WorkerProcess.objects.filter(pk=process).delete()  # presumed dead...
    SlotLease.objects.update(acquired_at="2000-01-01T00:00:00Z")  # ...for the whole timeout
    assert lease_store.reap(timeout=60).slots == ((stale.slot_id, 1),)
    other = uuid.uuid4()
    identity.register_process(process_id=other, node="b@host", hostname="host", pid=2)
    successor = acquire(other, "j2", limit=1)
    assert successor is not None
    # The reaped job is still running and now finishes: its release must not free j2's slot.
    assert slot_store.release(stale) is None
    assert slot().current_jobs == 1
    assert acquire(other, "j3", limit=1) is None


def test_reap__live_process__keeps_its_leases(process: uuid.UUID) -> None:
    dead = uuid.uuid4()
    identity.register_process(process_id=dead, node="dead@host", hostname="host", pid=2)
    assert acquire(process, "j1") is not None
    assert acquire(dead, "j2") is not None
    # Both leases are older than the timeout, so the acquired_at rule spares neither: only
    # its holder's heartbeat can keep j1's. j2's holder stopped beating, and it goes in
    # the same pass.
    SlotLease.objects.update(acquired_at="2000-01-01T00:00:00Z")
    WorkerProcess.objects.filter(pk=dead).update(last_heartbeat_at="2000-01-01T00:00:00Z")
    reaped = lease_store.reap(timeout=60)
    assert reaped.leases == 1
    assert list(SlotLease.objects.values_list("task_id", "process_id")) == [("j1", process)]
    assert slot().current_jobs == 1
    assert WorkerProcess.objects.filter(pk=process).exists()


def test_park__slot_full__parks_and_counts(process: uuid.UUID) -> None:
    assert acquire(process, "j1", limit=1) is not None
    assert park("j2", limit=1) == "parked"
    assert park("j2", limit=1) == "already_parked"
    row = slot()
    assert (row.parked_jobs, row.deferred_total) == (1, 1)


def test_park__slot_freed_meanwhile__answers_room(process: uuid.UUID) -> None:
    grant = acquire(process, "j1", limit=1)
    assert grant is not None
    slot_store.release(grant)
    assert park("j2", limit=1) == "room"
    assert ParkedJob.objects.count() == 0


def test_release__with_parked__wake_hands_slot_to_oldest(process: uuid.UUID) -> None:
    holder = acquire(process, "j1", limit=1)
    assert holder is not None
    assert park("j2", limit=1) == "parked"
    assert park("j3", limit=1) == "parked"
    assert slot_store.release(holder) == 2
    woken = slot_store.wake_one(_slot(holder))
    assert woken is not None and woken.task_id == "j2"
    row = slot()
    assert (row.current_jobs, row.parked_jobs) == (1, 1)
    # The slot is reserved for j2: nobody else gets it, j2 claims it when it arrives.
    assert acquire(process, "j9", limit=1) is None
    assert acquire(process, "j2", limit=1) is not None
    assert slot().current_jobs == 1
    assert not ParkedJob.objects.filter(task_id="j2").exists()


def test_wake__no_room__wakes_nobody(process: uuid.UUID) -> None:
    assert acquire(process, "j1", limit=1) is not None
    assert park("j2", limit=1) == "parked"
    assert slot_store.wake_one(slot().pk) is None
    assert ParkedJob.objects.get().woken_at is None


def test_reap__unclaimed_reservation__frees_slot_and_rewake_requeues(process: uuid.UUID) -> None:
    holder = acquire(process, "j1", limit=1)
    assert holder is not None
    assert park("j2", limit=1) == "parked"
    slot_store.release(holder)
    assert slot_store.wake_one(_slot(holder)) is not None
    # The re-published message is lost; time passes beyond the timeout.
    SlotLease.objects.update(acquired_at="2000-01-01T00:00:00Z")
    ParkedJob.objects.update(woken_at="2000-01-01T00:00:00Z")
    assert lease_store.reap(timeout=60).slots == ((holder.slot_id, 1),)
    assert lease_store.requeue_lost_wakes(timeout=60) == 1
    row = slot()
    assert (row.current_jobs, row.parked_jobs) == (0, 1)
    assert slot_store.with_waiting_room() == [row.pk]


def test_reconcile__drifted_counter__is_repaired(process: uuid.UUID) -> None:
    assert acquire(process, "j1", limit=1) is not None
    assert park("j2", limit=1) == "parked"
    TenantQueueSlot.objects.update(parked_jobs=5)
    assert slot_store.reconcile_parked() == 1
    assert slot().parked_jobs == 1


def woken_status(process: uuid.UUID, task_id: str, limit: int = 1) -> str:
    return slot_store.try_acquire(
        tenant="acme", queue="q", task_id=task_id, limit=limit, process_id=process,
        timeout=60, woken=True,
    ).status  # fmt: skip


def test_woken_copies__first_to_start_runs_later_ones_are_stale(process: uuid.UUID) -> None:
    holder = acquire(process, "j1", limit=1)
    assert holder is not None
    assert park("j2", limit=1) == "parked"
    slot_store.release(holder)
    first = slot_store.wake_one(_slot(holder))
    assert first is not None and first.wake == 1
    # Its message is slow (a long broker backlog): the reservation expires, the job is
    # woken again and a second copy is published.
    SlotLease.objects.update(acquired_at="2000-01-01T00:00:00Z")
    ParkedJob.objects.update(woken_at="2000-01-01T00:00:00Z")
    lease_store.reap(timeout=60)
    lease_store.requeue_lost_wakes(timeout=60)
    second = slot_store.wake_one(_slot(holder))
    assert second is not None and second.wake == 2
    # The old copy arrives first: it may still run (its row exists) and claims the slot.
    assert woken_status(process, "j2") == "held"
    assert slot().current_jobs == 1
    # The newer copy arrives while the old one runs: a duplicate (a woken one is dropped).
    assert woken_status(uuid.uuid4(), "j2") == "duplicate"
    assert slot().current_jobs == 1
    # Or after it finished: its row is gone, so it is stale, never a second run.
    running = SlotLease.objects.get(task_id="j2")
    slot_store.release(Grant(running.slot_id, "j2", running.token))
    assert woken_status(uuid.uuid4(), "j2") == "stale"
    assert slot().current_jobs == 0


def test_woken_copy__second_copy_while_first_runs__duplicate(process: uuid.UUID) -> None:
    holder = acquire(process, "j1", limit=1)
    assert holder is not None
    assert park("j2", limit=1) == "parked"
    slot_store.release(holder)
    assert slot_store.wake_one(_slot(holder)) is not None
    assert woken_status(process, "j2") == "held"
    assert woken_status(process, "j2") == "duplicate"  # dropped: it is a woken copy


def test_maintenance_claim__once_per_interval() -> None:
    from django_fair_jobs.models import Maintenance

    assert maintenance.claim_maintenance("m", interval=60)
    assert not maintenance.claim_maintenance("m", interval=60)
    Maintenance.objects.update(last_run_at="2000-01-01T00:00:00Z")
    assert maintenance.claim_maintenance("m", interval=60)


def wake_all(slot_id: int) -> list[str]:
    woken = []
    while (job := slot_store.wake_one(slot_id)) is not None:
        woken.append(job.task_id)
    return woken


def test_woken_copy__redelivered_after_its_worker_died__claims_the_dead_lease(
    process: uuid.UUID,
) -> None:
    holder = acquire(process, "j1", limit=1)
    assert holder is not None
    assert park("j2", limit=1) == "parked"
    slot_store.release(holder)
    assert slot_store.wake_one(_slot(holder)) is not None
    assert woken_status(process, "j2") == "held"  # its row is gone now
    WorkerProcess.objects.filter(pk=process).update(last_heartbeat_at="2000-01-01T00:00:00Z")
    # The broker redelivers the same woken message (acks_late) to a new process: the job
    # did not finish, so it must run, on the same slot.
    assert woken_status(uuid.uuid4(), "j2") == "held"
    assert slot().current_jobs == 1


def test_park__woken_copy_whose_row_is_gone__stale_not_reparked(process: uuid.UUID) -> None:
    assert acquire(process, "j1", limit=1) is not None
    outcome = slot_store.try_park(
        tenant="acme", queue="q", task_id="j2", task_name="t", limit=1, signature="{}",
        woken=True,
    )  # fmt: skip
    assert outcome == "stale"
    assert not ParkedJob.objects.exists()
    assert slot().parked_jobs == 0


def test_wake__picks_a_job_with_room_under_its_own_limit(process: uuid.UUID) -> None:
    # Tasks with limits 1 and 3 share the queue; 3 jobs run, a limit-1 job parks first.
    grants = [acquire(process, f"b{i}", limit=3) for i in range(3)]
    assert park("a1", limit=1) == "parked"
    assert park("b4", limit=3) == "parked"
    released = grants[0]
    assert released is not None
    slot_store.release(released)
    # 2 run: no room for a1 (limit 1), room for b4 (limit 3); a1 must not block b4.
    assert wake_all(_slot(released)) == ["b4"]
    assert ParkedJob.objects.get(task_id="a1").woken_at is None


def test_wake__skips_a_job_whose_copy_is_running(process: uuid.UUID) -> None:
    holder = acquire(process, "h", limit=2)
    assert holder is not None
    assert acquire(process, "j", limit=2) is not None  # a duplicate copy of j runs...
    slot_store.try_park(  # ...while another copy of j had been parked
        tenant="acme", queue="q", task_id="j", task_name="t", limit=1, signature="{}"
    )
    assert park("k", limit=2) == "parked"
    slot_store.release(holder)
    assert wake_all(_slot(holder)) == ["k"]


def test_reap__spares_a_lease_claimed_within_the_timeout(process: uuid.UUID) -> None:
    newcomer = uuid.uuid4()  # a process whose row this reaper's view does not have yet
    assert acquire(newcomer, "j1") is not None
    assert lease_store.reap(timeout=60).leases == 0
    SlotLease.objects.update(acquired_at="2000-01-01T00:00:00Z")
    assert lease_store.reap(timeout=60).slots == ((slot().pk, 1),)

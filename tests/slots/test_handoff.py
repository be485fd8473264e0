"""Slot handoff (``FAIR_JOBS_SLOT_HANDOFF``): a process keeps the slot of a job that ended
well and hands it to its next job of the same tenant and queue in one statement; what
cannot be handed over is released as before. The store's step on both paths, then the job
path on PostgreSQL with the keeper thread for real."""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery.exceptions import Ignore
from django.db import DataError, InterfaceError, connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_fair_jobs import admission, identity
from django_fair_jobs.admission import ends, handoff
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.leases.types import Grant
from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess
from django_fair_jobs.slots import store as slot_store
from django_fair_jobs.sql import queries
from tests.conftest import run_as_worker, wait_for
from tests.sessions import in_thread, run_while_locked, session, wait_until_blocked
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = pytest.mark.django_db(transaction=True)

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="handoff runs on PostgreSQL only"
)


def acquire(
    process: uuid.UUID, task_id: str, limit: int = 2, tenant: str = "acme", queue: str = "q"
) -> Grant:
    grant = slot_store.try_acquire(
        tenant=tenant, queue=queue, task_id=task_id, limit=limit, process_id=process, timeout=60
    ).grant
    assert grant is not None
    return grant


def slot(tenant: str = "acme", queue: str = "q") -> TenantQueueSlot:
    return TenantQueueSlot.objects.get(tenant=tenant, queue=queue)


# -- the store's step (PostgreSQL's statement and the ORM path) ----------------------------


@pytest.mark.usefixtures("engine")
def test_hand_over__same_slot__renamed_lease_counter_untouched_old_holder_fenced(
    process: uuid.UUID,
) -> None:
    done = acquire(process, "j1")
    nxt = slot_store.hand_over(held=done, task_id="j2", limit=2)
    assert nxt is not None and nxt.slot_id == done.slot_id and nxt.token != done.token
    assert slot().current_jobs == 1
    assert list(SlotLease.objects.values_list("task_id", "process_id")) == [("j2", process)]
    assert slot_store.release(done) is None  # the finished job's release frees nothing
    assert slot_store.hand_over(held=done, task_id="j3", limit=2) is None
    assert slot_store.release(nxt) == 0
    assert slot().current_jobs == 0 and not SlotLease.objects.exists()


@pytest.mark.usefixtures("engine")
def test_acquire__room_to_spare__told_on_the_grant(process: uuid.UUID) -> None:
    assert acquire(process, "j1", limit=3).spare
    assert not acquire(process, "j2", limit=2).spare  # the last slot
    handed = slot_store.hand_over(held=acquire(process, "j3", limit=4), task_id="j4", limit=4)
    assert handed is not None and handed.spare  # 3 of 4


@pytest.mark.usefixtures("engine")
def test_hand_over__jobs_parked_on_the_slot__refused_they_go_first(process: uuid.UUID) -> None:
    done = acquire(process, "j1", limit=1)
    signature = '{"task": "t", "options": {"task_id": "waiting"}}'
    assert slot_store.try_park(
        tenant="acme", queue="q", task_id="waiting", task_name="t", limit=1, signature=signature
    ) == "parked"  # fmt: skip
    assert slot_store.hand_over(held=done, task_id="j2", limit=1) is None
    assert SlotLease.objects.get().task_id == "j1"


@pytest.mark.usefixtures("engine")
def test_hand_over__limit_lowered_below_the_count__refused(process: uuid.UUID) -> None:
    done = acquire(process, "j1")
    TenantQueueSlot.objects.update(max_jobs=0)
    assert slot_store.hand_over(held=done, task_id="j2", limit=2) is None


@pytest.mark.usefixtures("engine")
def test_hand_over__next_job_already_has_a_lease__refused(process: uuid.UUID) -> None:
    done = acquire(process, "j1")
    acquire(process, "j2")  # a copy of j2 runs already: acquire calls it a duplicate
    assert slot_store.hand_over(held=done, task_id="j2", limit=2) is None
    assert slot().current_jobs == 2


LOCK_SLOT = "SELECT 1 FROM fair_jobs_tenantqueueslot WHERE id = %s FOR NO KEY UPDATE"


def trade(
    done: Grant,
    process: uuid.UUID,
    task_id: str,
    tenant: str = "other",
    limit: int = 2,
    woken: bool = False,
) -> tuple[Any, int | None] | None:
    return slot_store.try_release_and_acquire(
        held=done, tenant=tenant, queue="q", task_id=task_id, limit=limit, process_id=process,
        timeout=60, woken=woken,
    )  # fmt: skip


@pytest.mark.usefixtures("engine")
def test_release_and_acquire__other_tenant__kept_released_next_held_old_holder_fenced(
    process: uuid.UUID,
) -> None:
    done = acquire(process, "j1")
    traded = trade(done, process, "j2")
    assert traded is not None
    acquired, parked = traded
    assert acquired.status == "held" and parked == 0
    assert acquired.grant is not None and acquired.grant.spare  # 1 of 2: may be kept
    assert slot().current_jobs == 0 and slot("other").current_jobs == 1
    assert list(SlotLease.objects.values_list("task_id", "slot_id")) == [("j2", slot("other").pk)]
    assert slot_store.release(done) is None  # released once, never twice


@pytest.mark.usefixtures("engine")
def test_release_and_acquire__jobs_parked_on_the_released_slot__their_count_returned(
    process: uuid.UUID,
) -> None:
    done = acquire(process, "j1", limit=1)
    signature = '{"task": "t", "options": {"task_id": "waiting"}}'
    assert slot_store.try_park(
        tenant="acme", queue="q", task_id="waiting", task_name="t", limit=1, signature=signature
    ) == "parked"  # fmt: skip
    traded = trade(done, process, "j2")
    assert traded is not None and traded[1] == 1  # the caller wakes one
    assert slot().current_jobs == 0


@pytest.mark.usefixtures("engine")
def test_release_and_acquire__next_tenant_at_its_limit__released_anyway_answer_full(
    process: uuid.UUID,
) -> None:
    done = acquire(process, "j1")
    acquire(process, "o1", 1, tenant="other")
    traded = trade(done, process, "j2", limit=1)
    assert traded is not None
    assert traded[0].status == "full" and traded[0].grant is None and traded[1] == 0
    assert slot().current_jobs == 0 and slot("other").current_jobs == 1


@pytest.mark.usefixtures("engine")
def test_release_and_acquire__kept_lease_gone__nothing_released_next_held(
    process: uuid.UUID,
) -> None:
    done = acquire(process, "j1")
    assert slot_store.release(done) == 0  # reaped meanwhile, say
    traded = trade(done, process, "j2")
    assert traded is not None and traded[0].status == "held" and traded[1] is None
    assert slot().current_jobs == 0 and slot("other").current_jobs == 1


@pytest.mark.usefixtures("engine")
def test_release_and_acquire__next_job_runs_already__duplicate_kept_slot_released(
    process: uuid.UUID,
) -> None:
    done = acquire(process, "j1")
    acquire(process, "j2", 2, tenant="other")  # a live copy of j2
    traded = trade(done, process, "j2")
    assert traded is not None and traded[0].status == "duplicate" and traded[1] == 0
    assert slot().current_jobs == 0 and slot("other").current_jobs == 1


@postgres_only
@pytest.mark.parametrize("released", ["the lower row", "the higher row"])
def test_release_and_acquire__waiting_on_the_lower_row__holds_the_higher_one_free(
    process: uuid.UUID, released: str
) -> None:
    # Two processes trading slots the other way round deadlock if either locks one slot
    # row and then waits for the other; locked in id order, a statement waiting on the
    # lower row holds nothing.
    if released == "the lower row":
        done = acquire(process, "j1")
        acquire(process, "o1", 2, tenant="other")
    else:
        acquire(process, "o1", 2, tenant="other")
        done = acquire(process, "j1")
    lower, higher = sorted([slot().pk, slot("other").pk])
    traded = run_while_locked(
        (LOCK_SLOT, [lower]), lambda: trade(done, process, "j2"),
        "the trade to wait on the lower row",
        (LOCK_SLOT + " NOWAIT", [higher]),  # raises if the trade holds it
    )  # fmt: skip
    assert traded is not None and traded[0].status == "held"
    assert slot().current_jobs == 0 and slot("other").current_jobs == 2


@postgres_only
def test_reap__slots_of_a_dead_process__locked_in_id_order() -> None:
    # reap writes several slot rows in one statement: in the table's order, it could hold
    # the higher row while waiting for the lower one that a trade holds, while the trade
    # waits for the higher one.
    dead = uuid.uuid4()
    identity.register_process(process_id=dead, node="dead@h", hostname="h", pid=2)
    acquire(dead, "d1")
    acquire(dead, "d2", tenant="other")
    lower, higher = sorted([slot().pk, slot("other").pk])
    # A newer version of the lower row lies behind the higher one: a scan meets it last.
    TenantQueueSlot.objects.filter(pk=lower).update(updated_at=timezone.now())
    long_ago = timezone.now() - timedelta(hours=1)
    WorkerProcess.objects.filter(pk=dead).update(last_heartbeat_at=long_ago)
    SlotLease.objects.filter(process_id=dead).update(acquired_at=long_ago)
    run_while_locked(
        (LOCK_SLOT, [lower]), lambda: lease_store.reap(timeout=60),
        "the reaper to wait on the lower row",
        (LOCK_SLOT + " NOWAIT", [higher]),  # raises if the reaper holds it
    )  # fmt: skip
    assert not SlotLease.objects.exists()
    assert slot().current_jobs == 0 and slot("other").current_jobs == 0


@postgres_only
def test_release_and_acquire__woken_job__its_parked_row_taken_only_once_the_slots_are_locked(
    process: uuid.UUID,
) -> None:
    # A woken job claims the lease reserved for it (own) and takes its parked row
    # (unparked). Wake and park lock the slot row before the parked row: the statement
    # must not hold the parked row while it waits for the slot row, or the two deadlock.
    done = acquire(process, "j1")
    running = acquire(process, "o1", 1, tenant="other")
    signature = '{"task": "t", "options": {"task_id": "tw"}}'
    assert slot_store.try_park(
        tenant="other", queue="q", task_id="tw", task_name="t", limit=1, signature=signature
    ) == "parked"  # fmt: skip
    assert slot_store.release(running) == 1
    assert slot_store.wake_one(slot("other").pk) is not None  # tw's reservation
    traded = run_while_locked(
        (LOCK_SLOT, [slot("other").pk]),
        lambda: trade(done, process, "tw", limit=1, woken=True),
        "the trade to wait on the slot row",
        # Raises if the trade holds the parked row.
        ("SELECT 1 FROM fair_jobs_parkedjob WHERE task_id = %s FOR UPDATE NOWAIT", ["tw"]),
    )
    assert traded is not None and traded[0].status == "held"
    assert not ParkedJob.objects.exists()
    assert slot().current_jobs == 0 and slot("other").current_jobs == 1


@postgres_only
def test_release_and_acquire__a_copy_takes_its_lease_meanwhile__nothing_happened(
    process: uuid.UUID,
) -> None:
    done = acquire(process, "j1")
    acquire(process, "o1", 3, tenant="other")
    copy = session()  # another delivery of j2, its acquire not yet committed
    copy.execute(
        "INSERT INTO fair_jobs_slotlease (slot_id, task_id, token, process_id, acquired_at)"
        " VALUES (%s, 'j2', %s, %s, now())",
        [slot("other").pk, uuid.uuid4(), process],
    )
    thread, out = in_thread(lambda: trade(done, process, "j2", limit=3))
    try:
        wait_until_blocked(thread, "the trade to wait on the copy's lease")
    finally:
        copy.commit()
        copy.close()
        thread.join(20)
    # The lease's unique key refused the trade's: its release rolled back with it, and
    # the caller releases the kept slot alone.
    assert out == [None]
    assert slot().current_jobs == 1 and SlotLease.objects.filter(task_id="j1").exists()
    assert slot("other").current_jobs == 1  # o1; the copy's insert counted nothing


def test_release_and_acquire__runs_acquire_as_written() -> None:
    # The statement repeats acquire's steps (SQL has no way to share a CTE between two
    # statements): they stay the same text, but for the wait on the locked rows, so that a
    # change to acquire cannot miss the handoff's path.
    acquire_steps = queries()["acquire"]
    acquire_steps = acquire_steps[acquire_steps.index("existing AS (") :]
    traded = queries()["release_and_acquire"]
    assert acquire_steps not in traded
    assert acquire_steps in traded.replace("       AND (SELECT count(*) FROM locked) >= 0\n", "")


# -- the job path (PostgreSQL) --------------------------------------------------------------


@pytest.fixture
def handing(in_process_worker: uuid.UUID) -> Iterator[uuid.UUID]:
    """Handoff on, in a process registered as a worker's; the kept slot released after."""
    with override_settings(FAIR_JOBS_SLOT_HANDOFF=5):
        try:
            yield in_process_worker
        finally:
            admission.release_kept()


def run(task: Any, tenant: str, task_id: str | None = None) -> Any:
    task_id = task_id or str(uuid.uuid4())
    return run_as_worker(task, (tenant, 0.0), task_id=task_id, headers={})


def library_statements(captured: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in captured.captured_queries if "fair_jobs_" in q["sql"]]


@postgres_only
def test_job_path__next_job_same_tenant__one_statement_for_its_slot(handing: uuid.UUID) -> None:
    first = str(uuid.uuid4())
    assert run(tasks.limited3, "t", first) == "t:done"
    # Ended well: its slot is kept, not released.
    assert slot("t", "fair").current_jobs == 1
    assert SlotLease.objects.get().task_id == first
    second = str(uuid.uuid4())
    with CaptureQueriesContext(connection) as captured:
        assert run(tasks.limited3, "t", second) == "t:done"
    statements = library_statements(captured)
    assert len(statements) == 1, statements  # the handoff; nothing at the job's end
    assert statements[0].lstrip().startswith("UPDATE fair_jobs_slotlease")
    assert SlotLease.objects.get().task_id == second
    assert slot("t", "fair").current_jobs == 1
    admission.release_kept()
    assert slot("t", "fair").current_jobs == 0 and not SlotLease.objects.exists()


@postgres_only
def test_job_path__next_job_other_tenant__kept_slot_released_and_its_taken_in_one_statement(
    handing: uuid.UUID,
) -> None:
    run(tasks.limited3, "t")
    second = str(uuid.uuid4())
    with CaptureQueriesContext(connection) as captured:
        assert run(tasks.limited3, "u", second) == "u:done"
    statements = library_statements(captured)
    assert len(statements) == 1, statements  # the release and the acquire together
    assert slot("t", "fair").current_jobs == 0
    assert slot("u", "fair").current_jobs == 1  # kept in turn, for the next job
    assert SlotLease.objects.get().task_id == second
    admission.release_kept()
    assert slot("u", "fair").current_jobs == 0 and not SlotLease.objects.exists()


@postgres_only
def test_job_path__job_parked_on_kept_slot__next_job_other_tenant__parked_job_woken(
    handing: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tasks.limited3, "t")  # kept: 1 of 3
    for other in ("o1", "o2"):
        acquire(handing, other, 3, tenant="t", queue="fair")
    waiting = str(uuid.uuid4())
    with monkeypatch.context() as elsewhere:
        elsewhere.setattr(ends.LEDGER, "kept", None)
        with pytest.raises(Ignore):
            run(tasks.limited3, "t", waiting)
    assert run(tasks.limited3, "u") == "u:done"
    # The kept slot was released in the next job's statement, and woke the parked job.
    assert ParkedJob.objects.get(task_id=waiting).woken_at is not None
    assert SlotLease.objects.filter(task_id=waiting, process__isnull=True).exists()
    assert slot("t", "fair").current_jobs == 3


@postgres_only
def test_job_path__next_job_other_tenant_at_its_limit__kept_slot_released_job_parks(
    handing: uuid.UUID,
) -> None:
    run(tasks.limited3, "t")
    for other in ("o1", "o2", "o3"):
        acquire(handing, other, 3, tenant="u", queue="fair")
    later = str(uuid.uuid4())
    with pytest.raises(Ignore):
        run(tasks.limited3, "u", later)
    assert ParkedJob.objects.get().task_id == later
    assert slot("t", "fair").current_jobs == 0 and handoff.take() is None


@postgres_only
def test_job_path__job_parked_on_kept_slot__woken_first_next_job_parks(
    handing: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tasks.limited3, "t")  # kept: 1 of 3
    for other in ("o1", "o2"):  # another process's jobs fill the limit
        acquire(handing, other, 3, tenant="t", queue="fair")
    waiting = str(uuid.uuid4())
    with monkeypatch.context() as elsewhere:
        # Started by another process, which keeps no slot: it finds the slot held, parks.
        elsewhere.setattr(ends.LEDGER, "kept", None)
        with pytest.raises(Ignore):
            run(tasks.limited3, "t", waiting)
    assert ParkedJob.objects.get().task_id == waiting
    later = str(uuid.uuid4())
    with pytest.raises(Ignore):  # parked
        run(tasks.limited3, "t", later)
    # The parked job went first: the kept slot was released and woke it (a reservation
    # for it holds the slot), and the later job parked behind it.
    woken = ParkedJob.objects.get(task_id=waiting)
    assert woken.woken_at is not None
    assert set(SlotLease.objects.values_list("task_id", flat=True)) == {waiting, "o1", "o2"}
    assert ParkedJob.objects.get(task_id=later).woken_at is None
    assert not JobRun.objects.filter(task_id=later).exists()


@postgres_only
def test_job_path__tenant_at_its_limit__released_at_the_end_not_kept(handing: uuid.UUID) -> None:
    run(tasks.limited1, "t")  # limit 1: the slot had no room to spare
    assert not SlotLease.objects.exists()
    assert handoff.take() is None


@postgres_only
def test_job_path__failed_job__released_at_its_end(handing: uuid.UUID) -> None:
    with pytest.raises(RuntimeError):
        run_as_worker(tasks.fails, ("t",), task_id=str(uuid.uuid4()), headers={})
    assert not SlotLease.objects.exists()
    assert handoff.take() is None


@postgres_only
def test_job_path__kept_slot_no_job_takes__released_by_the_keeper(
    in_process_worker: uuid.UUID,
) -> None:
    with override_settings(FAIR_JOBS_SLOT_HANDOFF=0.2):
        run(tasks.limited3, "t")
        wait_for(lambda: not SlotLease.objects.exists(), 20, "the keeper to release the kept slot")
    assert slot("t", "fair").current_jobs == 0
    assert handoff.take() is None


def keeper_sleeping_for_a_slot(seconds: float) -> float:
    """Leave the keeper thread idle whatever earlier tests left it doing, then keep a slot
    due in ``seconds`` and return the time the keeper now sleeps until."""
    with override_settings(FAIR_JOBS_SLOT_HANDOFF=0.2):
        run(tasks.limited3, "t")
        wait_for(lambda: not SlotLease.objects.exists(), 20, "the keeper to release it")
        wait_for(lambda: ends.LEDGER.keeper_deadline == math.inf, 20, "the keeper to wait idle")
    with override_settings(FAIR_JOBS_SLOT_HANDOFF=seconds):
        run(tasks.limited3, "t")  # wakes the idle keeper, which sleeps until it is due
        wait_for(lambda: ends.LEDGER.keeper_deadline != math.inf, 20, "the keeper to wait for it")
    due = ends.LEDGER.keeper_deadline
    assert due is not None
    return due


def count_wakes(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """A list that grows by one each time the keeper thread is woken from here on."""
    wakes: list[None] = []
    notify_all = ends.LEDGER.lock.notify_all

    def counted() -> None:
        wakes.append(None)
        notify_all()

    monkeypatch.setattr(ends.LEDGER.lock, "notify_all", counted)
    return wakes


@postgres_only
def test_keeper__busy_worker__not_woken_at_each_job_only_for_a_slot_due_sooner(
    in_process_worker: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Waking the keeper thread at every job cost the worker two context switches and a
    # fight for the GIL per job; it need wake only when a kept slot is due before the
    # time it sleeps until.
    keeper_sleeping_for_a_slot(5)
    wakes = count_wakes(monkeypatch)
    with override_settings(FAIR_JOBS_SLOT_HANDOFF=5):
        for _ in range(3):
            assert run(tasks.limited3, "t") == "t:done"
        assert wakes == []  # each next job's slot is due later than the keeper wakes
        assert slot("t", "fair").current_jobs == 1  # the last job's, kept
    with override_settings(FAIR_JOBS_SLOT_HANDOFF=0.2):
        run(tasks.limited3, "t")
        assert len(wakes) == 1  # due sooner than the keeper's 5 s: it is woken
        wait_for(lambda: not SlotLease.objects.exists(), 4, "the keeper to release it at once")
    assert slot("t", "fair").current_jobs == 0
    assert handoff.take() is None


@postgres_only
def test_keeper__next_slot_due_later__not_woken_sleeps_again_and_releases_it_when_due(
    in_process_worker: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_due = keeper_sleeping_for_a_slot(0.3)
    wakes = count_wakes(monkeypatch)
    with override_settings(FAIR_JOBS_SLOT_HANDOFF=2):
        last = str(uuid.uuid4())
        run(tasks.limited3, "t", last)
    assert wakes == []
    # The keeper wakes at the first slot's time, finds this one not due, and sleeps again.
    time.sleep(max(0.0, first_due + 0.1 - time.monotonic()))
    assert SlotLease.objects.get().task_id == last
    wait_for(lambda: not SlotLease.objects.exists(), 20, "the keeper to release it when due")
    assert slot("t", "fair").current_jobs == 0
    assert wakes == []


def test_job_path__handoff_off__released_at_the_end(in_process_worker: uuid.UUID) -> None:
    run(tasks.limited3, "t")
    assert not SlotLease.objects.exists()
    assert slot("t", "fair").current_jobs == 0


@pytest.mark.skipif(connection.vendor == "postgresql", reason="the other databases' case")
def test_job_path__not_postgresql__handoff_set__released_at_the_end(
    in_process_worker: uuid.UUID,
) -> None:
    with override_settings(FAIR_JOBS_SLOT_HANDOFF=5):
        run(tasks.limited3, "t")
    assert not SlotLease.objects.exists()
    assert handoff.take() is None


@postgres_only
@pytest.mark.parametrize("error", [InterfaceError("cut"), KeyboardInterrupt()])
@pytest.mark.parametrize(("step", "tenant"), [("hand_over", "t"), ("try_release_and_acquire", "u")])
def test_job_path__hand_over_cut__kept_slot_and_new_lease_both_cleaned_later(
    handing: uuid.UUID,
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
    step: str,
    tenant: str,
) -> None:
    run(tasks.limited3, "t")
    kept = SlotLease.objects.get()

    def cut(**kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(slot_store, step, cut)
    task_id = str(uuid.uuid4())
    with pytest.raises(type(error)):
        handoff.take_over(
            tenant=tenant, queue="fair", task_id=task_id, limit=3, node=None, woken=False,
            limited=False,
        )  # fmt: skip
    # Whatever the error, the reply may be lost after a commit: the kept lease's release
    # and the new job's possible lease are both left to the heartbeat, none forgotten.
    with ends.LEDGER.lock:
        pending = [g.token for g in ends.LEDGER.pending_releases]
        uncertain = set(ends.LEDGER.uncertain)
        ends.LEDGER.pending_releases.clear()
        ends.LEDGER.uncertain.clear()
    assert kept.token in pending
    assert (task_id, handing) in uncertain


@postgres_only
def test_job_path__trade_refused_by_the_server__kept_slot_released_at_once(
    handing: uuid.UUID,
) -> None:
    run(tasks.limited3, "t")
    task_id = str(uuid.uuid4())
    with pytest.raises(DataError):  # a tenant too long for its column: nothing happened
        handoff.take_over(
            tenant="u" * 300, queue="fair", task_id=task_id, limit=3, node=None, woken=False,
            limited=False,
        )  # fmt: skip
    # Known undone, so the kept slot is released now, not left to the heartbeat.
    assert slot("t", "fair").current_jobs == 0 and not SlotLease.objects.exists()
    with ends.LEDGER.lock:
        assert not ends.LEDGER.pending_releases and not ends.LEDGER.uncertain


@postgres_only
def test_job_path__no_keeper_thread_to_be_had__job_succeeds_slot_released(
    handing: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(ends.LEDGER, "keeper", None)
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    assert run(tasks.limited3, "t") == "t:done"
    assert not SlotLease.objects.exists()
    assert handoff.take() is None


def test_fork__child_starts_with_a_ledger_of_its_own__not_its_parents_held_lock() -> None:
    # A prefork pool forks its children while the parent's threads (the heartbeat, the
    # keeper) may hold the ledger's lock: a child that inherited it held would hang at its
    # first job, and one that inherited the kept slot would hand on its parent's lease.
    grant = Grant(slot_id=1, queue_limit_id=None, token=uuid.uuid4(), task_id="kept")
    with ends.LEDGER.lock:
        ends.LEDGER.kept = ends.Kept(grant, "t", "q", time.monotonic() + 60, None)
        ends.LEDGER.running.add("parent's job")
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its ledger is its own and free
            fresh = ends.LEDGER.lock.acquire(timeout=5)
            own = ends.LEDGER.kept is None and not ends.LEDGER.running
            os._exit(0 if fresh and own else 1)
        ends.LEDGER.kept = None
        ends.LEDGER.running.discard("parent's job")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

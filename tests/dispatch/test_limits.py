"""Caps and queue limits are filters of fair dispatch's one selection and hold for every
dispatched job (D2, D3, D10, D12 and the cap raised of D20 in the dispatch review): a
tenant's cap is the running task's own, a queue limit or pause bounds the queue's room, a
job the fence refuses goes back without its line cycling through the broker, and tenants
that cannot be chosen stay out of the selection's index."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from django_fair_jobs import admission, dispatch, queue_limits, slots
from django_fair_jobs.dispatch.models import (
    DISPATCHED,
    RUNNING,
    DispatchJob,
    DispatchQueue,
    DispatchTenant,
)
from django_fair_jobs.models import QueueLimit
from tests.dispatch.conftest import deliver, job_of, set_capacity
from tests.sessions import session
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("engine", "in_process_worker"),
]


@pytest.fixture(autouse=True)
def published(collected: list[int]) -> list[int]:
    """Nothing reaches a broker: the jobs dispatched are collected (row ids)."""
    return collected


def pump(published: list[int]) -> None:
    """Dispatch into the queue's room, as maintenance does, collecting what it dispatched."""
    published.extend(r.job_id for r in dispatch.dispatch("fair"))


def test_d2__a_paused_queue__nothing_dispatched(published: list[int]) -> None:
    queue_limits.set_limits("fair", max_jobs=0)
    set_capacity(2)
    tasks.dispatched.delay("acme")
    tasks.dispatched.delay("acme")
    assert published == []
    assert dispatch.dispatch("fair") == []


def test_d2__a_queue_limit_bounds_the_queues_room(published: list[int]) -> None:
    queue_limits.set_limits("fair", max_jobs=1)
    set_capacity(3)
    for tenant in ("a", "b", "c"):
        tasks.dispatched.delay(tenant)
    assert len(published) == 1


def test_d2__a_limit_per_worker_bounds_the_queues_room_by_its_nodes(published: list[int]) -> None:
    # Two nodes with at most one job each: two dispatched of four, whatever the capacity;
    # with a global limit of one beside it, the lower bound holds.
    queue_limits.set_limits("fair", max_jobs_per_worker=1)
    DispatchQueue.objects.update_or_create(queue="fair", defaults={"capacity": 4, "nodes": 2})
    for tenant in ("a", "b", "c", "d"):
        tasks.dispatched.delay(tenant)
    assert len(published) == 2
    assert dispatch.room() == {"fair": 0}
    queue_limits.set_limits("fair", max_jobs=3)
    assert dispatch.room() == {"fair": 0}  # 3 - 2 in flight = 1, but 2 x 1 - 2 = 0
    queue_limits.set_limits("fair", max_jobs_per_worker=2)  # room for 1: dispatched at once
    assert (len(published), dispatch.room()) == (3, {"fair": 0})  # 2 x 2 - 2, but 3 - 2


def test_d2__a_job_without_a_cap__takes_its_queue_place__refused_when_paused(
    published: list[int],
) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    assert published == [job.pk]
    queue_limits.set_limits("fair", max_jobs=0)  # paused after the job was dispatched
    assert deliver(job) == "not run"
    assert DispatchJob.objects.get(pk=job.pk).state in (0, 1)  # back, not lost
    queue_limits.set_limits("fair", max_jobs=1)
    DispatchJob.objects.filter(pk=job.pk, state=0).update(
        not_before=timezone.now() - timedelta(seconds=1)
    )
    dispatch.dispatch("fair")
    job = DispatchJob.objects.get(pk=job.pk)
    assert job.state == DISPATCHED
    assert deliver(job) == "ran"
    assert QueueLimit.objects.get(queue="fair").current_jobs == 0  # its place given back


def test_d3__another_tasks_enqueue_never_removes_a_tasks_cap(published: list[int]) -> None:
    capped = [job_of(tasks.dispatched_capped.delay("acme").id) for _ in range(5)]
    tasks.dispatched.delay("acme")  # a task without a cap, for the same tenant and queue
    set_capacity(6)
    pump(published)
    assert len([j for j in published if j in {c.pk for c in capped}]) == 2
    started = dispatch.start(capped[0].pk, uuid.uuid4())
    assert (started.status, started.cap) == ("started", 2)


def test_d3__a_capped_tasks_enqueue_never_caps_another_task(published: list[int]) -> None:
    free = [job_of(tasks.dispatched.delay("acme").id) for _ in range(4)]
    tasks.dispatched_capped.delay("acme")
    set_capacity(4)
    pump(published)
    assert sorted(published) == sorted(j.pk for j in free)
    assert dispatch.start(free[0].pk, uuid.uuid4()).cap is None


def fill_acmes_slot() -> None:
    """Two leases of jobs of another task fill acme's slot of ``dispatched_capped``'s cap
    (2), as a job admitted by tenant slots would."""
    for _ in range(2):
        admission.acquire(
            tenant="acme", queue="fair", task_id=str(uuid.uuid4()), limit=2, node=None,
            woken=False,
        )  # fmt: skip


def test_d10__a_refused_fence__the_tenants_line_does_not_cycle(published: list[int]) -> None:
    set_capacity(1)
    jobs = [job_of(tasks.dispatched_capped.delay("acme").id) for _ in range(3)]
    assert published == [jobs[0].pk]
    fill_acmes_slot()  # by jobs of another task, between the dispatch and the start
    assert deliver(jobs[0], tasks.dispatched_capped) == "not run"
    # The job is back; no other job of acme's was dispatched into the room it left, and
    # the next dispatch does not pick acme's line again while its slot is full.
    pump(published)
    assert published == [jobs[0].pk]
    assert not DispatchJob.objects.filter(state=DISPATCHED).exists()


def test_d10__a_refused_fence__its_end_dispatches_nothing_into_the_room(
    published: list[int],
) -> None:
    # A refusal can come from what the room does not see (a slot filled by another task,
    # this node at its per-worker limit): a job dispatched into the room at the refusal
    # could be refused in turn, and so on through the broker. The room waits for the
    # next dispatch (the due poll, maintenance, an end), which has the whole queue to see.
    set_capacity(1)
    capped = job_of(tasks.dispatched_capped.delay("acme").id)
    other = job_of(tasks.dispatched.delay("beta").id)
    assert published == [capped.pk]
    fill_acmes_slot()  # by jobs of another task, before the start
    assert deliver(capped, tasks.dispatched_capped) == "not run"
    assert published == [capped.pk]  # nothing at the refusal
    pump(published)
    assert published == [capped.pk, other.pk]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's tuple counts")
def test_d12__ineligible_tenants__the_choice_reads_as_few_rows_as_when_all_are_eligible(
    engine: str,
) -> None:
    if engine != "sql":
        pytest.skip("the statement's tuple counts are the PostgreSQL store's")

    def buffers_of_one_dispatch() -> int:
        """The shared buffers one dispatch of one job reads, from the plan of its
        statement (auto_explain, which counts the function's own statements in it)."""
        with session() as look:
            notices: list[str] = []
            look.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
            for setting in (
                "LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                "SET auto_explain.log_analyze = on", "SET auto_explain.log_buffers = on",
                "SET client_min_messages = log",
            ):  # fmt: skip
                look.execute(setting)
            # Twice: the first call of a session also reads the catalogs to plan (and
            # finds the paused tenants); each call dispatches the one eligible job.
            for _ in range(2):
                notices.clear()
                chosen = look.execute("SELECT * FROM fair_jobs_dispatch('fair', 1)").fetchall()
                assert len(chosen) == 1
            look.rollback()
        (plan,) = [n for n in notices if "fair_jobs_dispatch('fair', 1)" in n]
        found = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
        assert found is not None, plan
        return int(found.group(1)) + int(found.group(2) or 0)

    set_capacity(0)
    tenants = [f"t{i:04d}" for i in range(400)]
    dispatch.enqueue_many(
        [
            dispatch.Job(
                queue="fair",
                tenant=t,
                task_name=tasks.dispatched.name,
                task_id=f"id-{t}-{n}",
                message="{}",
                not_before=None,
                weight=None,
                cap=None,
            )
            for t in tenants
            for n in range(3 if t == tenants[-1] else 1)  # the eligible one has a few
        ]
    )
    set_capacity(1000)
    eligible = buffers_of_one_dispatch()
    set_capacity(0)  # so that the pauses dispatch nothing: every line keeps its job
    for tenant in tenants[:-1]:
        slots.set_tenant_limit(tenant, "fair", 0)  # paused, as an operator pauses them
    set_capacity(1000)
    assert DispatchTenant.objects.filter(waiting__gt=0).count() == len(tenants)
    paused = buffers_of_one_dispatch()
    assert paused <= 1.3 * eligible + 2, (paused, eligible)


def test_d20__a_cap_raised__dispatches_at_once(published: list[int]) -> None:
    set_capacity(4)
    slots.set_tenant_limit("acme", "fair", 0)
    tasks.dispatched.delay("acme")
    assert published == []
    slots.set_tenant_limit("acme", "fair", 2)
    assert len(published) == 1
    assert DispatchTenant.objects.get(tenant="acme").in_flight == 1


def test_a_slot_raised_above_the_tasks_cap__unblocks_its_line_at_once(
    published: list[int],
) -> None:
    # The line's cap is its task's fair_max_jobs (2); a tenant slot's max_jobs overrides
    # it. Raised to 4, the line stayed blocked (the unblock compared with the task's cap
    # only) until a job of the tenant ended, or for good through the maintenance pass.
    set_capacity(8)
    for _ in range(4):
        tasks.dispatched_capped.delay("acme")
    assert len(published) == 2 and DispatchTenant.objects.get(tenant="acme").blocked
    slots.set_tenant_limit("acme", "fair", 4)
    assert len(published) == 4
    assert DispatchTenant.objects.get(tenant="acme").in_flight == 4


def test_a_job_started_before_its_fence__still_counts_against_the_queue_limit(
    published: list[int],
) -> None:
    # Between a dispatched job's start (its row running) and its fence (the queue place
    # it takes), and between the place released and its end flushed, the job counted
    # nowhere in a limited queue's room: a start carrying ends dispatched one more than
    # the limit, and the fence refused it (its line blocked, nothing of it in flight).
    queue_limits.set_limits("fair", max_jobs=2)
    set_capacity(10)
    for tenant in ("a", "b", "c"):
        tasks.dispatched.delay(tenant)
    assert len(published) == 2
    first = published[0]
    assert dispatch.start(first, uuid.uuid4()).status == "started"
    assert dispatch.room() == {"fair": 0}
    pump(published)
    assert len(published) == 2


def test_a_retry_sharing_its_task_id__its_lease_counted_once_against_the_queue_limit(
    published: list[int],
) -> None:
    # A retry's new row shares its task id with the row that ran it, still running until
    # its end is flushed: the room matched the one lease to both rows (counted twice), one
    # place too many, which the fence refused.
    from django_fair_jobs.models import SlotLease

    queue_limits.set_limits("fair", max_jobs=3)
    set_capacity(10)
    first, second = uuid.uuid4(), uuid.uuid4()
    ran = job_of(tasks.dispatched.delay("a").id)
    assert dispatch.start(ran.pk, first).status == "started"
    retry = DispatchJob.objects.create(
        queue="fair", tenant="a", task_name=ran.task_name, task_id=ran.task_id,
        message=ran.message, state=RUNNING, process_id=second,
    )  # fmt: skip
    limit = QueueLimit.objects.get(queue="fair")
    SlotLease.objects.create(
        task_id=ran.task_id, token=uuid.uuid4(), queue_limit=limit, process_id=second
    )
    QueueLimit.objects.filter(pk=limit.pk).update(current_jobs=1)
    assert DispatchJob.objects.filter(state=RUNNING).count() == 2 and retry.pk != ran.pk
    assert dispatch.room() == {"fair": 1}  # 3 places: the lease, and the first row's


def block_at_the_capped_tasks_cap(published: list[int]) -> None:
    """acme's line blocked at its head's task cap: two of three jobs of the capped task
    (``fair_max_jobs = 2``) dispatched, the third at the head of the line."""
    set_capacity(8)
    for _ in range(3):
        tasks.dispatched_capped.delay("acme")
    assert len(published) == 2 and DispatchTenant.objects.get(tenant="acme").blocked


def test_a_cancel_moving_a_blocked_lines_head_to_an_uncapped_task__dispatches_it(
    published: list[int],
) -> None:
    # A line blocked at its head's task cap stayed blocked when a cancel of that task's
    # jobs moved its head to a job of an uncapped task: the job waited for the next end of
    # the tenant's capped jobs, however long they ran.
    from django_fair_jobs import backlog

    block_at_the_capped_tasks_cap(published)
    assert dispatch._store().unblock("acme", "fair") == []  # still at its cap: kept out
    uncapped = tasks.dispatched.delay("acme")
    assert len(published) == 2 and DispatchTenant.objects.get(tenant="acme").blocked
    assert backlog.cancel("acme", queue="fair", task=tasks.dispatched_capped.name).total == 1
    pump(published)
    assert published[2:] == [job_of(uncapped.id).pk]


def test_a_countdown_come_due_at_the_head_of_a_blocked_line__dispatched_by_its_own_cap(
    published: list[int],
) -> None:
    # A countdown of an uncapped task, stored before the capped jobs that blocked its
    # line, leads the line once due (the oldest job first); the line stayed blocked at the
    # capped task's cap, so the countdown waited for the end of a job of another task.
    later = tasks.dispatched.apply_async(("acme",), countdown=3600)
    block_at_the_capped_tasks_cap(published)
    DispatchJob.objects.filter(task_id=later.id).update(
        not_before=timezone.now() - timedelta(seconds=1)
    )
    pump(published)
    assert published[2:] == [job_of(later.id).pk]


def test_a_tenants_first_line_under_its_full_tenant_slot__blocked__nothing_dispatched(
    published: list[int],
) -> None:
    # The tenant's slot on the queue is full (its jobs of tenant slots hold both places of
    # the task's cap). A new line was made unblocked on PostgreSQL: its job was dispatched
    # for the fence to refuse, set aside and tried again, a publish and a start wasted.
    from django_fair_jobs.models import TenantQueueSlot

    set_capacity(8)
    TenantQueueSlot.objects.create(tenant="acme", queue="fair", current_jobs=2)
    tasks.dispatched_capped.delay("acme")
    assert published == [] and DispatchTenant.objects.get(tenant="acme").blocked
    # Unblocked while the slot is still full, it would be dispatched for the fence to
    # refuse: it stays blocked, and its queue is not named for a dispatch.
    assert dispatch._store().unblock("acme", "fair") == []
    assert DispatchTenant.objects.get(tenant="acme").blocked
    TenantQueueSlot.objects.filter(tenant="acme").update(current_jobs=1)
    dispatch.unblock(tenant="acme", queue="fair")
    assert len(published) == 1


def test_a_maintenance_pass__unblocks_a_line_whose_room_came_back_unannounced(
    published: list[int],
) -> None:
    # A tenant slot freed by a step that announces nothing (a slot row changed by hand, a
    # count set right) leaves the line blocked; the maintenance pass unblocks it and its
    # queue is dispatched, with no end of the tenant's to wait for.
    import uuid

    from django_fair_jobs import identity
    from django_fair_jobs.maintenance import run_maintenance
    from django_fair_jobs.models import TenantQueueSlot

    identity.register_process(  # the queue's capacity, as the pass counts it
        process_id=uuid.uuid4(), node="n@h", hostname="h", pid=1, queues=["fair"], concurrency=8
    )
    set_capacity(8)
    TenantQueueSlot.objects.create(tenant="acme", queue="fair", current_jobs=2)
    tasks.dispatched_capped.delay("acme")
    assert published == [] and DispatchTenant.objects.get(tenant="acme").blocked
    TenantQueueSlot.objects.filter(tenant="acme").update(current_jobs=1)
    run_maintenance(timeout=60.0)
    assert len(published) == 1
    assert not DispatchTenant.objects.get(tenant="acme").blocked


def test_a_cancel_inside_the_callers_transaction__dispatches_the_line_it_freed_after_commit(
    published: list[int],
) -> None:
    # The cancel's dispatch published the freed line's job before the caller's transaction
    # (ATOMIC_REQUESTS, an admin action) committed: a worker could start it while its row
    # still read as waiting, and the line's row stayed locked across the broker's I/O.
    from django.db import transaction

    from django_fair_jobs import backlog

    block_at_the_capped_tasks_cap(published)
    uncapped = tasks.dispatched.delay("acme")
    with transaction.atomic():
        backlog.cancel("acme", queue="fair", task=tasks.dispatched_capped.name)
        assert len(published) == 2
    assert published[2:] == [job_of(uncapped.id).pk]


def test_a_job_the_fence_refused__come_due__its_line_stays_blocked_until_its_room_comes_back(
    published: list[int],
) -> None:
    # The fence refused the job for a reason a line's cap does not know (a queue limit's
    # per-worker cap, on the node that received it): aside for FENCE_DELAY, its line
    # blocked. Come due, it leads its line again, and the due step set the line's blocked
    # by the cap rule alone: the job went round the broker to the full node once a second.
    set_capacity(4)
    job = job_of(tasks.dispatched.delay("acme").id)
    assert published == [job.pk]
    process = uuid.uuid4()
    assert dispatch.start(job.pk, process).status == "started"
    dispatch.end(job.pk, process, outcome="later", delay=dispatch.FENCE_DELAY, block=True)
    DispatchJob.objects.filter(pk=job.pk).update(not_before=timezone.now() - timedelta(seconds=1))
    pump(published)
    assert published == [job.pk] and DispatchTenant.objects.get(tenant="acme").blocked
    dispatch.unblock(tenant="acme", queue="fair")  # its room came back (maintenance)
    assert published == [job.pk, job.pk]


def test_a_start_from_the_line__blocks_the_line_when_it_fills_the_cap__not_before(
    published: list[int],
) -> None:
    # A job put back in its line (a reap, a fence's database error) and started from there
    # by its redelivered message takes a place of the line's room, so the line is judged
    # again against its new head's cap: blocked when the start filled it, open otherwise.
    block_at_the_capped_tasks_cap(published)
    first, second = published
    process = uuid.uuid4()
    dispatch.start(first, process)
    dispatch.start(second, process)
    dispatch.end(second, process, outcome="back", limit=0)
    dispatch.end(first, process, outcome="back", limit=0)
    line = DispatchTenant.objects.get(tenant="acme")
    assert (line.in_flight, line.waiting, line.blocked) == (0, 3, False)
    assert dispatch.start(first, uuid.uuid4()).status == "started"  # its redelivered copy
    assert not DispatchTenant.objects.get(tenant="acme").blocked  # one place of two left
    assert dispatch.start(second, uuid.uuid4()).status == "started"
    line = DispatchTenant.objects.get(tenant="acme")
    assert (line.in_flight, line.waiting, line.blocked) == (2, 1, True)


def test_a_slot_lowered_to_the_lines_jobs_in_flight__nothing_more_dispatched(
    published: list[int],
) -> None:
    # The line of an uncapped task is open with two jobs in flight; its tenant slot is
    # lowered to 2, which leaves it no room but does not block it: the selection, which
    # finds it first when the queue grows, must compare its count with the slot's cap
    # (at it, not only above it) and block it, not dispatch a third job for the fence
    # to refuse.
    set_capacity(2)
    for _ in range(4):
        tasks.dispatched.delay("acme")
    assert len(published) == 2 and not DispatchTenant.objects.get(tenant="acme").blocked
    slots.set_tenant_limit("acme", "fair", 2)
    set_capacity(8)
    pump(published)
    assert len(published) == 2
    line = DispatchTenant.objects.get(tenant="acme")
    assert (line.in_flight, line.waiting, line.blocked) == (2, 2, True)


def test_a_dispatch_that_fills_its_lines_cap__blocks_the_line__though_the_room_ends_with_it(
    published: list[int],
) -> None:
    # The dispatch that brings a line to its cap marks it blocked in the same update, not
    # at the next dispatch that would find it at its cap: here the queue's room runs out
    # with that job, and the line, at its cap with a job waiting, is blocked (out of the
    # selection's index) and counted so by the status views.
    from django_fair_jobs import status

    set_capacity(0)
    for _ in range(3):
        tasks.dispatched_capped.delay("acme")  # fair_max_jobs=2
    set_capacity(2)
    pump(published)
    assert len(published) == 2
    line = DispatchTenant.objects.get(tenant="acme")
    assert (line.in_flight, line.waiting, line.blocked) == (2, 1, True)
    (row,) = [d for d in status.snapshot()["dispatch"] if d["queue"] == "fair"]
    assert row["blocked_tenants"] == 1

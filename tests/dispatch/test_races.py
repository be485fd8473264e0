"""Dispatch under concurrency, with real PostgreSQL sessions."""

from __future__ import annotations

import uuid

import pytest
from celery.result import AsyncResult
from django.db import connection

from django_fair_jobs import backlog, dispatch, identity, sql
from django_fair_jobs.dispatch.models import (
    DISPATCHED,
    WAITING,
    DispatchJob,
    DispatchQueue,
    DispatchTenant,
)
from tests.sessions import in_thread, run_while_open, session, wait_until_blocked
from tests.testapp import tasks

pytestmark = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="two sessions racing need PostgreSQL"
)


@pytest.mark.django_db(transaction=True)
def test_refresh_capacity__the_queue_row_inserted_meanwhile_by_another_refresh__no_error() -> None:
    # Two worker processes start at once and both compute their queue's capacity: the
    # second finds no row, waits on the first's insert, and must not fail on the duplicate
    # key (the queue would keep no capacity until the next maintenance pass).
    identity.register_process(
        process_id=uuid.uuid4(), node="n@h", hostname="h", pid=1, queues=["race"], concurrency=2
    )
    other = session()
    other.execute(
        "INSERT INTO fair_jobs_dispatchqueue (queue, capacity, slack, nodes, updated_at)"
        " VALUES ('race', 1, 0, 1, now()) ON CONFLICT (queue) DO NOTHING"
    )  # uncommitted: its transaction is open, as the other refresh's is mid-statement
    run_while_open(
        other,
        lambda: dispatch.refresh_capacity(slack_per_node=0, timeout=60),
        "the refresh to wait on the other's row",
    )
    assert DispatchQueue.objects.get(queue="race").capacity == 2


def _line(tenant: str) -> DispatchTenant:
    return DispatchTenant.objects.get(queue="fair", tenant=tenant)


@pytest.mark.django_db(transaction=True)
def test_cancel_while_a_dispatch_holds_the_line__the_dispatched_job_goes_on() -> None:
    DispatchQueue.objects.create(queue="fair", capacity=0)
    ids = [tasks.dispatched.delay("flood").id for _ in range(5)]
    DispatchQueue.objects.filter(queue="fair").update(capacity=1)
    held = session()
    (chosen,) = held.execute("SELECT job_id FROM fair_jobs_dispatch('fair', 1)").fetchall()
    thread, out = in_thread(lambda: backlog.cancel("flood", queue="fair"))
    try:
        wait_until_blocked(thread, "the cancel to wait on the dispatch's line")
        assert thread.is_alive(), out  # it waited for the dispatch, rather than going ahead
    finally:
        held.commit()
        held.close()
        thread.join(20)
    (done,) = out
    assert isinstance(done, backlog.Cancelled), done
    dispatched = DispatchJob.objects.get(pk=chosen[0])
    assert dispatched.state == DISPATCHED and dispatched.task_id == ids[0]
    assert sorted(done.task_ids) == sorted(ids[1:])
    line = _line("flood")
    assert (line.waiting, line.head_id, line.in_flight) == (0, None, 1)
    assert str(AsyncResult(ids[0]).state) != "REVOKED"


@pytest.mark.django_db(transaction=True)
def test_dispatch_while_a_cancel_holds_the_line__takes_another_tenant_never_a_cancelled_job() -> (
    None
):
    DispatchQueue.objects.create(queue="fair", capacity=0)
    flood = [tasks.dispatched.delay("flood").id for _ in range(3)]
    small = tasks.dispatched.delay("small").id
    DispatchQueue.objects.filter(queue="fair").update(capacity=1)
    statements = sql.queries()
    params = {"queue": "fair", "tenant": "flood", "task_name": None, "max": 1000}
    held = session()
    held.execute(statements["dispatch_lock_line"], params)
    cancelled = [row[0] for row in held.execute(statements["dispatch_cancel"], params)]
    assert sorted(cancelled) == sorted(flood)
    thread, out = in_thread(lambda: dispatch.dispatch("fair"))
    try:
        # Dispatch skips a line another transaction holds: it ends without waiting, while
        # the cancel's transaction is still open.
        wait_until_blocked(thread, "the dispatch to end, or wait on the cancel's line")
        thread.join(2)
        assert not thread.is_alive(), "the dispatch waits for the cancel's line"
    finally:
        held.commit()
        held.close()
        thread.join(20)
    (ready,) = out
    assert not isinstance(ready, BaseException), ready
    assert [DispatchJob.objects.get(pk=r.job_id).task_id for r in ready] == [small]
    assert not DispatchJob.objects.filter(task_id__in=flood).exists()
    assert (_line("flood").waiting, _line("flood").in_flight) == (0, 0)
    assert dispatch.in_flight() == {"fair": 1}


@pytest.mark.django_db(transaction=True)
def test_an_end_while_an_enqueue_commits__the_room_it_left_is_found_by_the_due_poll() -> None:
    # The enqueue reads the queue's room (none) with its tenant's line held, and commits a
    # moment later; the end that frees the room meanwhile cannot see the enqueue's job (not
    # committed yet), so neither dispatches it. The due poll (every
    # FAIR_JOBS_DISPATCH_POLL_INTERVAL) must find the queue, or the job waits with room
    # free until the next end or maintenance pass (10 s by default).
    process = uuid.uuid4()
    identity.register_process(process_id=process, node="n@h", hostname="h", pid=1)
    DispatchQueue.objects.create(queue="fair", capacity=1)
    busy = DispatchJob.objects.get(task_id=tasks.dispatched.delay("busy").id)
    assert dispatch.start(busy.pk, process).status == "started"
    other = session()
    enqueued = other.execute(
        "SELECT * FROM fair_jobs_enqueue('fair', 'newcomer', 'tests.dispatched', 'x-1', '{}',"
        " 0, NULL, NULL, NULL, 0::smallint, true)"
    ).fetchall()
    assert enqueued == []  # no room: the busy job runs
    try:
        assert dispatch.end_many([busy.pk], process) == []  # it cannot see the newcomer
    finally:
        other.commit()
        other.close()
    newcomer = DispatchJob.objects.get(task_id="x-1")
    assert newcomer.state == WAITING  # with room free: neither dispatched it
    assert dispatch.due_queues(["fair"]) == ["fair"]
    assert [r.job_id for r in dispatch.dispatch("fair")] == [newcomer.pk]


@pytest.mark.django_db(transaction=True)
def test_two_dispatches_at_once__a_queue_limit_holds_at_dispatch(collected: list[int]) -> None:
    # A queue's room is read, not locked: two dispatches of a limited queue at once must
    # not both fill the room its limit leaves, or the start fence refuses the excess (each
    # refused job set aside, its line blocked). They take turns; the second sees the first.
    from django_fair_jobs import queue_limits

    queue_limits.set_limits("fair", max_jobs=2)
    DispatchQueue.objects.update_or_create(queue="fair", defaults={"capacity": 0})
    for tenant in ("a", "b", "c", "d"):
        tasks.dispatched.delay(tenant)
    DispatchQueue.objects.filter(queue="fair").update(capacity=10)
    held = session()
    first = held.execute("SELECT job_id FROM fair_jobs_dispatch('fair', 1000, -1)").fetchall()
    assert len(first) == 2
    second = run_while_open(
        held, lambda: dispatch.dispatch("fair"), "the second dispatch to wait for the first"
    )
    assert second == []
    assert DispatchJob.objects.filter(state=DISPATCHED).count() == 2


@pytest.mark.django_db(transaction=True)
def test_two_first_enqueues_of_a_tenant_at_once__one_line_both_jobs_in_it() -> None:
    # The first two jobs of a tenant with no line, enqueued at once: the second's insert
    # of the line waits on the first's (same key), finds it when the first commits, and
    # must update it on its next turn, neither failing on the duplicate key nor leaving
    # its job out of the line.
    DispatchQueue.objects.create(queue="fair", capacity=0)
    other = session()
    other.execute(
        "SELECT * FROM fair_jobs_enqueue('fair', 'new', 'tests.dispatched', 'x-1', '{}',"
        " 0, NULL, NULL, NULL, 0::smallint, true)"
    ).fetchall()  # uncommitted: its transaction is open, its line inserted
    run_while_open(
        other,
        lambda: tasks.dispatched.delay("new"),
        "the second enqueue to wait on the first's line",
    )
    first = DispatchJob.objects.get(task_id="x-1")
    line = _line("new")
    assert (line.waiting, line.head_id) == (2, first.pk)
    assert DispatchJob.objects.filter(tenant="new", state=WAITING).count() == 2

"""Fair dispatch's lock order, with real PostgreSQL sessions: a second session holds what
another step holds at its longest, and the step under test must finish meanwhile, never
wait on those rows out of order (deadlocks D1 a-d of the dispatch review), and no step of a
job's path writes or waits for a row shared by the whole queue (D7, D11, D14).

The order (docs/how-it-works.md, "Lock order"): a tenant's line, then its waiting or
scheduled jobs; a dispatched or running job, then its line; a line held by another
transaction is skipped, never waited for, by any step that did not come for that line.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from django_fair_jobs import dispatch, identity
from django_fair_jobs.dispatch.models import DispatchJob, DispatchQueue, DispatchTenant
from tests.conftest import wait_for
from tests.dispatch.conftest import job_of, set_capacity
from tests.sessions import (
    finishes_while_held,
    in_thread,
    run_while_locked,
    run_while_open,
    session,
    wait_until_blocked,
)
from tests.testapp import tasks

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="sessions racing need PostgreSQL"),
    pytest.mark.django_db(transaction=True),
]

PROCESS = uuid.uuid4()


@pytest.fixture(autouse=True)
def published(collected: list[int]) -> list[int]:
    """Nothing reaches a broker: the jobs dispatched are collected (row ids)."""
    return collected


def job_id(task_id: str) -> int:
    return job_of(task_id).pk


def running(tenant: str) -> int:
    """A job of ``tenant`` dispatched and started under :data:`PROCESS`."""
    job = job_id(tasks.dispatched.delay(tenant).id)
    assert dispatch.start(job, PROCESS).status == "started"
    return job


def due_countdown(tenant: str) -> int:
    """A job of ``tenant`` stored with a countdown that has come due."""
    job = job_id(tasks.dispatched.apply_async((tenant,), countdown=60).id)
    DispatchJob.objects.filter(pk=job).update(not_before=timezone.now() - timedelta(seconds=1))
    return job


def line_lock(tenant: str, queue: str = "fair") -> tuple[str, list[object]]:
    """What a step of ``tenant``'s line holds while it runs (an end, an enqueue, a cancel)."""
    return (
        "SELECT id FROM fair_jobs_dispatchtenant WHERE queue = %s AND tenant = %s FOR UPDATE",
        [queue, tenant],
    )


QUEUE_ROW = ("SELECT queue FROM fair_jobs_dispatchqueue WHERE queue = %s FOR UPDATE", ["fair"])


def test_d1a__an_end_never_waits_for_another_tenants_line_come_due() -> None:
    set_capacity(10)
    x = running("x")
    running("y")
    due_countdown("y")
    # An end of y's job holds y's line; the end of x moves the countdowns come due into
    # their lines: it skips y's (the next dispatch moves it) instead of waiting for it.
    finishes_while_held(line_lock("y"), lambda: dispatch.end(x, PROCESS), "the end of x")
    assert not DispatchJob.objects.filter(pk=x).exists()


def test_d1b__an_enqueue_never_waits_for_another_tenants_line_come_due() -> None:
    set_capacity(10)
    running("z")
    due_countdown("z")
    finishes_while_held(line_lock("z"), lambda: tasks.dispatched.delay("w"), "delay() for w")
    assert DispatchJob.objects.filter(tenant="w").count() == 1


def test_d1c__the_due_poll_never_waits_for_a_line_another_step_holds() -> None:
    set_capacity(10)
    running("z")
    due = due_countdown("z")
    finishes_while_held(line_lock("z"), lambda: dispatch.dispatch("fair"), "the due poll")
    # Once the line is free, the next dispatch moves it.
    dispatch.dispatch("fair")
    assert DispatchJob.objects.get(pk=due).state != 0


def test_d1d__a_start_from_the_line_takes_the_line_before_the_job() -> None:
    # A job went back to its line (its worker was presumed dead); the broker's copy of it
    # starts while a dispatch holds the line and comes for the same job: the start must
    # wait on the line first, never hold the job row while it waits.
    set_capacity(10)
    job = running("t")
    set_capacity(0)  # so that its end dispatches nothing: it stays in line
    dispatch.end(job, PROCESS, outcome="back")  # back in line, as the reap puts it
    assert DispatchJob.objects.get(pk=job).state == 1
    started = run_while_locked(
        line_lock("t"),
        lambda: dispatch.start(job, uuid.uuid4()),
        "the start to wait on the line",
        ("SELECT id FROM fair_jobs_dispatchjob WHERE id = %s FOR UPDATE NOWAIT", [job]),
    )
    assert started.status == "started"


def test_d7__delay_inside_atomic__holds_no_line_and_no_queue_row() -> None:
    set_capacity(10)
    other = running("x")
    with transaction.atomic():
        tasks.dispatched.delay("w")
        # While the caller's transaction is open, the end of another job on the queue
        # goes on, and the caller holds neither the queue's row nor w's line.
        thread, out = in_thread(lambda: dispatch.end(other, PROCESS))
        wait_until_blocked(thread, "the end of x")
        thread.join(5)
        assert not thread.is_alive(), "the end waits for the caller's transaction"
        assert not isinstance(out[0], BaseException), out
        for statement, params in (QUEUE_ROW, line_lock("w")):
            with session() as look:
                look.execute(statement + " NOWAIT", params)  # raises if the caller holds it
    # After the commit the job enters its line and is dispatched.
    assert DispatchJob.objects.get(tenant="w").state == 2


def test_d11__refresh_capacity_holds_no_queue_while_it_waits_for_another() -> None:
    from django_fair_jobs import identity

    set_capacity(1, queue="a")
    set_capacity(1, queue="z")
    identity.register_process(
        process_id=uuid.uuid4(),
        node="n@h",
        hostname="h",
        pid=1,
        queues=["a", "fair"],
        concurrency=2,
    )
    held = session()
    held.execute("SELECT queue FROM fair_jobs_dispatchqueue WHERE queue = 'z' FOR UPDATE")
    thread, out = in_thread(lambda: dispatch.refresh_capacity(slack_per_node=0, timeout=60))
    try:
        wait_until_blocked(thread, "the refresh to wait on z's row")
        # Whatever the refresh waits for, queue a's new capacity is in, and a's steps go on.
        assert DispatchQueue.objects.get(queue="a").capacity == 2
        tasks.dispatched.delay("x")
        assert DispatchJob.objects.get(tenant="x").state == 2
    finally:
        held.rollback()
        held.close()
        thread.join(20)
    assert not isinstance(out[0], BaseException), out


def test_d14__enqueue_start_end_and_dispatch_never_write_the_queue_row() -> None:
    set_capacity(2)
    jobs = [job_id(tasks.dispatched.delay("a").id) for _ in range(3)]

    def a_jobs_life() -> None:
        assert dispatch.start(jobs[0], PROCESS).status == "started"
        dispatch.end(jobs[0], PROCESS)
        tasks.dispatched.delay("b")
        dispatch.dispatch("fair")

    finishes_while_held(QUEUE_ROW, a_jobs_life, "a job's life on the queue")


def test_a_start_carrying_ends__its_own_job_first__then_the_ended_jobs_lines() -> None:
    # The start of a process's next job carries the ends of its last ones: it takes its
    # job's row first, then the ended jobs' rows and lines, and never holds a line while
    # it waits for another (order 1 of How it works).
    import psycopg

    set_capacity(10)
    ended = running("a")
    following = job_id(tasks.dispatched.delay("b").id)
    held = session()
    held.execute(*line_lock("a"))  # as an enqueue or an end of a's line holds it

    def probe() -> None:
        with session() as look:
            statement, params = line_lock("b")
            look.execute(statement + " NOWAIT", params)  # no line held while it waits
            look.rollback()
            with pytest.raises(psycopg.errors.LockNotAvailable):  # its own job taken first
                look.execute(
                    "SELECT id FROM fair_jobs_dispatchjob WHERE id = %s FOR UPDATE NOWAIT",
                    [following],
                )

    started = run_while_open(
        held,
        lambda: dispatch.start(following, PROCESS, ended=[ended]),
        "the carrying start to wait on a's line",
        probe,
    )
    assert started.status == "started"
    assert not DispatchJob.objects.filter(pk=ended).exists()


def back_in_line(tenant: str) -> int:
    """A job of ``tenant`` that went back to its line, as the reap puts it (its copy in
    the broker may still start it)."""
    job = running(tenant)
    DispatchQueue.objects.filter(queue="fair").update(capacity=0)  # its end dispatches none
    dispatch.end(job, PROCESS, outcome="back")
    DispatchQueue.objects.filter(queue="fair").update(capacity=10)
    assert DispatchJob.objects.get(pk=job).state == 1
    return job


def holds_no_line_while_waiting(work: Callable[[], Any], waits_for: str, free: str) -> Any:
    """Run ``work`` while a second session holds ``waits_for``'s line (as an end_many or
    enqueue_many of both tenants does); once ``work`` waits for it, ``free``'s line (later
    in the order) must not be held by it."""
    statement, params = line_lock(free)
    return run_while_locked(
        line_lock(waits_for), work, f"the step to wait on {waits_for}'s line",
        (statement + " NOWAIT", params),
    )  # fmt: skip


def test_a_start_from_the_line_carrying_ends__takes_the_lines_in_order() -> None:
    # A job back in b's line starts, carrying the end of a job of a: b's line must not be
    # held while the statement waits for a's (an end_many of a and b holds a and waits
    # for b: a deadlock).
    set_capacity(10)
    ended = running("a")
    back = back_in_line("b")
    started = holds_no_line_while_waiting(
        lambda: dispatch.start(back, PROCESS, ended=[ended]), waits_for="a", free="b"
    )
    assert started.status == "started"
    assert not DispatchJob.objects.filter(pk=ended).exists()


def test_a_carrying_start_whose_job_went_back_meanwhile__holds_no_line() -> None:
    # A copy of a dispatched job of b starts, carrying the end of a job of a, while another
    # step puts the job back in b's line (its publish failed, as the publisher thought):
    # the check of fair_jobs_dispatch_lock_lines saw it dispatched and took no line. Once
    # the put-back commits, the start must not take b's line and then wait for a's (held
    # by an end_many of a and b, which then comes for b's: a deadlock). It leaves the job
    # in its line, to be dispatched again, and drops this copy.
    import threading

    set_capacity(10)
    ended = running("a")
    copy = job_id(tasks.dispatched.delay("b").id)
    set_capacity(0)  # the put-back's end dispatches nothing: the job stays in its line
    put, release = threading.Event(), threading.Event()

    def put_back() -> None:
        with transaction.atomic():
            dispatch.end(copy, None, outcome="back")
            put.set()
            release.wait(20)

    putting, put_out = in_thread(put_back)
    assert put.wait(20), put_out  # the put-back holds the job's row, before the start
    held = session()
    held.execute(*line_lock("a"))  # as an end_many of a and b holds it
    starting, started = in_thread(lambda: dispatch.start(copy, PROCESS, ended=[ended]))
    try:
        wait_until_blocked(starting, "the start to wait for the job's row")
        release.set()
        putting.join(20)
        with session(autocommit=True) as look:
            blocked = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
            wait_for(
                lambda: not starting.is_alive()
                or look.execute(blocked, [held.info.backend_pid]).fetchone() != (0,),
                20, "the start to wait on a's line",
            )  # fmt: skip
            assert starting.is_alive(), started
            statement, params = line_lock("b")
            look.execute(statement + " NOWAIT", params)  # raises if the start holds it
    finally:
        release.set()
        held.commit()
        held.close()
        starting.join(20)
    (result,) = started
    assert not isinstance(result, BaseException), result
    assert result.status == "duplicate"
    assert not DispatchJob.objects.filter(pk=ended).exists()
    assert DispatchJob.objects.get(pk=copy).state == 1  # in its line, not lost


def test_a_flush_of_many_ends__takes_their_lines_in_order() -> None:
    # The ends of a process's jobs of a and b, flushed together, while a step of a's line
    # holds it: b's line (later in the order) is not held while the flush waits for a's
    # (an end_many or bulk_enqueue of both holds a and comes for b: a deadlock).
    set_capacity(10)
    ended = [running("b"), running("a")]
    holds_no_line_while_waiting(lambda: dispatch.end_many(ended, PROCESS), waits_for="a", free="b")
    assert not DispatchJob.objects.filter(pk__in=ended).exists()


def test_bulk_enqueue_given_out_of_order__takes_the_lines_in_order() -> None:
    set_capacity(0)
    for tenant in ("a", "b"):  # their lines exist, as a busy tenant's do
        tasks.dispatched.delay(tenant)
    holds_no_line_while_waiting(
        lambda: tasks.dispatched.bulk_enqueue([(("b",), {}), (("a",), {})]),
        waits_for="a", free="b",
    )  # fmt: skip
    assert DispatchJob.objects.count() == 4


def test_a_start_from_the_line_carrying_ends__lines_in_byte_order_whatever_the_collation(
) -> None:  # fmt: skip
    # As the test above, under a collation such as en_US ('a' before 'B'; in byte order
    # 'B' before 'a'): the lines are taken in byte order, the flush's and bulk_enqueue's,
    # not in the table's order or the collation's.
    def collate(collation: str) -> None:
        with connection.cursor() as cursor:
            for model in (DispatchJob, DispatchTenant):
                length = model._meta.get_field("tenant").max_length
                cursor.execute(
                    f"ALTER TABLE {model._meta.db_table} ALTER COLUMN tenant"
                    f" TYPE varchar({length}) COLLATE {collation}"
                )

    set_capacity(10)
    ended = running("B")
    back = back_in_line("a")
    # B's line written last, so that a scan in the table's order would take a's first.
    DispatchTenant.objects.filter(tenant="B").update(blocked=False)
    collate('"en-US-x-icu"')
    try:
        started = holds_no_line_while_waiting(
            lambda: dispatch.start(back, PROCESS, ended=[ended]), waits_for="B", free="a"
        )
    finally:
        collate('"default"')
    assert started.status == "started"


def test_a_confirmation_restarting_a_job_from_its_line__takes_the_lines_in_order() -> None:
    # The heartbeat's confirmation makes again a lost start (the job back in b's line) and
    # a lost end (a job of a) in one transaction: the same order.
    set_capacity(10)
    identity.register_process(process_id=PROCESS, node="n@h", hostname="h", pid=1)
    ended = running("a")
    back = back_in_line("b")
    confirmed, redone, _ = holds_no_line_while_waiting(
        lambda: dispatch.confirm([back], [ended], PROCESS), waits_for="a", free="b"
    )
    assert (confirmed, redone) == (True, 1)
    assert not DispatchJob.objects.filter(pk=ended).exists()


def test_a_carried_end_of_a_job_put_back_in_line__its_row_not_held_while_waiting() -> None:
    # The reap put a job of a back in its line (its process was silent, not dead), and
    # the process's next start, of a job back in b's line, carries that job's end. The
    # row is a waiting job's now: holding it while waiting for a's line deadlocks with a
    # cancel of a, which holds the line, then deletes the job (order 2).
    set_capacity(10)
    ended, back = running("a"), running("b")
    set_capacity(0)  # nothing dispatches the two again once back in their lines
    for job in (ended, back):
        dispatch.end(job, PROCESS, outcome="back")
    started = run_while_locked(
        line_lock("a"), lambda: dispatch.start(back, PROCESS, ended=[ended]),
        "the carrying start to wait on a's line",
        ("SELECT id FROM fair_jobs_dispatchjob WHERE id = %s FOR UPDATE NOWAIT", [ended]),
    )  # fmt: skip
    assert started.status == "started"
    assert DispatchJob.objects.get(pk=ended).state == 1  # still in its line, not ended


def test_the_lines_of_staged_jobs__made_in_byte_order_whatever_the_collation() -> None:
    # The lines of staged jobs' new tenants were made in the column's collation order,
    # while bulk_enqueue and end_many take lines in byte order (COLLATE "C"). Under a
    # database collation such as en_US, common in production ('a' before 'B'; in byte
    # order 'B' before 'a'), the two took the same lines in opposite orders: a deadlock.
    length = DispatchJob._meta.get_field("tenant").max_length
    alter = "ALTER TABLE fair_jobs_dispatchjob ALTER COLUMN tenant TYPE varchar(%s) COLLATE %s"
    set_capacity(0)
    staged = [job_id(tasks.dispatched.delay(tenant).id) for tenant in ("a", "B")]
    DispatchJob.objects.filter(pk__in=staged).update(
        state=0, not_before=timezone.now() - timedelta(seconds=1)
    )
    DispatchTenant.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute(alter % (length, '"en-US-x-icu"'))
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql_queries()["dispatch_make_lines"], {"queue": "fair"})
    finally:
        with connection.cursor() as cursor:
            cursor.execute(alter % (length, '"default"'))
    made = DispatchTenant.objects.order_by("id").values_list("tenant", flat=True)
    assert list(made) == ["B", "a"]


def wait_for_waiting(count: int, what: str, *threads: Any) -> None:
    """Until ``count`` sessions of the test database wait for a lock (or one of
    ``threads``, each a thread and its result list, has ended: it says why)."""
    with session(autocommit=True) as look:
        waiting = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        wait_for(
            lambda: look.execute(waiting).fetchone()[0] >= count
            or any(not thread.is_alive() for thread, _ in threads),
            20, what,
        )  # fmt: skip
        for thread, out in threads:
            assert thread.is_alive(), f"{what}: it ended with {out}"


def test_a_cancel_of_a_staged_job_of_a_new_tenant__holds_its_line_before_its_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A job stored inside its caller's transaction for a tenant with no line yet. A cancel
    # of that tenant takes the line (none yet); a dispatch then makes it (committed before
    # the cancel's next statement), holds it and waits for the job, which the cancel
    # deletes and whose line it then comes for: a deadlock, unless the cancel holds the
    # line, made if need be, before the jobs (order 2).
    import psycopg

    from django_fair_jobs.dispatch import store

    set_capacity(0)
    with transaction.atomic():
        staged = job_id(tasks.dispatched.delay("c").id)
    DispatchJob.objects.filter(pk=staged).update(state=0)  # stored, not yet in its line
    DispatchTenant.objects.filter(tenant="c").delete()
    real = store.Store._rows

    def rows(self: Any, name: str, params: Any) -> Any:
        result = real(self, name, params)
        if name == "dispatch_lock_line":  # a dispatch makes the line meanwhile
            with session(autocommit=True) as other:
                other.execute("SET lock_timeout = '500ms'")
                statement = sql_queries()["dispatch_make_lines"]
                with contextlib.suppress(psycopg.errors.LockNotAvailable):
                    other.execute(statement, {"queue": "fair"})
        return result

    monkeypatch.setattr(store.Store, "_rows", rows)
    held = session()
    held.execute("SELECT id FROM fair_jobs_dispatchjob WHERE id = %s FOR UPDATE", [staged])
    cancelling, cancelled = in_thread(lambda: dispatch.cancel("fair", "c"))
    try:
        wait_for_waiting(1, "the cancel to wait for the staged job", (cancelling, cancelled))
        dispatching, dispatched = in_thread(lambda: dispatch.dispatch("fair"))
        wait_for_waiting(2, "the dispatch to wait too", (dispatching, dispatched))
    finally:
        held.commit()
        held.close()
        cancelling.join(20)
    dispatching.join(20)
    assert not isinstance(cancelled[0], BaseException), cancelled
    assert not isinstance(dispatched[0], BaseException), dispatched
    assert len(cancelled[0]) == 1  # the staged job's task id
    assert not DispatchJob.objects.filter(pk=staged).exists()
    line = DispatchTenant.objects.get(tenant="c")
    assert (line.waiting, line.in_flight, line.head_id) == (0, 0, None)


def sql_queries() -> dict[str, str]:
    """fair dispatch's named statements, as the store runs them."""
    from django_fair_jobs import sql

    return sql.queries()

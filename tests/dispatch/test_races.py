"""Dispatch under concurrency, with real PostgreSQL sessions."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery.result import AsyncResult
from django.db import connection, connections

from django_fair_jobs import backlog, dispatch, identity, sql
from django_fair_jobs.dispatch.models import DISPATCHED, DispatchJob, DispatchQueue, DispatchTenant
from tests.conftest import wait_for
from tests.testapp import tasks

pytestmark = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="two sessions racing need PostgreSQL"
)


@pytest.mark.django_db(transaction=True)
def test_refresh_capacity__the_queue_row_inserted_meanwhile_by_an_enqueue__no_error() -> None:
    # A worker process that starts computes its queue's capacity while the first enqueue
    # on that queue inserts the queue's row. The refresh found no row, waited on the
    # enqueue's, and failed on the duplicate key: the queue kept no capacity until the
    # next maintenance pass, so a countdown come due was not dispatched.
    identity.register_process(
        process_id=uuid.uuid4(), node="n@h", hostname="h", pid=1, queues=["race"], concurrency=2
    )
    enqueue = _session()
    enqueue.execute(
        "INSERT INTO fair_jobs_dispatchqueue"
        " (queue, capacity, slack, in_flight, virtual_time, dispatched_total, updated_at)"
        " VALUES ('race', 0, 0, 0, 0, 0, now()) ON CONFLICT (queue) DO NOTHING"
    )  # uncommitted: its transaction is open, as an enqueue's is mid-statement
    thread, out = _in_thread(lambda: dispatch.refresh_capacity(slack_per_node=0, timeout=60))
    try:
        _wait_until_blocked(thread, "the refresh to wait on the enqueue's row")
    finally:
        enqueue.commit()
        enqueue.close()
        thread.join(20)
    (outcome,) = out
    assert not isinstance(outcome, BaseException), outcome
    assert DispatchQueue.objects.get(queue="race").capacity == 2


def _session(autocommit: bool = False) -> Any:
    """A second PostgreSQL session of its own (not Django's), in a transaction unless
    ``autocommit``."""
    import psycopg

    params = connection.get_connection_params()
    return psycopg.connect(
        autocommit=autocommit, **{k: v for k, v in params.items() if k != "cursor_factory"}
    )


def _wait_until_blocked(thread: threading.Thread, what: str) -> None:
    """Until a session of this database waits on a row lock (or ``thread`` has ended)."""
    # Autocommit: inside one transaction pg_stat_activity keeps its first snapshot.
    with _session(autocommit=True) as look:
        waiting = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        wait_for(
            lambda: not thread.is_alive() or look.execute(waiting).fetchone() != (0,), 20, what
        )


def _in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``work`` in a thread with its own Django connection; its result or exception
    lands in the returned list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:
            out.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _line(tenant: str) -> DispatchTenant:
    return DispatchTenant.objects.get(queue="fair", tenant=tenant)


@pytest.mark.django_db(transaction=True)
def test_cancel_while_a_dispatch_holds_the_line__the_dispatched_job_goes_on() -> None:
    DispatchQueue.objects.create(queue="fair", capacity=0)
    ids = [tasks.dispatched.delay("flood").id for _ in range(5)]
    DispatchQueue.objects.filter(queue="fair").update(capacity=1)
    held = _session()
    (chosen,) = held.execute("SELECT job_id FROM fair_jobs_dispatch('fair', 1)").fetchall()
    thread, out = _in_thread(lambda: backlog.cancel("flood", queue="fair"))
    try:
        _wait_until_blocked(thread, "the cancel to wait on the dispatch's line")
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
    held = _session()
    held.execute(statements["dispatch_lock_line"], params)
    cancelled = [row[0] for row in held.execute(statements["dispatch_cancel"], params)]
    assert sorted(cancelled) == sorted(flood)
    thread, out = _in_thread(lambda: dispatch.dispatch("fair"))
    try:
        # Dispatch skips a line another transaction holds: it ends without waiting.
        _wait_until_blocked(thread, "the dispatch to end, or wait on the cancel's line")
    finally:
        held.commit()
        held.close()
        thread.join(20)
    (ready,) = out
    assert not isinstance(ready, BaseException), ready
    assert [DispatchJob.objects.get(pk=r.job_id).task_id for r in ready] == [small]
    assert not DispatchJob.objects.filter(task_id__in=flood).exists()
    assert (_line("flood").waiting, _line("flood").in_flight) == (0, 0)
    assert DispatchQueue.objects.get(queue="fair").in_flight == 1

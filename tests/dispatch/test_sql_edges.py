"""Edges of fair dispatch's PostgreSQL functions that the rule's tests do not reach: a
flush of ends over several lines lifts their blocks, a line whose key keeps its place
after an end is still dispatched in one update, only a failed publish counts as one, an
end sent again answers only with jobs not started, and a dispatch waiting for its
limited queue's turn gives up at its lock timeout."""

from __future__ import annotations

import psycopg
import pytest

from bench.pgstats import row_updates
from django_fair_jobs import dispatch, queue_limits
from django_fair_jobs.dispatch.models import DispatchJob, DispatchTenant
from tests.conftest import runs_sql
from tests.dispatch.test_rule import (  # noqa: F401 (published: the module's autouse fixture)
    PROCESS,
    PUBLISHED,
    enqueue,
    published,
    set_capacity,
    tenant_of,
)
from tests.sessions import session
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]


def _updates() -> int:
    """The line table's row updates so far."""
    return row_updates(("fair_jobs_dispatchtenant",))["fair_jobs_dispatchtenant"][0]


def test_end_many__ends_of_two_capped_lines__both_unblocked__each_dispatched() -> None:
    # Both lines are at their task's cap (blocked, out of the selection's index). A flush
    # ending one job of each takes the path of several lines: each line's update must lift
    # its block, or the room both ends left goes to no one until the maintenance pass.
    set_capacity(4)
    enqueue("a", 4, task=tasks.dispatched_capped)  # fair_max_jobs=2
    enqueue("b", 4, task=tasks.dispatched_capped)
    assert DispatchTenant.objects.filter(blocked=True).count() == 2
    a_first = next(j for j in PUBLISHED if tenant_of(j) == "a")
    b_first = next(j for j in PUBLISHED if tenant_of(j) == "b")
    for job in (a_first, b_first):
        assert dispatch.start(job, PROCESS).status == "started"
    ready = dispatch.end_many([a_first, b_first], PROCESS)
    assert sorted(tenant_of(r.job_id) for r in ready) == ["a", "b"]
    assert DispatchTenant.objects.filter(blocked=True).count() == 2  # at their caps again


def test_end_many__a_weighted_line_whose_key_the_end_leaves_as_it_was__one_update() -> None:
    if not runs_sql():
        pytest.skip("row updates of one statement are the PostgreSQL store's figure")
    # At weight 2, one job in flight and none have the same key (floor(1 / 2) = 0): the
    # ended line's key equals the index's first, its own, and it still comes first, so
    # the end and the dispatch are one update of it, as at weight 1.
    tasks.DISPATCH_WEIGHTS["a"] = 2
    set_capacity(1)
    enqueue("a", 3)
    first = PUBLISHED[0]
    assert dispatch.start(first, PROCESS).status == "started"
    before = _updates()
    ready = dispatch.end_many([first], PROCESS)
    assert [tenant_of(r.job_id) for r in ready] == ["a"]
    assert _updates() - before == 1


@pytest.mark.parametrize("outcome", ["back", "later"])
def test_a_running_job_put_back__counts_no_publish_failure(outcome: dispatch.Outcome) -> None:
    # Only a failed publish (an end without a process) counts towards the attempts after
    # which the job ends failed: a running job put back in its line (Reject(requeue=True),
    # the reap) or aside (the fence refused it) was published fine, and must not end
    # failed after a few refusals.
    set_capacity(1)
    enqueue("a", 1)
    job = PUBLISHED[0]
    assert dispatch.start(job, PROCESS).status == "started"
    dispatch.end(job, PROCESS, outcome=outcome, delay=1.0, block=outcome == "later", limit=0)
    assert DispatchJob.objects.get(pk=job).publish_failures == 0


def test_an_end_sent_again__a_job_its_room_went_to_started_meanwhile__not_published_again() -> None:
    # The end committed and its reply was lost; before it is sent again, the job its room
    # went to was published by another path and started: sent again, the end answers
    # only with jobs still dispatched, or a second copy goes to the broker.
    set_capacity(1)
    enqueue("a", 2)
    first = PUBLISHED[0]
    assert dispatch.start(first, PROCESS).status == "started"
    (second,) = [r.job_id for r in dispatch.end(first, PROCESS)]
    assert dispatch.start(second, PROCESS).status == "started"
    assert dispatch.end(first, PROCESS, again=True) == []


def test_a_dispatch_waiting_for_its_limited_queues_turn__gives_up_at_its_lock_timeout() -> None:
    if not runs_sql():
        pytest.skip("the function's lock timeout is the PostgreSQL store's")
    # Another dispatch of the queue holds its turn (a transaction that stalls): this one
    # fails at the function's 2 s lock timeout, to be sent again, rather than waiting for
    # as long as the session allows (here without end: lock_timeout 0).
    queue_limits.set_limits("fair", max_jobs=5)
    set_capacity(1)
    enqueue("a", 1)
    with session() as holder, session(autocommit=True) as waiter:
        holder.execute("SELECT pg_advisory_xact_lock(1718773348, hashtext('fair'))")
        waiter.execute("SET lock_timeout = 0")
        waiter.execute("SET statement_timeout = '20s'")  # the guard of a dispatch that waits
        with pytest.raises(psycopg.errors.LockNotAvailable):
            waiter.execute("SELECT * FROM fair_jobs_dispatch('fair', 1)")
        holder.rollback()

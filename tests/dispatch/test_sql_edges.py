"""Edges of fair dispatch's PostgreSQL functions that the rule's tests do not reach: a
flush of ends over several lines lifts their blocks, a line whose key keeps its place
after an end is still dispatched in one update, only a failed publish counts as one, an
end sent again answers only with jobs not started, and a dispatch waiting for its
limited queue's turn gives up at its lock timeout."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from django.utils import timezone

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


def test_end_many__ends_of_two_lines_by_different_counts__each_line_drops_by_its_own() -> None:
    """A flush ending one job of a and two of b (the path of several lines) takes each
    line's count in flight down by its own ends: b, counted with a's one, would keep a job
    in flight that no longer exists (held below its cap, its share of the room lost)."""
    set_capacity(3)
    enqueue("a", 1)
    enqueue("b", 2)
    assert len(PUBLISHED) == 3
    for job in PUBLISHED:
        assert dispatch.start(job, PROCESS).status == "started"
    assert dispatch.end_many(list(PUBLISHED), PROCESS) == []
    lines = dict(DispatchTenant.objects.values_list("tenant", "in_flight"))
    assert lines == {"a": 0, "b": 0}


def test_end_many__the_ended_line_left_with_no_head__the_room_goes_by_the_rule() -> None:
    """A flush ends a's only job in flight; a's line has no head, but a countdown of a came
    due meanwhile. a, back at the queue's virtual time, ties with b on its pass, and b's
    older head wins: the flush must not take a's line as the one that comes first (its
    pass from before the due step is lower) and hand it the room."""
    set_capacity(2)
    enqueue("a", 1)
    (a_first,) = PUBLISHED
    assert dispatch.start(a_first, PROCESS).status == "started"
    enqueue("c", 3)  # c is served three times: the virtual time passes a's pass
    while len(PUBLISHED) < 4:
        c_job = PUBLISHED[-1]
        assert dispatch.start(c_job, PROCESS).status == "started"
        PUBLISHED.extend(r.job_id for r in dispatch.end(c_job, PROCESS))
    assert dispatch.start(PUBLISHED[-1], PROCESS).status == "started"
    assert dispatch.end(PUBLISHED[-1], PROCESS) == []
    set_capacity(1)  # a's job fills it: b waits, its line at the virtual time
    enqueue("b", 1)
    later = tasks.dispatched.apply_async(("a",), countdown=3600).id
    DispatchJob.objects.filter(task_id=later).update(
        not_before=timezone.now() - timedelta(minutes=1)
    )
    b_head = DispatchTenant.objects.get(tenant="b").head_id
    ready = dispatch.end_many([a_first], PROCESS)
    assert [r.job_id for r in ready] == [b_head]

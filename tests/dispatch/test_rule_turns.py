"""More of fair dispatch's selection rule, on the real database (no worker): the fewest
jobs in flight per weight come before the virtual time, and a job put back in its line
leads it and is dispatched again."""

from __future__ import annotations

import pytest

from django_fair_jobs import dispatch
from django_fair_jobs.dispatch.models import DISPATCHED, DispatchJob
from tests.dispatch.test_rule import (  # noqa: F401 (published: the module's autouse fixture)
    PROCESS,
    PUBLISHED,
    enqueue,
    published,
    pump,
    run_one,
    set_capacity,
    tenant_of,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]


def test_max_min__fewest_in_flight_wins_over_a_lower_virtual_time() -> None:
    # slow has two jobs running and has been served twice; quick has been served four
    # times (its virtual time is ahead) and has none in flight once its job ends: the room
    # goes to quick. Ordered by virtual time alone, it would go to slow.
    set_capacity(3)
    enqueue("slow", 2)
    for job in list(PUBLISHED):
        assert dispatch.start(job, PROCESS).status == "started"
    enqueue("quick", 6)
    for _ in range(4):
        ready = run_one(PUBLISHED[-1])
        assert [tenant_of(r.job_id) for r in ready] == ["quick"]
    enqueue("slow", 1)
    ready = run_one(PUBLISHED[-1])
    assert [tenant_of(r.job_id) for r in ready] == ["quick"]


def test_a_job_put_back_in_its_line__leads_it__dispatched_again_before_the_next() -> None:
    # The reap's (or Reject(requeue=True)'s) put-back: the job keeps its place, ahead of
    # the job that waited behind it, and is dispatched again, not stranded in its line.
    set_capacity(1)
    first, second = (DispatchJob.objects.get(task_id=t).pk for t in enqueue("a", 2))
    assert PUBLISHED[:] == [first]
    assert dispatch.start(first, PROCESS).status == "started"
    ready = dispatch.end(first, PROCESS, outcome="back")
    assert [r.job_id for r in ready] == [first]
    assert DispatchJob.objects.get(pk=first).state == DISPATCHED
    PUBLISHED.extend(r.job_id for r in ready)
    run_one(first)
    assert PUBLISHED[-1] == second
    pump()  # nothing more: the line's one job in flight fills the room
    assert PUBLISHED[-1] == second and len(PUBLISHED) == 3

"""More of fair dispatch's selection rule, on the real database (no worker): the fewest
jobs in flight per weight come before the virtual time, a job put back in its line
leads it and is dispatched again, a countdown come due banks no credit for its tenant's
idle time, and a tenant's new weight reaches its line by its next enqueue."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone

from django_fair_jobs import dispatch
from django_fair_jobs.dispatch.models import DISPATCHED, DispatchJob, DispatchTenant
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
from tests.testapp import tasks

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


def test_floor__a_countdown_come_due_on_an_idle_tenants_line__banks_no_credit() -> None:
    # As an enqueue into an empty line does, the due step moving a countdown into one
    # raises its virtual time to the queue's: early, served once and idle for 20 turns,
    # then back by countdowns, alternates with busy instead of taking three in a row.
    set_capacity(1)
    enqueue("early", 1)
    run_one(PUBLISHED[-1])
    enqueue("busy", 30)
    for _ in range(20):
        run_one(PUBLISHED[-1])
    later = [tasks.dispatched.apply_async(("early",), countdown=3600).id for _ in range(3)]
    DispatchJob.objects.filter(task_id__in=later).update(
        not_before=timezone.now() - timedelta(seconds=1)
    )
    served: list[str] = []
    for _ in range(4):
        ready = run_one(PUBLISHED[-1])  # its end's dispatch moves the due jobs first
        served.append(tenant_of(ready[0].job_id))
    assert served.count("early") == 2, served
    early = DispatchTenant.objects.get(tenant="early")
    busy = DispatchTenant.objects.get(tenant="busy")
    assert abs(early.pass_value - busy.pass_value) <= 1.0


def test_weights__a_weight_changed__the_tenants_next_enqueue_sets_it_on_its_line() -> None:
    # a's line was made at weight 1; raised to 4 (tenant_weights asked again), a's next
    # enqueue carries it onto the line, which then takes 3 of 4 places against b's 1.
    # Left at weight 1, the two would share the room 2 and 2.
    set_capacity(0)
    enqueue("a", 5)
    enqueue("b", 5)
    tasks.DISPATCH_WEIGHTS["a"] = 4
    dispatch._weights.clear()  # past WEIGHT_TTL: the weight is asked again
    enqueue("a", 1)
    assert DispatchTenant.objects.get(tenant="a").weight == 4
    set_capacity(4)
    pump()
    assert Counter(tenant_of(job) for job in PUBLISHED) == {"a": 3, "b": 1}

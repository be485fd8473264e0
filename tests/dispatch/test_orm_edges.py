"""Edges of fair dispatch's ORM store (``dispatch/store_orm.py``) that the rule's and the
limits' tests did not reach, pinned on both stores so that the PostgreSQL functions answer
alike: a paused tenant whose line an end unblocked is still not dispatched, and a tenant
whose line emptied re-enters at its own pass when that is above the queue's virtual time
(no extra turn)."""

from __future__ import annotations

import pytest

from django_fair_jobs import dispatch, slots
from django_fair_jobs.dispatch.models import DispatchTenant
from tests.dispatch.test_rule import (  # noqa: F401 (published: the module's autouse fixture)
    PROCESS,
    PUBLISHED,
    enqueue,
    published,
    run_one,
    set_capacity,
    tenant_of,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]


def test_a_paused_tenant__its_line_unblocked_by_an_end__nothing_dispatched() -> None:
    """a is paused (its tenant slot's max_jobs 0) while one of its jobs runs; that job's
    end lifts the line's block, and the dispatch into the room it left finds a's line
    first: the pause (0, not "no override") must stop it, or a paused tenant runs on."""
    set_capacity(1)
    enqueue("a", 2)
    (first,) = PUBLISHED
    assert dispatch.start(first, PROCESS).status == "started"
    slots.set_tenant_limit("a", "fair", 0)
    assert dispatch.end(first, PROCESS) == []
    line = DispatchTenant.objects.get(tenant="a")
    assert (line.in_flight, line.waiting, line.blocked) == (0, 1, True)


def test_a_line_emptied_after_its_service__re_enters_at_its_own_pass__no_extra_turn() -> None:
    """a is served once (its pass 1) and its line empties; b, which came later, is served
    once too. a's next job re-enters its empty line at the queue's virtual time (0, the
    highest pass served at) only if that is above its own pass: lowered to it, a would
    pass b, whose older job waits at the same pass, and take a second turn first."""
    set_capacity(1)
    enqueue("a", 1)
    enqueue("b", 2)
    (a_first,) = PUBLISHED
    ready = run_one(a_first)
    assert [tenant_of(r.job_id) for r in ready] == ["b"]
    enqueue("a", 1)  # no room: b's job fills it
    assert DispatchTenant.objects.get(tenant="a").pass_value == 1.0
    ready = run_one(PUBLISHED[-1])
    assert [tenant_of(r.job_id) for r in ready] == ["b"]

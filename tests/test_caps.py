"""The cap in force (:mod:`django_fair_jobs.caps`) at its edges, read from real rows: a
tenant paused by its slot, a queue paused or limited per worker only, and a queue held
back when its room is exactly 0."""

from __future__ import annotations

import pytest

from django_fair_jobs import caps, queue_limits, slots

pytestmark = pytest.mark.django_db(transaction=True)


def test_tenant_paused_by_its_slot__cap_0_paused__not_its_task_default() -> None:
    """A slot override of 0 pauses the tenant: every view reads limit 0 from "paused" and
    is held, not the task default the slot saw (which would let the tenant run)."""
    slots.set_tenant_limit("acme", "q", 0)
    cap = caps.of("acme", "q")
    assert (cap.limit, cap.source, cap.running) == (0, "paused", 0)
    assert cap.said == "paused"
    assert cap.holds() == "its tenant is paused on this queue (its tenant slot's max_jobs is 0)"
    assert cap.as_dict()["holds"] == cap.holds()


def test_queue_paused_per_worker__every_tenant_on_it_held_by_the_pause() -> None:
    """A per-worker limit of 0 pauses the queue as surely as a cluster-wide 0: the cap's
    queue limit reads 0 and the pause is what holds the tenant."""
    queue_limits.set_limits("q", max_jobs=5, max_jobs_per_worker=0)
    slots.set_tenant_limit("acme", "q", 3)
    cap = caps.of("acme", "q")
    assert (cap.queue_max_jobs, cap.queue_paused) == (0, True)
    assert cap.holds() == "the queue q is paused (a limit of 0)"
    assert caps.queue_limits() == {"q": 0}


def test_per_worker_limit_alone__no_cluster_wide_limit_shown() -> None:
    """A per-worker limit is per node, not the queue's limit for all tenants: without a
    cluster-wide ``max_jobs`` the cap shows no queue limit and nothing holds."""
    queue_limits.set_limits("q", max_jobs_per_worker=2)
    slots.set_tenant_limit("acme", "q", 3)
    cap = caps.of("acme", "q")
    assert (cap.queue_max_jobs, cap.queue_paused, cap.holds()) == (None, False, None)
    assert caps.queue_limits() == {"q": None}
    queue_limits.set_limits("q", max_jobs=7)
    assert caps.of("acme", "q").queue_max_jobs == 7


def test_queue_held_by__no_room_left__at_its_limit() -> None:
    """A room of exactly 0 means the queue limit is reached; a room of 1 holds nothing."""
    assert caps.queue_held_by("fair", 4, 0, 1, 0, 1) == "the queue fair is at its limit"
    assert caps.queue_held_by("fair", 4, 0, 1, 1, 2) is None

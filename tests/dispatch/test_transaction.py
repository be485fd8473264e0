"""``delay()`` inside the caller's transaction: each job's row commits with the caller's
data, and once the transaction commits each queue its jobs went to is dispatched once,
however many jobs it stored (issue: enqueue in batches where the caller allows it)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from django_fair_jobs import dispatch
from django_fair_jobs.dispatch.models import DispatchJob
from tests.dispatch.conftest import set_capacity
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("engine", "collected"),
]


@pytest.fixture
def dispatches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The queues dispatched, one entry per dispatch statement."""
    out: list[str] = []
    real = dispatch.dispatch

    def counting(queue: str, limit: int = dispatch.BATCH) -> list[dispatch.Ready]:
        out.append(queue)
        return real(queue, limit)

    monkeypatch.setattr(dispatch, "dispatch", counting)
    return out


def test_many_delays_in_one_transaction__each_queue_dispatched_once_after_the_commit(
    dispatches: list[str], collected: list[int]
) -> None:
    set_capacity(100)
    set_capacity(100, queue="other")
    with transaction.atomic():
        for i in range(6):
            tasks.dispatched.delay(f"t{i}")
        tasks.dispatched.apply_async(("x",), queue="other")
        tasks.dispatched.delay("t0")
        assert dispatches == []  # nothing before the commit
    assert sorted(dispatches) == ["fair", "other"]
    assert len(collected) == 8  # every job stored was dispatched
    assert DispatchJob.objects.filter(state=2).count() == 8


def test_the_savepoint_that_first_stored_a_job_rolls_back__later_jobs_still_dispatched(
    dispatches: list[str], collected: list[int]
) -> None:
    set_capacity(100)
    with transaction.atomic():
        try:
            with transaction.atomic():
                tasks.dispatched.delay("gone")
                raise RuntimeError("the inner block fails")
        except RuntimeError:
            pass
        tasks.dispatched.delay("kept")
    assert dispatches == ["fair"]
    assert list(DispatchJob.objects.values_list("tenant", "state")) == [("kept", 2)]


def test_a_transaction_rolled_back__the_next_ones_jobs_still_dispatched(
    dispatches: list[str], collected: list[int]
) -> None:
    set_capacity(100)
    try:
        with transaction.atomic():
            tasks.dispatched.delay("gone")
            raise RuntimeError("the request fails")
    except RuntimeError:
        pass
    with transaction.atomic():
        tasks.dispatched.delay("kept")
    assert dispatches == ["fair"]
    assert list(DispatchJob.objects.values_list("tenant", "state")) == [("kept", 2)]


def test_a_savepoint_inside_stores_more_jobs__one_dispatch(
    dispatches: list[str], collected: list[int]
) -> None:
    set_capacity(100)
    with transaction.atomic():
        tasks.dispatched.delay("a")
        with transaction.atomic():
            tasks.dispatched.delay("b")
        tasks.dispatched.delay("c")
    assert dispatches == ["fair"]
    assert len(collected) == 3


@pytest.mark.django_db  # inside the test's own transaction, as TestCase runs
def test_two_capture_blocks_in_one_test__each_dispatches_its_jobs(
    django_capture_on_commit_callbacks: Any, collected: list[int]
) -> None:
    # captureOnCommitCallbacks runs the callbacks and leaves them in the transaction's
    # list: the second block's job must not be added to the first, spent, callback.
    set_capacity(100)
    with django_capture_on_commit_callbacks(execute=True):
        tasks.dispatched.delay("a")
    with django_capture_on_commit_callbacks(execute=True):
        tasks.dispatched.delay("b")
    assert len(collected) == 2


def test_a_job_stored_in_atomic_is_dispatched_at_a_commit_in_the_same_millisecond(
    collected: list[int],
) -> None:
    # SQLite's clock reads milliseconds while a stored time keeps microseconds: a commit
    # within the millisecond of the store must still find the job due.
    set_capacity(100)
    left: list[tuple[str, int]] = []
    for i in range(30):
        with transaction.atomic():
            tasks.dispatched.delay(f"t{i}")
        left += DispatchJob.objects.exclude(state=2).values_list("tenant", "state")
    assert left == []
    assert len(collected) == 30

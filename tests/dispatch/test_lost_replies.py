"""A dispatch that is not an end's (after the caller's commit, a limit raised, the
maintenance pass) whose reply is lost after it committed (a failover, a pooler restart):
sent again with the number it drew, it answers with the jobs its first try dispatched,
which are published at once instead of a minute later by the lost-message repair."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import InterfaceError, OperationalError, connection, transaction

from django_fair_jobs import dispatch
from django_fair_jobs.dispatch.models import DISPATCHED, WAITING, DispatchJob
from tests.dispatch.conftest import job_of, set_capacity
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("engine", "in_process_worker", "collected"),
]


def cut_store_after_commit(monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[list[int]]:
    """The store's dispatch commits, then its reply is lost once; returns the jobs each
    lost reply held. On PostgreSQL the connection is closed under Django (as a pooler's
    restart leaves it) and Django's own error is raised; elsewhere ``error``."""
    store_class = type(dispatch._store())
    real, lost = store_class.dispatch, list[list[int]]()

    def commit_then_cut(self: Any, *args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        ready: list[dispatch.Ready] = real(self, *args, **kwargs)
        if not lost:
            lost.append([r.job_id for r in ready])
            if connection.vendor == "postgresql":
                connection.connection.close()
                connection.cursor().execute("SELECT 1")  # raises InterfaceError
            raise error
        return ready

    monkeypatch.setattr(store_class, "dispatch", commit_then_cut)
    return lost


@pytest.mark.parametrize(
    "error",
    [OperationalError("server closed the connection"), InterfaceError("connection closed")],
    ids=["cut", "closed"],
)
def test_a_dispatch_whose_reply_is_lost__sent_again__answers_with_its_jobs(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    set_capacity(0)
    first, second = (job_of(tasks.dispatched.delay("acme").id) for _ in range(2))
    set_capacity(1)
    lost = cut_store_after_commit(monkeypatch, error)
    ready = dispatch.dispatch("fair")
    assert lost == [[first.pk]]
    # The first try's job, once; nothing more, as the queue has no room left.
    assert [r.job_id for r in ready] == [first.pk]
    assert DispatchJob.objects.get(pk=first.pk).state == DISPATCHED
    assert DispatchJob.objects.get(pk=second.pk).state == WAITING


def test_a_dispatch_sent_again__answers_with_its_own_jobs_only() -> None:
    set_capacity(0)
    job = job_of(tasks.dispatched.delay("acme").id)
    set_capacity(1)
    assert [r.job_id for r in dispatch.dispatch("fair")] == [job.pk]
    number = DispatchJob.objects.get(pk=job.pk).dispatched_by
    assert number is not None and number < 0  # never a job's id, as an end's is
    store = dispatch._store()
    assert store.dispatch("fair", 10, number - 1, True) == []  # another dispatch's number
    assert [r.job_id for r in store.dispatch("fair", 10, number, True)] == [job.pk]


def test_a_dispatch_inside_atomic__its_error_raised_and_not_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_capacity(1)
    store_class = type(dispatch._store())
    calls = list[bool]()

    def failing(self: Any, queue: str, limit: int, by: int, again: bool) -> Any:
        calls.append(again)
        raise OperationalError("server closed the connection")

    monkeypatch.setattr(store_class, "dispatch", failing)
    with pytest.raises(OperationalError), transaction.atomic():
        dispatch.dispatch("fair")
    assert calls == [False]  # the caller's transaction is gone: nothing to send again


def test_the_dispatch_after_the_callers_commit__its_reply_lost__publishes_at_once(
    monkeypatch: pytest.MonkeyPatch, collected: list[int]
) -> None:
    set_capacity(1)
    lost = cut_store_after_commit(monkeypatch, OperationalError("server closed the connection"))
    with transaction.atomic():
        task_id = tasks.dispatched.delay("acme").id
    job = job_of(task_id)
    assert lost == [[job.pk]]
    assert collected == [job.pk]


def test_the_dispatch_after_the_callers_commit__the_database_gone__the_caller_goes_on(
    monkeypatch: pytest.MonkeyPatch, collected: list[int]
) -> None:
    set_capacity(1)
    store_class = type(dispatch._store())
    real = store_class.dispatch

    def gone(self: Any, *args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        raise OperationalError("could not connect to server")

    monkeypatch.setattr(store_class, "dispatch", gone)
    with transaction.atomic():  # the caller's data and the job commit: no error raised
        task_id = tasks.dispatched.delay("acme").id
    assert not collected
    monkeypatch.setattr(store_class, "dispatch", real)
    # Stored, it is the maintenance pass's to dispatch (a due job on a queue with room).
    assert dispatch.due_queues(["fair"]) == ["fair"]
    assert [r.job_id for r in dispatch.dispatch("fair")] == [job_of(task_id).pk]

"""Lost replies outside a job's steps (a failover, a pooler restart). A dispatch of a
queue (after the caller's commit, a limit raised, the maintenance pass), sent again with
the number it drew, answers with the jobs its first try dispatched, which are published at
once instead of a minute later by the lost-message repair. A ``delay()``'s enqueue, sent
again with the number it drew, finds the job stored or stores it: the job is stored once
and ``delay()`` returns."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from django.db import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import dispatch
from django_fair_jobs.dispatch.models import DISPATCHED, WAITING, DispatchJob, DispatchReceipt
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


def an_id_job() -> dispatch.Job:
    """A job of the dispatched task whose task id is ``an-id``, ready to enqueue."""
    return dispatch.Job("fair", "acme", tasks.dispatched.name, "an-id", "{}", None, None, None)


def cut_enqueue(monkeypatch: pytest.MonkeyPatch, *, after_commit: bool) -> list[int]:
    """The store's enqueue loses its reply once, after it committed or before; returns
    how often it was called."""
    store_class = type(dispatch._store())
    real, calls = store_class.enqueue, list[int]()

    def cut(self: Any, *args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        calls.append(1)
        if len(calls) > 1:
            return real(self, *args, **kwargs)  # type: ignore[no-any-return]
        if after_commit:
            real(self, *args, **kwargs)
            if connection.vendor == "postgresql":
                connection.connection.close()
                connection.cursor().execute("SELECT 1")  # raises InterfaceError
        raise OperationalError("server closed the connection")

    monkeypatch.setattr(store_class, "enqueue", cut)
    return calls


@pytest.mark.parametrize("capacity", [1, 0], ids=["dispatched", "waiting"])
def test_an_enqueue_whose_reply_is_lost_after_its_commit__delay_returns__published_once(
    monkeypatch: pytest.MonkeyPatch, collected: list[int], capacity: int
) -> None:
    set_capacity(capacity)
    calls = cut_enqueue(monkeypatch, after_commit=True)
    task_id = tasks.dispatched.delay("acme").id  # no error: the job is stored
    (job,) = DispatchJob.objects.filter(task_id=task_id)
    assert len(calls) == 2
    # Dispatched by its own enqueue, it is published now; else it waits in its line.
    assert collected == ([job.pk] if capacity else [])
    assert job.state == (DISPATCHED if capacity else WAITING)


def test_an_enqueue_cut_before_its_commit__sent_again__stored_once(
    monkeypatch: pytest.MonkeyPatch, collected: list[int]
) -> None:
    set_capacity(1)
    calls = cut_enqueue(monkeypatch, after_commit=False)
    task_id = tasks.dispatched.delay("acme").id
    (job,) = DispatchJob.objects.filter(task_id=task_id)
    assert len(calls) == 2 and collected == [job.pk]


@pytest.mark.parametrize("after_commit", [True, False], ids=["after-commit", "before-commit"])
def test_an_enqueue_with_a_task_id_given__its_reply_lost__stored_once(
    monkeypatch: pytest.MonkeyPatch, collected: list[int], after_commit: bool
) -> None:
    # A given task id may be another row's too (a retry keeps its job's): the first try's
    # row is found by the number the enqueue drew, not by the task id alone.
    set_capacity(1)
    calls = cut_enqueue(monkeypatch, after_commit=after_commit)
    tasks.dispatched.apply_async(("acme",), task_id="given-id")  # no error
    (job,) = DispatchJob.objects.filter(task_id="given-id")
    assert len(calls) == 2 and collected == [job.pk]


def test_an_enqueue_with_the_task_id_of_another_row__cut_before_its_commit__stored(
    monkeypatch: pytest.MonkeyPatch, collected: list[int]
) -> None:
    # A retry's enqueue carries the task id of its job, whose row is still there: sent
    # again, the enqueue does not take that row for its own, and the retry is stored.
    set_capacity(0)
    first = job_of(tasks.dispatched.delay("acme").id)
    set_capacity(2)
    calls = cut_enqueue(monkeypatch, after_commit=False)
    tasks.dispatched.apply_async(("acme",), task_id=first.task_id)
    ids = list(
        DispatchJob.objects.filter(task_id=first.task_id)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    assert len(calls) == 2 and len(ids) == 2 and ids[0] == first.pk
    assert sorted(collected) == ids


def test_a_first_enqueue__its_number_already_a_receipt__raises_not_dropping_the_job() -> None:
    # Only an enqueue sent again may take a receipt found for an earlier try of its own; a
    # first try that finds its number taken (another enqueue drew it) must not answer as
    # if its job were stored: it raises, and its delay() with it.
    DispatchReceipt.objects.create(drawn=-7)
    with pytest.raises(IntegrityError):
        dispatch._store().enqueue(an_id_job(), -7)
    assert not DispatchJob.objects.filter(task_id="an-id").exists()


def test_a_first_enqueue__its_receipt_a_plain_insert(engine: str) -> None:
    # The receipt of a first try is a plain insert: the savepoint that lets a try sent
    # again find an earlier receipt is for that try only (the ORM store); PostgreSQL's
    # function stores it within its one statement.
    tasks.dispatched.delay("acme")  # the line exists (its creation takes a savepoint)
    with CaptureQueriesContext(connection) as captured:
        dispatch._store().enqueue(an_id_job(), -7)
    statements = [q["sql"] for q in captured.captured_queries]
    assert not [each for each in statements if "SAVEPOINT" in each]
    if engine == "sql":
        assert len(statements) == 1
    assert DispatchReceipt.objects.filter(drawn=-7).exists()


def test_an_enqueue_sent_again__a_job_another_step_dispatched__not_published_again() -> None:
    # Stored by the first try, then dispatched (and published) by another step before the
    # second try asked: that step published it, so the enqueue does not.
    set_capacity(0)
    store = dispatch._store()
    job = an_id_job()
    assert store.enqueue(job, -7) == []
    set_capacity(1)
    (row,) = DispatchJob.objects.filter(task_id="an-id")
    assert [r.job_id for r in dispatch.dispatch("fair")] == [row.pk]
    assert store.enqueue(job, -7, again=True) == []
    assert DispatchJob.objects.filter(task_id="an-id").count() == 1


def test_an_enqueue_sent_again__its_job_ran_and_ended_meanwhile__not_stored_again() -> None:
    # The first try stored the job (its reply lost); before the second try asked, another
    # step dispatched it and its worker ran and ended it, which deleted its row: the
    # second try must still know the first one stored it.
    set_capacity(0)
    store = dispatch._store()
    job = an_id_job()
    assert store.enqueue(job, -7) == []
    set_capacity(1)
    (ready,) = dispatch.dispatch("fair")
    process = uuid.uuid4()
    assert dispatch.start(ready.job_id, process).status == "started"
    dispatch.end(ready.job_id, process)
    assert store.enqueue(job, -7, again=True) == []
    assert not DispatchJob.objects.filter(task_id="an-id").exists()


def test_an_enqueue_sent_again__its_dispatched_job_started_meanwhile__not_published_again() -> None:
    # The first try stored and dispatched the job (its reply lost); the lost-message
    # repair published it and a worker started it before the second try asked: the
    # second try answers only with jobs that have not started, so no copy of a running
    # job is published.
    set_capacity(1)
    store = dispatch._store()
    job = an_id_job()
    (ready,) = store.enqueue(job, -7)
    assert dispatch.start(ready.job_id, uuid.uuid4()).status == "started"
    assert store.enqueue(job, -7, again=True) == []
    assert DispatchJob.objects.filter(task_id="an-id").count() == 1


def wait_for_enqueues_waiting(count: int) -> None:
    """Until ``count`` sessions of the test database wait for a lock (5 s at most): the
    enqueue's tries, whichever store sends them."""
    deadline, watcher = time.monotonic() + 5, connections.create_connection("default")
    try:
        with watcher.cursor() as cursor:
            while time.monotonic() < deadline:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                )
                if cursor.fetchone()[0] >= count:
                    return
                time.sleep(0.02)
    finally:
        watcher.close()
    raise AssertionError(f"{count} enqueues never waited for a lock")


@pytest.mark.skipif(connection.vendor != "postgresql", reason="two sessions at once")
def test_an_enqueue_sent_again_while_its_first_try_waits__stored_once() -> None:
    # The first try's reply is lost while it still runs on the server (it waits for its
    # line, which another step holds): the second try, sent on a new connection, must
    # wait for it rather than store the job a second time.
    set_capacity(0)
    tasks.dispatched.delay("acme")  # the line exists
    store = dispatch._store()
    job = an_id_job()
    holder = connections.create_connection("default")
    holder.set_autocommit(False)
    with holder.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM fair_jobs_dispatchtenant WHERE queue = 'fair' AND tenant = 'acme' "
            "FOR UPDATE"
        )

    errors: list[BaseException] = []

    def one_try(again: bool) -> None:
        try:
            store.enqueue(job, -7, again=again)
        except BaseException as exc:  # shown by the assertion below
            errors.append(exc)
        finally:
            connections.close_all()

    tries = [threading.Thread(target=one_try, args=(again,)) for again in (False, True)]
    try:
        for waiting, each in enumerate(tries, 1):
            each.start()
            # The first waits for the line on the server before the second is sent; the
            # second then waits for the first's receipt.
            wait_for_enqueues_waiting(waiting)
    finally:
        holder.commit()
        holder.close()
    for each in tries:
        each.join(10)
    assert errors == []
    assert DispatchJob.objects.filter(task_id="an-id").count() == 1


def test_an_enqueue_whose_reply_is_lost__the_other_jobs_its_dispatch_took__published_at_once(
    monkeypatch: pytest.MonkeyPatch, collected: list[int]
) -> None:
    # The enqueue's dispatch takes every job the room allows, not only its own: sent
    # again, it answers with all of them (its number), not leaving the others to the
    # lost-message repair a minute later.
    set_capacity(0)
    other = job_of(tasks.dispatched.delay("globex").id)
    set_capacity(2)
    cut_enqueue(monkeypatch, after_commit=True)
    own = job_of(tasks.dispatched.delay("acme").id)
    assert {own.state, job_of(other.task_id).state} == {DISPATCHED}
    assert sorted(collected) == sorted([own.pk, other.pk])


def test_the_maintenance_pass__a_dispatch_that_fails_twice__the_other_queues_dispatched(
    monkeypatch: pytest.MonkeyPatch, collected: list[int]
) -> None:
    # One queue's dispatch failing (its second try too) is logged; the pass goes on to
    # the queues after it instead of ending there.
    for queue in ("fair", "other"):
        set_capacity(0, queue)
    tasks.dispatched.delay("acme")
    other = job_of(tasks.dispatched.apply_async(("acme",), queue="other").id)
    for queue in ("fair", "other"):
        set_capacity(1, queue)
    store_class = type(dispatch._store())
    real = store_class.dispatch

    def fair_down(self: Any, queue: str, *args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        if queue == "fair":
            raise OperationalError("could not connect to server")
        return real(self, queue, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(store_class, "dispatch", fair_down)
    monkeypatch.setattr(store_class, "refresh_capacity", lambda self, *args: {})
    repaired = dispatch.repair(tasks.dispatched.app, timeout=30, lost_after=60, slack_per_node=0)
    assert collected == [other.pk] and repaired.dispatched == 1


def test_enqueue_receipts__kept_ten_minutes__then_pruned_by_the_maintenance_pass() -> None:
    from datetime import timedelta

    from django.db.models.functions import Now

    from django_fair_jobs.dispatch.models import RECEIPT_SECONDS, DispatchReceipt
    from django_fair_jobs.maintenance import run_maintenance

    tasks.dispatched.delay("acme")
    (fresh,) = DispatchReceipt.objects.all()  # the delay()'s own
    DispatchReceipt.objects.create(drawn=-5)
    DispatchReceipt.objects.filter(drawn=-5).update(
        stored_at=Now() - timedelta(seconds=RECEIPT_SECONDS + 60)
    )
    run_maintenance()
    assert list(DispatchReceipt.objects.values_list("drawn", flat=True)) == [fresh.drawn]

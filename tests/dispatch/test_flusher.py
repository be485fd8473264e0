"""Ends flushed in batches, off the job's path (:mod:`django_fair_jobs.admission.flusher`):
a dispatched job's end goes to its process's flusher thread, which ends every job handed
to it in one statement, and nothing is lost or run twice meanwhile."""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import pytest
from celery.exceptions import Reject, SoftTimeLimitExceeded
from django.db import InterfaceError, OperationalError, connection
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import admission, dispatch
from django_fair_jobs.admission import ends, flusher
from django_fair_jobs.admission.ends import LEDGER
from django_fair_jobs.dispatch.models import RUNNING, DispatchJob
from tests.conftest import runs_sql
from tests.dispatch.conftest import deliver, job_of, set_capacity
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fresh_ledger", "engine", "in_process_worker", "collected"),
]


@pytest.fixture
def end_many_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that called ``dispatch.end_many``, in order."""
    names: list[str] = []
    real = dispatch.end_many

    def recorded(*args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "end_many", recorded)
    return names


def no_thread(current: Any, target: Any, name: str) -> tuple[int, threading.Thread]:
    """In place of ``ends.own_thread``: no flusher thread starts (the test's own thread
    stands for it), so whatever is handed waits for :func:`flusher.stop`."""
    return (os.getpid(), threading.current_thread())


def needs_sql() -> None:
    if not runs_sql():
        pytest.skip("statement counts are the PostgreSQL store's; the ORM's are several")


def test_end__handed_to_the_flusher_thread__which_ends_it_and_dispatches_the_room(
    collected: list[int], end_many_threads: list[str]
) -> None:
    set_capacity(1)
    first = job_of(tasks.dispatched.delay("acme").id)
    second = job_of(tasks.dispatched.delay("acme").id)
    flusher.start()
    assert deliver(first) == "ran"
    flusher.stop()  # waits for the thread's flush
    assert not DispatchJob.objects.filter(pk=first.pk).exists()
    assert collected == [first.pk, second.pk]  # the flush dispatched the room it left
    assert end_many_threads == ["fair-jobs-flusher"]  # on every database


def test_a_copy_delivered_before_the_flush__refused__then_flushed_at_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)  # nothing flushes yet
    assert deliver(job) == "ran"
    assert DispatchJob.objects.get(pk=job.pk).state == RUNNING  # its end waits
    assert deliver(job) == "not run"  # a copy here, before the flush: never run twice
    assert flusher.stop() == 1  # what the thread did not take is flushed at shutdown
    assert not DispatchJob.objects.filter(pk=job.pk).exists()
    assert not ends.ended_here(job.pk)  # forgotten once flushed


def test_a_retry_under_the_same_task_id__runs_before_the_flush(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_capacity(2)
    job = job_of(tasks.dispatched.delay("acme").id)
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)  # nothing flushes yet
    assert deliver(job) == "ran"
    # A retry is a new row under the same task id (self.retry() stores one): not a copy.
    tasks.dispatched.apply_async(("acme",), task_id=job.task_id)
    retry = DispatchJob.objects.exclude(pk=job.pk).get(task_id=job.task_id)
    assert deliver(retry) == "ran"


def test_flush__many_ends__one_statement(collected: list[int]) -> None:
    needs_sql()
    set_capacity(2)
    jobs = [job_of(tasks.dispatched.delay(t).id) for t in ("a", "b", "c")]
    process = uuid.uuid4()
    for job in jobs[:2]:
        assert dispatch.start(job.pk, process).status == "started"
    batch = [(job.pk, process, None) for job in jobs[:2]]
    with CaptureQueriesContext(connection) as queries:
        assert flusher.flush(batch) == 2
    assert len(queries) == 1
    assert list(DispatchJob.objects.values_list("pk", flat=True)) == [jobs[2].pk]
    assert collected[-1] == jobs[2].pk


def test_a_flush_that_fails__kept__ended_at_the_next_heartbeat(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    real = dispatch.end_many
    monkeypatch.setattr(
        dispatch, "end_many", lambda *a, **k: (_ for _ in ()).throw(OperationalError("down"))
    )
    flusher.start()
    assert deliver(job) == "ran"
    flusher.stop()
    assert DispatchJob.objects.get(pk=job.pk).state == RUNNING  # kept, not lost
    assert job.pk in LEDGER.pending_ends
    assert deliver(job) == "not run"  # its end is not committed: a copy here is refused
    monkeypatch.setattr(dispatch, "end_many", real)
    assert admission.retry_pending_ends(celery_app) == 1
    assert not DispatchJob.objects.filter(pk=job.pk).exists()
    assert not ends.ended_here(job.pk)


def test_an_end_that_puts_the_job_back__not_handed__done_at_once() -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched_rejecting.delay("acme").id)
    flusher.start()
    with pytest.raises(Reject):  # requeue=True: back in its line for the redelivered copy
        deliver(job, tasks.dispatched_rejecting)
    assert LEDGER.ending == [] and LEDGER.flusher is None
    assert DispatchJob.objects.get(pk=job.pk).state != RUNNING


def test_pending_ends__retried_in_one_statement_per_process(celery_app: Any) -> None:
    # After an outage, a process may hold many ends whose flush failed: the heartbeat ends
    # them together, not one round trip each; an end of another kind goes on its own.
    set_capacity(5)
    jobs = [job_of(tasks.dispatched.delay(t).id) for t in ("a", "b", "c", "d")]
    process = uuid.uuid4()
    for job in jobs:
        assert dispatch.start(job.pk, process).status == "started"
    for job in jobs[:3]:
        ends.end_later(job.pk, process, outcome="end")
    ends.end_later(jobs[3].pk, process, outcome="back")
    with CaptureQueriesContext(connection) as queries:
        assert admission.retry_pending_ends(celery_app) == 4
    if runs_sql():  # the ORM store's end_many is several statements of its own
        assert len(queries) == 2
    assert not DispatchJob.objects.filter(pk__in=[j.pk for j in jobs[:3]]).exists()
    assert DispatchJob.objects.get(pk=jobs[3].pk).state != RUNNING
    assert LEDGER.pending_ends == {}


@pytest.mark.parametrize(
    ("options", "enabled", "stop_after"),
    [
        (None, True, flusher.STOP_TIMEOUT),  # PostgreSQL
        ({"transaction_mode": "IMMEDIATE", "timeout": 30}, True, 35.0),
        ({}, False, 10.0),  # SQLite's default: two writers could both fail to lock
    ],
)
def test_start__on_sqlite_only_with_immediate_transactions(
    monkeypatch: pytest.MonkeyPatch, options: Any, enabled: bool, stop_after: float
) -> None:
    monkeypatch.setattr(flusher, "_sqlite_options", lambda: options)
    flusher.start()
    assert LEDGER.flush_in_thread is enabled
    assert flusher._stop_timeout() == stop_after


def test_the_next_start__carries_the_unflushed_end__one_round_trip(
    monkeypatch: pytest.MonkeyPatch, collected: list[int]
) -> None:
    # The end of a process's last job travels with the start of its next one: one
    # statement and one commit for both, and the room the end left is dispatched by it.
    set_capacity(2)
    first, second, third = (job_of(tasks.dispatched.delay("acme").id) for _ in range(3))
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)  # the flusher never takes it first
    assert deliver(first) == "ran"
    assert [job_id for job_id, _, _ in LEDGER.ending] == [first.pk]
    with CaptureQueriesContext(connection) as queries:
        assert deliver(second) == "ran"
    assert not DispatchJob.objects.filter(pk=first.pk).exists()  # ended with the start
    assert not ends.ended_here(first.pk)
    assert [job_id for job_id, _, _ in LEDGER.ending] == [second.pk]  # the next to carry
    if runs_sql():  # the ORM store's start and end are several statements of their own
        starts = [q["sql"] for q in queries.captured_queries if "dispatch_start" in q["sql"]]
        assert len(starts) == 1 and "dispatch_end_many" in starts[0]
    flusher.stop()  # publishes what the carried end dispatched
    assert collected[-1] == third.pk
    assert DispatchJob.objects.get(pk=third.pk).state != RUNNING


def start_raising_once(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> list[list[int]]:
    """``dispatch.start`` raises ``error`` at its first call; returns the ends each call
    carried."""
    real, calls = dispatch.start, list[list[int]]()

    def raising_once(*args: Any, **kwargs: Any) -> dispatch.Started:
        calls.append(list(kwargs.get("ended") or []))
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "start", raising_once)
    return calls


def test_a_start_that_fails_while_carrying_ends__the_flusher_ends_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_capacity(2)
    first, second = (job_of(tasks.dispatched.delay("acme").id) for _ in range(2))
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)
    assert deliver(first) == "ran"
    calls = start_raising_once(monkeypatch, OperationalError("the connection was cut"))
    assert deliver(second) == "ran"  # tried again alone
    assert calls == [[first.pk], []]
    # Given back to the flusher, before the end of the job that just ran.
    assert [job_id for job_id, _, _ in LEDGER.ending] == [first.pk, second.pk]
    assert flusher.stop() == 2
    assert not DispatchJob.objects.filter(pk__in=[first.pk, second.pk]).exists()


def test_an_end_no_start_carries__flushed_by_the_thread_after_the_carry_wait() -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    flusher.start()
    assert deliver(job) == "ran"
    assert LEDGER.flusher is not None
    for _ in range(500):  # the thread ends it without being stopped
        # The row goes at the flush's commit, the ledger's entry just after its reply.
        if not DispatchJob.objects.filter(pk=job.pk).exists() and not ends.ended_here(job.pk):
            break
        threading.Event().wait(0.01)
    assert not DispatchJob.objects.filter(pk=job.pk).exists()
    assert LEDGER.ending == [] and not ends.ended_here(job.pk)


def test_the_carry_wait__kept_only_while_starts_come_within_it(settings: Any) -> None:
    # A process whose next job comes later than the wait (a queue with no job for it)
    # would only hold the room of its end: its next end is flushed at once.
    settings.FAIR_JOBS_DISPATCH_CARRY_WAIT = 0.5
    process = uuid.uuid4()
    LEDGER.handed_at = time.monotonic() - 5.0  # the last end, long before this start
    assert flusher.take(process) == []
    assert flusher._wait() == 0.0
    LEDGER.handed_at = time.monotonic() + 5.0  # "just now", whatever the machine's speed
    flusher.take(process)
    assert flusher._wait() == 0.5
    settings.FAIR_JOBS_DISPATCH_CARRY_WAIT = 0
    flusher.take(process)
    assert flusher._wait() == 0.0


def cut_after_commit(monkeypatch: pytest.MonkeyPatch, name: str) -> list[list[dispatch.Ready]]:
    """``dispatch.<name>`` commits, then its reply is lost (a pooler restart, a failover),
    once; returns what the lost replies held."""
    real, lost = getattr(dispatch, name), list[list[dispatch.Ready]]()

    def commit_then_cut(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if not lost:
            lost.append(list(getattr(result, "ready", result)))
            raise OperationalError("server closed the connection unexpectedly")
        return result

    monkeypatch.setattr(dispatch, name, commit_then_cut)
    return lost


def one_running_one_waiting() -> tuple[DispatchJob, DispatchJob, uuid.UUID]:
    """A queue with room for one: the first job running under a process, the next in line."""
    set_capacity(1)
    first, second = (job_of(tasks.dispatched.delay("acme").id) for _ in range(2))
    process = uuid.uuid4()
    assert dispatch.start(first.pk, process).status == "started"
    return first, second, process


def test_a_flush_whose_reply_is_lost__sent_again__publishes_what_its_room_went_to(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any, collected: list[int]
) -> None:
    # The flush committed (the job's row gone, the next job dispatched into its room) and
    # its reply was lost: sent again at the heartbeat, it finds the job ended and answers
    # with the job the first try dispatched, instead of leaving it to the lost-message
    # repair (FAIR_JOBS_DISPATCH_LOST_AFTER, a minute by default).
    first, second, process = one_running_one_waiting()
    lost = cut_after_commit(monkeypatch, "end_many")
    assert flusher.flush([(first.pk, process, celery_app)]) == 1
    assert [r.job_id for r in lost[0]] == [second.pk] and second.pk not in collected
    assert admission.retry_pending_ends(celery_app) == 1
    assert collected.count(second.pk) == 1


def test_a_carrying_start_whose_reply_is_lost__the_flusher_publishes_what_the_ends_freed(
    monkeypatch: pytest.MonkeyPatch, collected: list[int]
) -> None:
    set_capacity(2)
    first, second, third = (job_of(tasks.dispatched.delay("acme").id) for _ in range(3))
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)
    monkeypatch.setattr(admission, "REPLY_RETRY_DELAYS", (0.0, 0.0))
    assert deliver(first) == "ran"
    lost = cut_after_commit(monkeypatch, "start")
    assert deliver(second) == "ran"  # asked again alone: "again"
    assert [r.job_id for r in lost[0]] == [third.pk] and third.pk not in collected
    assert flusher.stop() == 2  # the handed-back end of the first, the second's own
    assert collected.count(third.pk) == 1


def test_an_end_whose_reply_is_lost__sent_again__publishes_what_its_room_went_to(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any, collected: list[int]
) -> None:
    first, second, process = one_running_one_waiting()
    lost = cut_after_commit(monkeypatch, "end")
    ends.end(tasks.dispatched, first.pk, process, outcome="later", delay=60.0)
    assert [r.job_id for r in lost[0]] == [second.pk] and second.pk not in collected
    assert admission.retry_pending_ends(celery_app) == 1
    assert collected.count(second.pk) == 1


@pytest.mark.parametrize(
    ("error", "runs"),
    [(InterfaceError("connection already closed"), True), (SoftTimeLimitExceeded(), False)],
    ids=["closed_connection", "soft_time_limit"],
)
def test_a_carrying_start_that_raises_anything__the_ends_go_back_to_the_flusher(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, runs: bool
) -> None:
    # A closed connection raises InterfaceError, which is no DatabaseError; a soft time
    # limit can strike anywhere. Neither may drop the ends the start carried: their rows
    # would stay running under a live process, holding their tenants' room for good.
    set_capacity(2)
    first, second = (job_of(tasks.dispatched.delay("acme").id) for _ in range(2))
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)
    monkeypatch.setattr(admission, "REPLY_RETRY_DELAYS", (0.0, 0.0))
    assert deliver(first) == "ran"
    start_raising_once(monkeypatch, error)
    if runs:
        assert deliver(second) == "ran"  # tried again on a new connection
    else:
        with pytest.raises(SoftTimeLimitExceeded):
            deliver(second)
    assert LEDGER.ending[0][0] == first.pk
    flusher.stop()
    assert not DispatchJob.objects.filter(pk=first.pk).exists()


def test_an_end_whose_connection_is_closed__kept_for_the_heartbeat(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    process = uuid.uuid4()
    assert dispatch.start(job.pk, process).status == "started"
    real = dispatch.end
    monkeypatch.setattr(
        dispatch, "end", lambda *a, **k: (_ for _ in ()).throw(InterfaceError("closed"))
    )
    ends.end(tasks.dispatched, job.pk, process, outcome="later", delay=60.0)
    assert LEDGER.pending_ends == {job.pk: (process, "later")}
    monkeypatch.setattr(dispatch, "end", real)
    assert admission.retry_pending_ends(celery_app) == 1
    assert DispatchJob.objects.get(pk=job.pk).state != RUNNING


def test_a_pending_end_whose_connection_is_closed__kept_for_the_next_heartbeat(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any, collected: list[int]
) -> None:
    first, second, process = one_running_one_waiting()
    ends.end_later(first.pk, process, outcome="end")
    collected.clear()  # the first job, published at its enqueue
    real = dispatch.end_many

    def closed(*args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        if connection.vendor == "postgresql":  # closed under Django, as a pooler leaves it
            connection.connection.close()
            connection.cursor().execute("SELECT 1")  # raises InterfaceError
        raise InterfaceError("connection already closed")

    monkeypatch.setattr(dispatch, "end_many", closed)
    assert admission.retry_pending_ends(celery_app) == 0  # the pass goes on
    assert DispatchJob.objects.filter(pk=first.pk).exists() and not collected
    monkeypatch.setattr(dispatch, "end_many", real)
    assert admission.retry_pending_ends(celery_app) == 1
    assert collected == [second.pk]


def wait_for(done: Any) -> bool:
    """Whether ``done()`` came true within about 30 s (it returns as soon as it does): the
    flusher thread works on its own, and a loaded machine may keep it waiting for a core."""
    for _ in range(3000):
        if done():
            return True
        threading.Event().wait(0.01)
    return bool(done())


def test_a_busy_process__each_end_kept_for_the_next_start__which_carries_it(
    settings: Any, end_many_threads: list[str]
) -> None:
    # A process whose starts come within the wait of the end before them keeps each end
    # for its next start, also after the thread flushed one alone: its jobs' statements
    # stay two (the enqueue, the start), not three.
    settings.FAIR_JOBS_DISPATCH_CARRY_WAIT = 30.0  # no end is flushed for its deadline here
    set_capacity(3)
    first, second, third = (job_of(tasks.dispatched.delay("acme").id) for _ in range(3))
    flusher.start()
    assert deliver(first) == "ran"  # no start came before it: the thread flushes it at once
    assert wait_for(lambda: not ends.ended_here(first.pk))
    assert deliver(second) == "ran"  # its start came within the wait: its end is kept
    assert wait_for(lambda: not LEDGER.flush_wanted.is_set())  # the thread saw it
    assert deliver(third) == "ran"
    assert not DispatchJob.objects.filter(pk=second.pk).exists()  # ended by the third's start
    assert end_many_threads == ["fair-jobs-flusher"]  # the first's flush alone
    assert [job_id for job_id, _, _ in LEDGER.ending] == [third.pk]


def test_ends_a_start_carried__the_thread_publishes_their_room_at_once__then_stops(
    settings: Any, celery_app: Any, collected: list[int]
) -> None:
    # What the room of the carried ends went to goes out when the start commits, not once
    # the job that carried them ends; and the thread ends at stop, not left behind.
    settings.FAIR_JOBS_DISPATCH_CARRY_WAIT = 30.0
    set_capacity(2)
    first, second, third = (job_of(tasks.dispatched.delay("acme").id) for _ in range(3))
    process = uuid.uuid4()
    assert dispatch.start(first.pk, process).status == "started"
    flusher.start()
    LEDGER.handed_at = time.monotonic() + 5.0  # the process's starts come within the wait
    flusher.take(process)
    assert flusher.hand(celery_app, first.pk, process)  # kept for the next start
    carrying = flusher.take(process)
    started = dispatch.start(second.pk, process, ended=[first.pk])
    assert [r.job_id for r in started.ready] == [third.pk] and third.pk not in collected
    flusher.carried(carrying, started.ready, asynchronous=False)
    assert wait_for(lambda: third.pk in collected)  # the second job is still running
    assert LEDGER.flusher is not None
    thread = LEDGER.flusher[1]
    flusher.stop()
    assert not thread.is_alive()


def test_an_end_after_the_flusher_stopped__ended_in_the_jobs_thread() -> None:
    # At shutdown the thread flushed what it held and ended: a later end is not handed to
    # a new thread, which the process's exit could stop before it flushes.
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    flusher.start()
    flusher.stop()
    assert deliver(job) == "ran"
    assert not DispatchJob.objects.filter(pk=job.pk).exists()
    assert LEDGER.ending == [] and LEDGER.flusher is None


def test_a_flush_whose_connection_is_closed__the_next_flush_asks_on_a_new_one(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    # The thread's connection is its own and nothing else closes it: kept after a cut, it
    # would fail every flush of the thread's life.
    first, _, process = one_running_one_waiting()
    real = dispatch.end_many

    def closed(*args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        monkeypatch.setattr(dispatch, "end_many", real)
        if connection.vendor == "postgresql":  # closed under Django, as a pooler leaves it
            connection.connection.close()
            connection.cursor().execute("SELECT 1")  # raises InterfaceError
        raise InterfaceError("connection already closed")

    monkeypatch.setattr(dispatch, "end_many", closed)
    assert flusher.flush([(first.pk, process, celery_app)]) == 1
    assert first.pk in LEDGER.pending_ends  # kept for the heartbeat
    assert flusher.flush([(first.pk, process, celery_app)]) == 1
    assert not DispatchJob.objects.filter(pk=first.pk).exists()


def test_a_failed_flush_of_one_process__the_ends_of_another_still_flushed(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    """A batch holding the ends of two process ids (a process reaped while alive registers
    again under a new one) is flushed one round trip per process: one that fails keeps its
    ends for the heartbeat and the next process's ends are still flushed, none lost."""
    set_capacity(2)
    first, second = (job_of(tasks.dispatched.delay("acme").id) for _ in range(2))
    old, new = uuid.uuid4(), uuid.uuid4()
    assert dispatch.start(first.pk, old).status == "started"
    assert dispatch.start(second.pk, new).status == "started"
    real = dispatch.end_many

    def down_once(*args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        monkeypatch.setattr(dispatch, "end_many", real)
        raise OperationalError("could not connect to server")

    monkeypatch.setattr(dispatch, "end_many", down_once)
    assert flusher.flush([(first.pk, old, celery_app), (second.pk, new, celery_app)]) == 2
    assert LEDGER.pending_ends == {first.pk: (old, "end")}  # kept for the heartbeat
    assert not DispatchJob.objects.filter(pk=second.pk).exists()  # flushed all the same
    assert admission.retry_pending_ends(celery_app) == 1
    assert not DispatchJob.objects.exists()


def test_a_start_takes_its_own_processs_ends__those_of_another_stay_for_the_flusher(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    """A start carries only the ends handed under its own process id (its statement is
    fenced by it); the ends of another process id stay with the flusher, which ends them
    (at the latest at shutdown), never dropped."""
    set_capacity(3)
    first, second, third = (job_of(tasks.dispatched.delay("acme").id) for _ in range(3))
    old, new = uuid.uuid4(), uuid.uuid4()
    assert dispatch.start(first.pk, old).status == "started"
    assert dispatch.start(second.pk, new).status == "started"
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)  # nothing flushes before stop
    assert flusher.hand(celery_app, first.pk, old)
    assert flusher.hand(celery_app, second.pk, new)
    carrying = flusher.take(new)
    assert [job_id for job_id, _, _ in carrying] == [second.pk]
    started = dispatch.start(third.pk, new, ended=[second.pk])
    flusher.carried(carrying, started.ready, asynchronous=False)
    assert [job_id for job_id, _, _ in LEDGER.ending] == [first.pk]
    assert flusher.stop() == 1  # the other process's end, flushed at shutdown
    assert not DispatchJob.objects.filter(pk__in=[first.pk, second.pk]).exists()
    assert not ends.ended_here(first.pk)


def test_pending_ends__a_round_trip_that_fails__ends_the_pass__the_rest_next_time(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    """The heartbeat's retry of pending ends stops at its first database error: a database
    that is gone is asked once per pass, not once per process (each try waiting its connect
    timeout would hold up the heartbeat that keeps the process alive); the ends left are
    kept and ended at the next pass, none lost."""
    set_capacity(2)
    first, second = (job_of(tasks.dispatched.delay("acme").id) for _ in range(2))
    old, new = uuid.uuid4(), uuid.uuid4()
    for job, process in ((first, old), (second, new)):
        assert dispatch.start(job.pk, process).status == "started"
        ends.end_later(job.pk, process, outcome="end")
    real, calls = dispatch.end_many, list[list[int]]()

    def down_once(ids: list[int], *args: Any, **kwargs: Any) -> list[dispatch.Ready]:
        calls.append(list(ids))
        if len(calls) == 1:
            raise OperationalError("could not connect to server")
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(dispatch, "end_many", down_once)
    assert admission.retry_pending_ends(celery_app) == 0
    assert len(calls) == 1  # the pass asked no further
    assert DispatchJob.objects.filter(state=RUNNING).count() == 2
    assert set(LEDGER.pending_ends) == {first.pk, second.pk}
    assert admission.retry_pending_ends(celery_app) == 2
    assert not DispatchJob.objects.exists() and LEDGER.pending_ends == {}


def test_a_put_back_ended_by_the_heartbeat__its_unconfirmed_start_never_made_again(
    monkeypatch: pytest.MonkeyPatch, settings: Any, celery_app: Any, in_process_worker: uuid.UUID
) -> None:
    """A job whose start did not wait for the disk, put back (``Reject(requeue=True)``) by
    an end whose reply was lost, is put back by the heartbeat's retry: that drops its
    unconfirmed start, so the confirmation after it never starts the job here again (its
    row would hold its room under this process, running nowhere, and the redelivered
    copy would be refused)."""
    if not runs_sql():
        pytest.skip("asynchronous commits are PostgreSQL's; the ORM store's commits wait")
    settings.FAIR_JOBS_DISPATCH_ASYNC_COMMIT = True
    set_capacity(1)
    job = job_of(tasks.dispatched_rejecting.delay("acme").id)
    lost = cut_after_commit(monkeypatch, "end")
    with pytest.raises(Reject):
        deliver(job, tasks.dispatched_rejecting)
    assert lost and LEDGER.pending_ends == {job.pk: (in_process_worker, "back")}
    assert LEDGER.unconfirmed_starts == {job.pk: in_process_worker}
    assert admission.retry_pending_ends(celery_app) == 1
    admission.confirm_dispatch(celery_app)
    row = DispatchJob.objects.get(pk=job.pk)
    assert row.state != RUNNING and row.process_id is None  # in its line, for its copy
    assert LEDGER.unconfirmed_starts == {}
    assert deliver(row, tasks.dispatched_rejecting, redelivered=True) == "ran"  # runs once
    assert not DispatchJob.objects.filter(pk=job.pk).exists()

"""A dispatched job's start and its flushed end commit without waiting for the disk
(``FAIR_JOBS_DISPATCH_ASYNC_COMMIT``, PostgreSQL): the process keeps them in its ledger
until the next heartbeat confirms them with one commit that does wait, and makes again
whatever a crash of the database server lost."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import admission, dispatch
from django_fair_jobs.admission import ends, flusher
from django_fair_jobs.admission.ends import LEDGER
from django_fair_jobs.dispatch.models import DISPATCHED, RUNNING, DispatchJob
from django_fair_jobs.models import WorkerProcess
from tests.conftest import runs_sql
from tests.dispatch.conftest import deliver, job_of, set_capacity
from tests.dispatch.test_flusher import no_thread
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fresh_ledger", "engine", "in_process_worker", "collected"),
]


@pytest.fixture(autouse=True)
def asynchronous(settings: Any) -> None:
    """The setting on (it is off by default); a test that turns it off overrides it."""
    settings.FAIR_JOBS_DISPATCH_ASYNC_COMMIT = True


def needs_sql() -> None:
    if not runs_sql():
        pytest.skip("asynchronous commits are PostgreSQL's; the ORM store's commits wait")


class Recorded:
    """The statements this thread's connection runs, with their parameters."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        self.calls.append((sql, params))
        return execute(sql, params, many, context)

    def asynchronous(self, name: str) -> list[bool]:
        """Per statement calling ``name``: whether it asked not to wait for the disk."""
        return [bool(p.get("async_commit")) for sql, p in self.calls if name in sql]


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    recorder = Recorded()
    with connection.execute_wrapper(recorder):
        yield recorder


def unconfirmed_job(process: uuid.UUID, *, started: bool) -> DispatchJob:
    """A dispatched job whose start this process keeps unconfirmed: ``started``, its row
    runs here (the start reached the disk); else its row shows dispatched (a crash lost
    the start)."""
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    if started:
        assert dispatch.start(job.pk, process).status == "started"
    with LEDGER.lock:
        LEDGER.unconfirmed_starts[job.pk] = process
    return job


def test_start_and_flushed_end__commit_without_waiting_for_the_disk__kept_to_confirm(
    monkeypatch: pytest.MonkeyPatch, in_process_worker: uuid.UUID, recorded: Recorded
) -> None:
    needs_sql()
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)  # the end waits for stop()
    assert deliver(job) == "ran"
    assert flusher.stop() == 1
    assert recorded.asynchronous("fair_jobs_dispatch_start(") == [True]
    assert recorded.asynchronous("fair_jobs_dispatch_end_many(") == [True]
    assert LEDGER.unconfirmed_starts == {job.pk: in_process_worker}
    assert LEDGER.unconfirmed_ends == {job.pk: in_process_worker}
    # The setting lasts for each statement's own transaction only.
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone() == ("on",)


def test_start__inside_a_transaction__waits_as_the_transaction_does(
    monkeypatch: pytest.MonkeyPatch, recorded: Recorded
) -> None:
    needs_sql()
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)
    with transaction.atomic():
        assert deliver(job) == "ran"
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone() == ("on",)  # the caller's commit is left alone
    assert recorded.asynchronous("fair_jobs_dispatch_start(") == [False]
    assert LEDGER.unconfirmed_starts == {}


@override_settings(FAIR_JOBS_DISPATCH_ASYNC_COMMIT=False)
def test_turned_off__every_commit_waits__nothing_kept(
    monkeypatch: pytest.MonkeyPatch, recorded: Recorded
) -> None:
    needs_sql()
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)
    assert deliver(job) == "ran"
    assert flusher.stop() == 1
    assert recorded.asynchronous("fair_jobs_dispatch_start(") == [False]
    assert recorded.asynchronous("fair_jobs_dispatch_end_many(") == [False]
    assert LEDGER.unconfirmed_starts == {} and LEDGER.unconfirmed_ends == {}


def test_an_end_in_the_jobs_thread__kept_with_its_start__confirmed_at_the_heartbeat(
    in_process_worker: uuid.UUID, celery_app: Any
) -> None:
    needs_sql()
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    assert deliver(job) == "ran"  # no flusher: the job ends its own row
    assert not DispatchJob.objects.filter(pk=job.pk).exists()
    # Had the start been lost, that end would have matched nothing: both are kept.
    assert LEDGER.unconfirmed_starts == {job.pk: in_process_worker}
    assert LEDGER.unconfirmed_ends == {job.pk: in_process_worker}
    assert admission.confirm_dispatch(celery_app) == 0  # nothing was lost
    assert LEDGER.unconfirmed_starts == {} and LEDGER.unconfirmed_ends == {}


def test_confirm__a_lost_start_and_a_lost_end_made_again__one_durable_commit(
    collected: list[int], in_process_worker: uuid.UUID, celery_app: Any
) -> None:
    set_capacity(2)
    running, ended, waiting = (job_of(tasks.dispatched.delay(t).id) for t in "abc")
    assert collected == [running.pk, ended.pk]
    process = in_process_worker
    assert dispatch.start(ended.pk, process).status == "started"
    # What a crash of the server that lost the last commits leaves: the running job's row
    # dispatched again (its start lost), the ended job's row running (its end lost).
    with LEDGER.lock:
        LEDGER.unconfirmed_starts.update({running.pk: process, ended.pk: process})
        LEDGER.unconfirmed_ends[ended.pk] = process
    beat_before = WorkerProcess.objects.get(pk=process).last_heartbeat_at
    with CaptureQueriesContext(connection) as queries:
        assert admission.confirm_dispatch(celery_app) == 1  # the start made again
    row = DispatchJob.objects.get(pk=running.pk)
    assert (row.state, row.process_id) == (RUNNING, process)  # started again, here
    assert not DispatchJob.objects.filter(pk=ended.pk).exists()  # ended again
    assert collected[-1] == waiting.pk  # the room it left went to the next job
    assert LEDGER.unconfirmed_starts == {} and LEDGER.unconfirmed_ends == {}
    assert WorkerProcess.objects.get(pk=process).last_heartbeat_at > beat_before
    if runs_sql():
        # The process's row written by a commit that waits for the disk, whatever the
        # session's default, then the starts made again, then the ends.
        statements = [q["sql"] for q in queries.captured_queries]
        assert statements[0] == "BEGIN" and statements[-1] == "COMMIT"  # one transaction
        assert len(statements) == 5
        assert "set_config('synchronous_commit', 'local', true)" in statements[1]


def test_confirm__nothing_lost__rows_untouched__ledger_emptied(
    in_process_worker: uuid.UUID, celery_app: Any
) -> None:
    job = unconfirmed_job(in_process_worker, started=True)
    assert admission.confirm_dispatch(celery_app) == 0
    row = DispatchJob.objects.get(pk=job.pk)
    assert (row.state, row.process_id) == (RUNNING, in_process_worker)
    assert LEDGER.unconfirmed_starts == {}


def test_confirm__process_reaped__its_jobs_were_put_back__nothing_started_again(
    in_process_worker: uuid.UUID, celery_app: Any
) -> None:
    # No process row: the reap put its jobs back; starting them here again would take
    # them from the copies that run them now.
    job = unconfirmed_job(in_process_worker, started=False)
    WorkerProcess.objects.filter(pk=in_process_worker).delete()
    assert admission.confirm_dispatch(celery_app) == 0
    assert LEDGER.unconfirmed_starts == {}
    assert DispatchJob.objects.get(pk=job.pk).state == DISPATCHED


def test_an_end_whose_start_was_lost__kept__the_confirmation_starts_then_ends_it(
    in_process_worker: uuid.UUID, celery_app: Any
) -> None:
    # A crash lost the start; the job's own end (in its thread) then matched no row and
    # wrote nothing, so it covers nothing: the job would be published again and run twice.
    job = unconfirmed_job(in_process_worker, started=False)
    ends.end(tasks.dispatched, job.pk, in_process_worker, outcome="end")
    assert DispatchJob.objects.get(pk=job.pk).state == DISPATCHED  # the end found nothing
    assert LEDGER.unconfirmed_ends == {job.pk: in_process_worker}
    assert admission.confirm_dispatch(celery_app) == 1
    assert not DispatchJob.objects.filter(pk=job.pk).exists()
    assert LEDGER.unconfirmed_starts == {} and LEDGER.unconfirmed_ends == {}


@pytest.mark.parametrize("pending", [False, True])
def test_a_job_put_back__never_started_here_again_by_the_confirmation(
    in_process_worker: uuid.UUID, celery_app: Any, pending: bool
) -> None:
    job = unconfirmed_job(in_process_worker, started=True)
    if pending:  # put back, its reply lost: kept to be sent again
        dispatch.end(job.pk, in_process_worker, outcome="back", limit=0)
        ends.end_later(job.pk, in_process_worker, outcome="back")
    else:  # Reject(requeue=True), the fence's error path
        ends.end(tasks.dispatched, job.pk, in_process_worker, outcome="back")
    admission.confirm_dispatch(celery_app)
    row = DispatchJob.objects.get(pk=job.pk)
    assert row.state != RUNNING and row.process_id is None  # in its line, for its copy


def test_a_job_put_back_while_the_confirmation_runs__waits_for_it__not_started_again(
    monkeypatch: pytest.MonkeyPatch, in_process_worker: uuid.UUID, celery_app: Any
) -> None:
    # The confirmation copies the job's unconfirmed start; the job's thread then puts it
    # back (Reject(requeue=True)). Were the end to commit between the copy and the
    # restart, the restart would take the job from its line and run it here, where it
    # no longer runs, and its redelivered copy would be refused.
    job = unconfirmed_job(in_process_worker, started=True)
    real = dispatch.confirm

    def put_back() -> None:
        ends.end(tasks.dispatched, job.pk, in_process_worker, outcome="back")
        connections.close_all()

    ender = threading.Thread(target=put_back)

    def confirm_with_an_end_under_way(*args: Any) -> Any:
        ender.start()
        ender.join(0.5)  # it waits for the confirmation's lock
        return real(*args)

    monkeypatch.setattr(dispatch, "confirm", confirm_with_an_end_under_way)
    admission.confirm_dispatch(celery_app)
    ender.join(10)
    row = DispatchJob.objects.get(pk=job.pk)
    assert row.state != RUNNING and row.process_id is None
    assert LEDGER.unconfirmed_starts == {}


def test_an_end_carried_by_a_start__kept_to_confirm(
    monkeypatch: pytest.MonkeyPatch, in_process_worker: uuid.UUID
) -> None:
    # The start that carried the end did not wait for the disk: a crash of the server
    # can lose the end with it, and the job would keep its room while the process lives.
    needs_sql()
    set_capacity(2)
    first, second = (job_of(tasks.dispatched.delay("acme").id) for _ in range(2))
    flusher.start()
    monkeypatch.setattr(ends, "own_thread", no_thread)
    assert deliver(first) == "ran"
    assert deliver(second) == "ran"  # its start carried the first's end
    assert not DispatchJob.objects.filter(pk=first.pk).exists()
    assert LEDGER.unconfirmed_ends == {first.pk: in_process_worker}


def test_an_end_kept_for_the_heartbeat__its_unconfirmed_start_kept_until_it_ends(
    in_process_worker: uuid.UUID, celery_app: Any
) -> None:
    # A crash lost the start and the flush of the job's end failed: the confirmation
    # leaves the start for after that end, which then matches no row and is kept with
    # it, so the next confirmation starts the job again and ends it.
    job = unconfirmed_job(in_process_worker, started=False)
    ends.end_later(job.pk, in_process_worker, outcome="end")
    assert admission.confirm_dispatch(celery_app) == 0
    assert admission.retry_pending_ends(celery_app) == 1
    assert admission.confirm_dispatch(celery_app) == 1
    assert not DispatchJob.objects.filter(pk=job.pk).exists()

"""Cancelling a tenant's backlog: fair dispatch's line, parked jobs and planned jobs, in
bounded batches, with the counters kept true, results marked REVOKED, the history written;
from Python, the management command and the admin (with its permission)."""

from __future__ import annotations

import uuid
from io import StringIO
from typing import Any

import pytest
from celery.result import AsyncResult
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import backlog, dispatch, explanations
from django_fair_jobs.db import database_now
from django_fair_jobs.dispatch.models import (
    DISPATCHED,
    FAILED,
    SCHEDULED,
    WAITING,
    DispatchJob,
    DispatchTenant,
)
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.models import LimitChange, ParkedJob, PlannedJob, TenantQueueSlot
from tests.dispatch.test_rule import PROCESS, published, run_one, set_capacity  # noqa: F401
from tests.test_admin_console import acquire, login, park, process  # noqa: F401
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]

LINES = "/admin/fair_jobs/dispatchtenant/"
SLOTS = "/admin/fair_jobs/tenantqueueslot/"
JOBS = "/admin/fair_jobs/dispatchjob/"


def line(tenant: str) -> DispatchTenant:
    return DispatchTenant.objects.get(queue="fair", tenant=tenant)


def flood(published: list[int]) -> list[str]:  # noqa: F811
    """One queue slot: flood's first job is dispatched; 24 wait, 2 are scheduled (a
    countdown); small has 3 waiting. Returns flood's jobs not dispatched."""
    set_capacity(1)
    ids = [tasks.dispatched.delay("flood").id for _ in range(25)]
    ids += [tasks.dispatched.apply_async(("flood",), countdown=3600).id for _ in range(2)]
    for _ in range(3):
        tasks.dispatched.delay("small")
    assert len(published) == 1
    return ids[1:]


def test_dispatch_line__cancelled_in_batches__counts_true__the_rest_goes_on(
    published: list[int],  # noqa: F811
) -> None:
    waiting = flood(published)
    done = backlog.cancel("flood", queue="fair", batch=10, user="ops", reason="runaway import")
    assert (done.dispatch, done.parked, done.planned, done.batches) == (26, 0, 0, 3)
    assert sorted(done.task_ids) == sorted(waiting)
    assert not DispatchJob.objects.filter(tenant="flood", state__in=[SCHEDULED, WAITING]).exists()
    assert DispatchJob.objects.filter(tenant="flood", state=DISPATCHED).count() == 1
    assert (line("flood").waiting, line("flood").head_id) == (0, None)
    small = DispatchJob.objects.filter(tenant="small").order_by("id")
    assert (line("small").waiting, line("small").head_id) == (3, small[0].pk)
    # The queue goes on: flood's running job ends and the room goes to small.
    ready = run_one(published[0])
    assert [DispatchJob.objects.get(pk=r.job_id).tenant for r in ready] == ["small"]
    (change,) = LimitChange.objects.filter(field="cancelled")
    assert (change.tenant, change.queue, change.user, change.new_value) == (
        "flood", "fair", "ops", "26",
    )  # fmt: skip
    assert "runaway import" in change.note


def test_cancelled_jobs__asyncresult_says_revoked(published: list[int]) -> None:  # noqa: F811
    waiting = flood(published)
    backlog.cancel("flood")
    assert str(AsyncResult(waiting[0]).state) == "REVOKED"
    assert str(AsyncResult(waiting[-1]).state) == "REVOKED"


def test_partly_cancelled_line__head_is_the_oldest_left(published: list[int]) -> None:  # noqa: F811
    set_capacity(0)
    for _ in range(3):
        tasks.dispatched.delay("t")
    keep = tasks.dispatched_capped.delay("t").id  # another task, same line
    done = backlog.cancel("t", task=tasks.dispatched.name)
    assert done.dispatch == 3
    kept = DispatchJob.objects.get(task_id=keep)
    assert (line("t").waiting, line("t").head_id) == (1, kept.pk)


def test_a_countdown_stored_in_a_transaction__cancelled_before_it_has_a_line(
    published: list[int],  # noqa: F811
) -> None:
    # A countdown stored inside its caller's transaction waits without a line until it
    # comes due; a cancel of every queue looked at the tenant's lines only, found none,
    # and left the job to run.
    set_capacity(1)
    with transaction.atomic():
        task_id = tasks.dispatched.apply_async(("later",), countdown=3600).id
    assert not DispatchTenant.objects.filter(tenant="later").exists()
    done = backlog.cancel("later")
    assert (done.dispatch, done.task_ids) == (1, [task_id])
    assert not DispatchJob.objects.filter(task_id=task_id).exists()


def test_parked_and_planned__cancelled__counters_true(process: uuid.UUID) -> None:  # noqa: F811
    acquire(process, "running", tenant="flood")  # its slot is full: the next jobs park
    for n in range(3):
        park(f"p{n}", tenant="flood")
    planned = [tasks.planned.delay("flood").id for _ in range(4)]
    tasks.planned.delay("other")
    slot = TenantQueueSlot.objects.get(tenant="flood", queue="q")
    assert slot.parked_jobs == 3
    assert backlog.count("flood").total == 7
    done = backlog.cancel("flood", batch=2)
    assert (done.parked, done.planned) == (3, 4)
    assert not ParkedJob.objects.exists()
    slot.refresh_from_db()
    assert slot.parked_jobs == 0
    assert list(PlannedJob.objects.values_list("tenant", flat=True)) == ["other"]
    assert str(AsyncResult(planned[0]).state) == "REVOKED"


def test_parked_jobs__dropped_per_line_not_per_job__woken_ones_stay(
    process: uuid.UUID,  # noqa: F811
) -> None:
    def statements_to_drop(n: int) -> int:
        ParkedJob.objects.all().delete()
        TenantQueueSlot.objects.filter(tenant="flood").update(parked_jobs=0)
        for i in range(n):
            park(f"p{n}-{i}", tenant="flood")
        with CaptureQueriesContext(connection) as queries:
            dropped = lease_store.drop_parked_of("flood", "q", None, 1000)
        assert len(dropped) == n
        return len(queries.captured_queries)

    acquire(process, "running", tenant="flood")
    assert statements_to_drop(3) == statements_to_drop(30)
    park("woken", tenant="flood")
    park("waits", tenant="flood")
    ParkedJob.objects.filter(task_id="woken").update(woken_at=database_now())
    assert lease_store.drop_parked_of("flood", None, None, 1000) == ["waits"]
    assert list(ParkedJob.objects.values_list("task_id", flat=True)) == ["woken"]
    assert TenantQueueSlot.objects.get(tenant="flood", queue="q").parked_jobs == 1


def test_nothing_waiting__no_history_line() -> None:
    done = backlog.cancel("nobody")
    assert (done.total, done.batches) == (0, 0)
    assert not LimitChange.objects.exists()


def test_bad_batch__clear_error__nothing_cancelled(published: list[int]) -> None:  # noqa: F811
    flood(published)
    with pytest.raises(ValueError, match="batch must be a whole number"):
        backlog.cancel("flood", batch=0)
    with pytest.raises(CommandError, match="--batch wants a whole number"):
        call_command("fair_jobs_cancel", "flood", "--batch", "lots")
    assert line("flood").waiting == 24


def test_command__dry_run_counts__then_cancels(published: list[int]) -> None:  # noqa: F811
    flood(published)
    out = StringIO()
    call_command("fair_jobs_cancel", "flood", "--queue", "fair", "--dry-run", stdout=out)
    assert "Would cancel 26 waiting job(s) of flood on fair" in out.getvalue()
    assert line("flood").waiting == 24
    out = StringIO()
    call_command("fair_jobs_cancel", "flood", "--batch", "100", stdout=out)
    assert "Cancelled 26 waiting job(s)" in out.getvalue()
    assert LimitChange.objects.get(field="cancelled").source == "command"


def test_command__its_result_said_once__logged_below_warning(
    published: list[int],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A project without LOGGING prints a WARNING record on stderr (Python's last resort
    # handler): the command's own line would then show twice.
    import logging

    flood(published)
    with caplog.at_level(logging.DEBUG, logger="django_fair_jobs"):
        call_command("fair_jobs_cancel", "flood", stdout=StringIO())
    said = [r for r in caplog.records if "Cancelled" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno < logging.WARNING


def test_admin__action_needs_the_cancel_permission(
    client: Client,
    published: list[int],  # noqa: F811
) -> None:
    flood(published)
    login(client, "viewer", perms=("view_dispatchtenant",))
    page = client.get(LINES)
    assert page.status_code == 200
    assert "cancel_backlog" not in page.content.decode()
    pk = line("flood").pk
    refused = client.post(LINES, {"action": "cancel_backlog", "_selected_action": [str(pk)]})
    assert refused.status_code in (200, 302)
    assert line("flood").waiting == 24  # an action not offered does nothing

    client.logout()
    login(client, "lead", perms=("view_dispatchtenant", "cancel_backlog"))
    assert "cancel_backlog" in client.get(LINES).content.decode()
    # First a confirmation page that counts what would go; nothing is cancelled yet.
    asked = client.post(LINES, {"action": "cancel_backlog", "_selected_action": [str(pk)]})
    assert asked.status_code == 200
    html = asked.content.decode()
    assert 'id="fair-cancel"' in html and 'data-tenant="flood"' in html
    assert 'id="fair-cancel-total">26 waiting job(s) now' in html
    assert '<input type="hidden" name="post" value="yes">' in html
    assert line("flood").waiting == 24
    confirmed = {"action": "cancel_backlog", "_selected_action": [str(pk)], "post": "yes",
                 "reason": "runaway import"}  # fmt: skip
    assert client.post(LINES, confirmed).status_code == 302
    assert line("flood").waiting == 0
    change = LimitChange.objects.get(field="cancelled")
    assert (change.user, change.source) == ("lead", "admin")
    assert change.note.endswith(": runaway import")


def test_admin__slot_rows_action__cancels_that_queue_only(
    client: Client,
    process: uuid.UUID,  # noqa: F811
) -> None:
    acquire(process, "running", tenant="flood")
    park("a1", tenant="flood")
    tasks.planned.delay("flood")  # another queue than the slot's: kept
    login(client, "lead", perms=("view_tenantqueueslot", "cancel_backlog"))
    slot: Any = TenantQueueSlot.objects.get(tenant="flood", queue="q")
    chosen = {"action": "cancel_backlog", "_selected_action": [str(slot.pk)]}
    assert "1 waiting job(s) now" in client.post(SLOTS, chosen).content.decode()
    assert ParkedJob.objects.count() == 1
    client.post(SLOTS, {**chosen, "post": "yes"})
    assert not ParkedJob.objects.exists()
    assert PlannedJob.objects.filter(tenant="flood").count() == 1


def test_unknown_ids_are_not_touched() -> None:
    assert backlog.cancel(str(uuid.uuid4())).total == 0
    assert PROCESS is not None


def failed(tenant: str) -> DispatchJob:
    """One of ``tenant``'s jobs dispatched, then rejected by a worker that has no such task:
    it ends failed, in no line and holding no room."""
    from celery import current_app

    set_capacity(1)
    job = DispatchJob.objects.get(task_id=tasks.dispatched.delay(tenant).id)
    dispatch.unregistered(current_app, job.pk, tasks.dispatched.name)
    job.refresh_from_db()
    assert job.state == FAILED
    return job


def test_failed_dispatched_job__cancelled_with_the_backlog__revoked(
    published: list[int],  # noqa: F811
) -> None:
    # A failed job could be put back in line and nothing else: a cancel of the tenant's
    # backlog left it (as it cancels the planner's failed jobs), and no command or action
    # removed it.
    job = failed("acme")
    tasks.dispatched.delay("acme")  # dispatched into the room the failed job gave back
    tasks.dispatched.delay("acme")  # waiting in line
    assert backlog.count("acme").dispatch == 2
    done = backlog.cancel("acme", reason="bad payload")
    assert (done.dispatch, done.failed) == (2, 1)
    assert "1 of them failed" in str(done)
    assert not DispatchJob.objects.filter(tenant="acme").exclude(state=DISPATCHED).exists()
    assert str(AsyncResult(job.task_id).state) == "REVOKED"
    assert "1 failed" in LimitChange.objects.get(field="cancelled").note


def test_failed_job_on_a_queue_without_its_line__found_by_a_cancel_of_every_queue(
    engine: str,
    published: list[int],  # noqa: F811
) -> None:
    job = failed("gone")
    DispatchTenant.objects.filter(tenant="gone").delete()  # an empty line is dropped
    out = StringIO()
    call_command("fair_jobs_cancel", "gone", stdout=out)
    assert "1 of them failed" in out.getvalue()
    assert not DispatchJob.objects.filter(pk=job.pk).exists()
    if engine == "sql":
        # The cancel held the tenant's line, made for it (a failed job put back meanwhile
        # would have waited for it to make the line), and its counts are true. (SQLite
        # takes one writer at a time: the ORM path needs no line to hold.)
        made = line("gone")
        assert (made.waiting, made.in_flight, made.head_id) == (0, 0, None)


def test_command_failed__only_failed_jobs_of_a_tenant_or_of_all__waiting_left(
    published: list[int],  # noqa: F811
) -> None:
    # After a bad deploy (a task missing on the workers) an operator drops the failed jobs
    # from the command line, of one tenant or of all, and leaves the waiting jobs alone.
    ours, other, also = failed("acme"), failed("other"), failed("acme")
    set_capacity(0)
    waiting = DispatchJob.objects.get(task_id=tasks.dispatched.delay("acme").id)
    out = StringIO()
    call_command("fair_jobs_cancel", "acme", "--failed", "--dry-run", stdout=out)
    assert "Would cancel 2 failed job(s) of acme on every queue of every task" in out.getvalue()
    assert DispatchJob.objects.filter(pk__in=[ours.pk, also.pk]).count() == 2
    call_command("fair_jobs_cancel", "acme", "--failed", "--batch", "1", stdout=out)
    assert "Cancelled 2 failed job(s) of acme" in out.getvalue()
    assert not DispatchJob.objects.filter(pk__in=[ours.pk, also.pk]).exists()
    assert DispatchJob.objects.get(pk=waiting.pk).state == WAITING  # not failed: kept
    assert str(AsyncResult(ours.task_id).state) == "REVOKED"
    assert DispatchJob.objects.filter(pk=other.pk).exists()
    assert LimitChange.objects.filter(field="cancelled", tenant="acme").count() == 2  # batches
    # Without a tenant: every tenant's failed jobs on the queue.
    call_command("fair_jobs_cancel", "--failed", "--queue", "fair", stdout=out)
    assert "Cancelled 1 failed job(s) of every tenant on fair" in out.getvalue()
    assert not DispatchJob.objects.filter(state=FAILED).exists()
    assert DispatchJob.objects.filter(pk=waiting.pk).exists()
    with pytest.raises(CommandError, match="TENANT, or --failed"):
        call_command("fair_jobs_cancel")


def test_admin__failed_jobs_cancelled_by_selection__others_left(
    client: Client,
    published: list[int],  # noqa: F811
) -> None:
    job = failed("acme")
    other = DispatchJob.objects.get(task_id=tasks.dispatched.delay("acme").id)
    chosen = {"action": "cancel_failed", "_selected_action": [str(job.pk), str(other.pk)]}
    login(client, "viewer", perms=("view_dispatchjob",))
    assert "cancel_failed" not in client.get(JOBS).content.decode()
    client.post(JOBS, chosen)
    assert DispatchJob.objects.filter(pk=job.pk).exists()  # not offered, not done

    client.logout()
    login(client, "lead", perms=("view_dispatchjob", "cancel_backlog"))
    none = {"action": "cancel_failed", "_selected_action": [str(other.pk)]}
    refused = client.post(JOBS, none, follow=True).content.decode()
    assert "None of the selected jobs has failed" in refused
    # First a page that lists what would go (the failed job only) and posts back its id
    # alone; nothing goes yet.
    html = client.post(JOBS, chosen).content.decode()
    assert 'id="fair-cancel-failed"' in html and job.task_id in html
    assert other.task_id not in html and f'value="{other.pk}"' not in html
    assert f'name="_selected_action" value="{job.pk}"' in html
    assert 'id="fair-cancel-total">1 failed job(s)' in html
    assert DispatchJob.objects.filter(pk=job.pk).exists()
    confirmed = {**chosen, "post": "yes", "reason": "bad payload"}
    answer = client.post(JOBS, confirmed, follow=True)
    assert "Cancelled 1 failed job(s)" in answer.content.decode()
    assert not DispatchJob.objects.filter(pk=job.pk).exists()
    assert DispatchJob.objects.filter(pk=other.pk).exists()  # not failed: left
    assert str(AsyncResult(job.task_id).state) == "REVOKED"
    change = LimitChange.objects.get(field="cancelled")
    assert (change.tenant, change.queue, change.user, change.source) == (
        "acme", "fair", "lead", "admin",
    )  # fmt: skip
    assert change.note == "1 failed in fair dispatch: bad payload"


def test_explain__a_failed_job__says_how_to_cancel_it(
    published: list[int],  # noqa: F811
) -> None:
    job = failed("acme")
    summary = explanations.explain(job.task_id).summary
    assert "put it back in its line" in summary
    assert "or cancel it (the admin's action 'Cancel the selected failed jobs'" in summary


def test_failed_jobs__cancelled_in_batches__history_per_batch(
    published: list[int],  # noqa: F811
) -> None:
    jobs = [failed("acme"), failed("acme")]
    with pytest.raises(ValueError, match="batch must be a whole number"):
        backlog.cancel_failed([j.pk for j in jobs], batch=0)
    assert backlog.cancel_failed([j.pk for j in jobs], batch=1, user="ops") == 2
    assert not DispatchJob.objects.filter(state=FAILED).exists()
    assert LimitChange.objects.filter(field="cancelled", tenant="acme").count() == 2

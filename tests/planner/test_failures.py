"""The planner when a job cannot be published, or when a promoted row is left behind: one
job never stops the others, and no promoted row stops the queue's planners for good."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import OperationalError
from django.test import Client
from django.utils import timezone

from django_fair_jobs import planner
from django_fair_jobs.explanations import explain
from django_fair_jobs.models import PlannedJob
from django_fair_jobs.planner import store as planner_store
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _clean(broker_env: dict[str, str]) -> None:
    tasks.PLAN_WEIGHTS.clear()


def run_planner() -> planner.RunReport:
    report = planner.run(tasks.planned, due_only=False)
    assert report is not None
    return report


def unpublishable() -> Any:
    # A real refusal at publish that the JSON check at enqueue cannot see: the message's
    # serializer does not exist on the publisher (as msgpack refuses an int >= 2**64).
    return tasks.planned.apply_async(("bad",), serializer="no-such-serializer")


def test_unpublishable_job__other_tenants_still_promoted__it_ends_failed_and_visible(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = unpublishable()
    good = []
    # "bad" sorts first: on a tie of passes it is served first in every run.
    for _ in range(planner.PUBLISH_ATTEMPTS + 1):
        good.append(tasks.planned.delay("good").id)
        report = run_planner()
        assert report.counts.get("good") == 1
    promoted = set(
        PlannedJob.objects.filter(promoted_at__isnull=False).values_list("task_id", flat=True)
    )
    assert promoted == set(good)
    row = PlannedJob.objects.get(task_id=bad.id)
    assert row.failed_at is not None and row.promoted_at is None
    assert row.attempts == planner.PUBLISH_ATTEMPTS
    assert "no-such-serializer" in row.last_error
    # Failed for good: promotion skips it.
    assert "bad" not in run_planner().counts
    assert PlannedJob.objects.get(task_id=bad.id).attempts == planner.PUBLISH_ATTEMPTS
    # Visible: explain, status, the result.
    found = explain(bad.id)
    assert found.state == "failed" and "no-such-serializer" in found.details["last_error"]
    call_command("fair_jobs_status", "--json")
    (plan,) = [
        p
        for p in json.loads(capsys.readouterr().out)["planners"]
        if p["task"] == tasks.planned.name
    ]
    (bad_tenant,) = [t for t in plan["tenants"] if t["tenant"] == "bad"]
    assert bad_tenant["failed"] == 1 and bad_tenant["pending"] == 0
    call_command("fair_jobs_status")
    assert "1 failed" in capsys.readouterr().out
    assert bad.state == "FAILURE" and "no-such-serializer" in str(bad.result)


def test_unpublishable_job__the_rest_of_its_tenants_batch_is_promoted() -> None:
    first = tasks.planned.delay("acme")
    bad = tasks.planned.apply_async(("acme",), serializer="no-such-serializer")
    last = tasks.planned.delay("acme")
    report = run_planner()
    assert report.counts == {"acme": 2}
    assert set(
        PlannedJob.objects.filter(promoted_at__isnull=False).values_list("task_id", flat=True)
    ) == {first.id, last.id}
    row = PlannedJob.objects.get(task_id=bad.id)
    assert row.attempts == 1 and row.failed_at is None  # tried again next run
    assert explain(bad.id).state == "pending"


def test_failed_job__put_back_in_line_by_the_operator() -> None:
    bad = unpublishable()
    for _ in range(planner.PUBLISH_ATTEMPTS):
        run_planner()
    assert PlannedJob.objects.get(task_id=bad.id).failed_at is not None
    assert planner_store.put_back_failed(PlannedJob.objects.filter(task_id=bad.id)) == 1
    row = PlannedJob.objects.get(task_id=bad.id)
    assert row.failed_at is None and row.attempts == 0 and row.last_error


def test_admin__failed_jobs_filtered_and_put_back_in_line(client: Client) -> None:
    bad = unpublishable()
    tasks.planned.delay("good")
    for _ in range(planner.PUBLISH_ATTEMPTS):
        run_planner()
    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    page = client.get("/admin/fair_jobs/plannedjob/?state=failed")
    assert page.status_code == 200
    assert bad.id.encode() in page.content and b"no-such-serializer" in page.content
    assert page.context["cl"].result_count == 1
    row = PlannedJob.objects.get(task_id=bad.id)
    client.post(
        "/admin/fair_jobs/plannedjob/",
        {"action": "put_back_failed", "_selected_action": [str(row.pk)]},
    )
    row.refresh_from_db()
    assert row.failed_at is None and row.attempts == 0
    assert explain(bad.id).state == "pending"


def _broker_errors() -> list[Exception]:
    import amqp.exceptions
    from kombu.exceptions import OperationalError as BrokerDown

    return [
        BrokerDown("connection refused"),
        # What py-amqp raises while RabbitMQ stops (stop_app, a restart): not a kombu or
        # an OS error, yet the broker's fault, not the job's.
        amqp.exceptions.ConnectionForced("CONNECTION_FORCED - broker forced connection closure"),
        amqp.exceptions.RecoverableConnectionError("connection already closed"),
    ]


@pytest.mark.parametrize("error", _broker_errors(), ids=lambda e: type(e).__name__)
def test_broker_unreachable__the_batch_stays_in_line_uncounted(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(2):
        tasks.planned.delay("acme")

    def down(app: Any, row: PlannedJob) -> None:
        raise error

    monkeypatch.setattr(planner, "_publish", down)
    for _ in range(planner.PUBLISH_ATTEMPTS + 1):
        assert run_planner().promoted == 0
    assert not PlannedJob.objects.filter(attempts__gt=0).exists()
    assert not PlannedJob.objects.filter(failed_at__isnull=False).exists()


@pytest.mark.skipif(
    not settings.CELERY_BROKER_URL.startswith("redis://"), reason="a Redis error reply"
)
def test_a_broker_that_answers_and_refuses_the_message__counted__the_job_ends_failed() -> None:
    # Redis answers, and refuses the push: the queue's key holds a string. kombu's retry
    # wraps the error reply in the same OperationalError as a lost connection; taken for
    # an outage, the job stayed in line for ever, never counted, never failed.
    import redis

    bad = tasks.planned.delay("bad")
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.set("fair", "not a list")
    try:
        for _ in range(planner.PUBLISH_ATTEMPTS):
            run_planner()
    finally:
        client.delete("fair")
    row = PlannedJob.objects.get(task_id=bad.id)
    assert row.failed_at is not None and row.attempts == planner.PUBLISH_ATTEMPTS
    assert "WRONGTYPE" in row.last_error


def test_a_key_error_of_the_publish__counted__the_job_ends_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kombu's Redis transport lists KeyError among its connection errors (its own
    # bookkeeping); taken from there for an outage, a KeyError of the job's own publish (a
    # router or a serializer that looks up a missing key) kept the job in line for ever,
    # never counted, never failed.
    job = tasks.planned.delay("acme")

    def missing_key(app: Any, row: PlannedJob) -> None:
        raise KeyError("route")

    monkeypatch.setattr(planner, "_publish", missing_key)
    for _ in range(planner.PUBLISH_ATTEMPTS):
        run_planner()
    row = PlannedJob.objects.get(task_id=job.id)
    assert row.failed_at is not None and row.attempts == planner.PUBLISH_ATTEMPTS
    assert row.last_error.startswith("KeyError")


def test_started_fails_once__retried_from_the_heartbeat__the_planner_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django_fair_jobs import db

    job = tasks.planned.delay("acme")
    run_planner()
    original = planner_store.started
    failures: list[str] = []

    def fails_once(task_id: str) -> bool:
        if not failures:
            failures.append(task_id)
            raise OperationalError("canceling statement due to lock timeout")
        return original(task_id)

    monkeypatch.setattr(planner_store, "started", fails_once)
    planner.started(job.id)  # the job runs; its DELETE failed
    assert failures == [job.id] and PlannedJob.objects.filter(task_id=job.id).exists()
    promoted_at = PlannedJob.objects.get(task_id=job.id).promoted_at
    assert promoted_at is not None
    monkeypatch.setattr(
        db, "database_now", lambda alias="default": promoted_at + timedelta(seconds=60)
    )
    tasks.planned.delay("other")
    assert run_planner().skipped_for_backpressure  # 60 s > the 30 s threshold
    assert planner.retry_pending_starts() == 1
    assert not PlannedJob.objects.filter(task_id=job.id).exists()
    report = run_planner()
    assert not report.skipped_for_backpressure and report.counts == {"other": 1}
    assert planner.retry_pending_starts() == 0  # nothing left to retry


def test_promoted_row_far_older_than_the_threshold__put_back_in_line__planner_not_stopped() -> None:
    lost = tasks.planned.delay("lost")
    run_planner()
    # Its message vanished (a purged broker): the row would stay promoted for ever.
    stale = timezone.now() - timedelta(days=2)
    PlannedJob.objects.filter(task_id=lost.id).update(promoted_at=stale)
    tasks.planned.delay("acme")
    report = run_planner()
    assert not report.skipped_for_backpressure
    # The lost job is published again (at least once), with the others.
    assert report.counts == {"acme": 1, "lost": 1}
    row = PlannedJob.objects.get(task_id=lost.id)
    assert row.promoted_at is not None and row.promoted_at > stale


def test_stale_promoted_row_of_another_task__ignored_in_the_latency__left_to_its_own_planner() -> (
    None
):
    # A planned task whose planner runs nowhere any more left a promoted row on our queue.
    PlannedJob.objects.create(
        task_name="gone.task", tenant="x", queue="fair", task_id="gone-1", signature="{}",
        promoted_at=timezone.now() - timedelta(days=2),
    )  # fmt: skip
    tasks.planned.delay("acme")
    report = run_planner()
    assert not report.skipped_for_backpressure and report.counts == {"acme": 1}
    assert report.depth == 0  # measured before this run's promotion, without the stale row
    assert PlannedJob.objects.get(task_id="gone-1").promoted_at is not None  # not ours


def test_a_failed_planned_job__the_command_explain_gives__cancels_it() -> None:
    # Explain's advice for a failed planned job is a command: copied as it is, it must
    # work, here for a tenant that an unquoted command line would read as an option.
    import io
    import re
    import shlex

    bad = tasks.planned.apply_async(("-bad",), serializer="no-such-serializer")
    for _ in range(planner.PUBLISH_ATTEMPTS):
        run_planner()
    found = explain(bad.id)
    assert found.state == "failed"
    command = re.search(r"manage\.py (fair_jobs_cancel [^)]*)\)", found.summary)
    assert command is not None, found.summary
    name, *args = shlex.split(command.group(1))
    call_command(name, *args, stdout=io.StringIO())
    assert not PlannedJob.objects.filter(task_id=bad.id).exists()

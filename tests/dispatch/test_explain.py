"""explain() for jobs of fair dispatch: in every state their row can be in, including
published to the broker and not started, and at a cost that does not grow with the job's
place in its line."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import dispatch, explain, explanations
from django_fair_jobs.dispatch.models import DispatchJob
from tests.dispatch.test_rule import PROCESS, published, set_capacity  # noqa: F401
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]


def test_waiting__its_line_its_place_and_why(published: list[int]) -> None:  # noqa: F811
    ids = [tasks.dispatched.delay("acme").id for _ in range(3)]
    found = explain(ids[2])
    assert found.state == "waiting"
    assert (found.details["tenant"], found.details["queue"]) == ("acme", "fair")
    assert found.details["ahead_in_its_line"] == 2
    assert found.details["tenant_waiting"] == 3
    # One reason, never two that contradict ("every process busy" and "no live worker").
    assert "no live worker consumes fair: start one with -Q fair" in found.summary
    assert "busy" not in found.summary
    assert explain(ids[0]).details["ahead_in_its_line"] == 0


def test_waiting__queue_busy__says_so(published: list[int]) -> None:  # noqa: F811
    set_capacity(1)
    tasks.dispatched.delay("big")
    job = tasks.dispatched.delay("small")
    found = explain(job.id)
    assert found.state == "waiting"
    assert "every worker process of fair is busy" in found.summary


def test_dispatched__in_the_broker__not_started(published: list[int]) -> None:  # noqa: F811
    set_capacity(1)
    job = tasks.dispatched.delay("acme")
    assert published  # its message went to the broker (collected here)
    found = explain(job.id)
    assert found.state == "dispatched"
    assert "In the broker" in found.summary
    assert found.details["queue_in_flight"] == 1 and found.details["queue_capacity"] == 1


def test_running__on_its_process(published: list[int]) -> None:  # noqa: F811
    set_capacity(1)
    job = tasks.dispatched.delay("acme")
    assert dispatch.start(published[0], PROCESS).status == "started"
    found = explain(job.id)
    assert found.state == "running"
    assert found.details["tenant_in_flight"] == 1


def test_scheduled__a_countdown_not_due(published: list[int]) -> None:  # noqa: F811
    job = tasks.dispatched.apply_async(("acme",), countdown=3600)
    found = explain(job.id)
    assert found.state == "scheduled"
    assert found.details["due_at"] is not None


def test_place_in_line__same_queries_wherever_the_job_is(
    published: list[int],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The count of jobs ahead stops at AHEAD_COUNTED: a job deep in a flood costs what the
    # head of the line costs.
    monkeypatch.setattr(explanations, "AHEAD_COUNTED", 5)
    ids = [r.id for r in tasks.dispatched.bulk_enqueue([(("acme",), {})] * 12)]
    assert DispatchJob.objects.count() == 12
    counts = []
    for task_id in (ids[0], ids[11]):
        with CaptureQueriesContext(connection) as queries:
            explain(task_id)
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1]
    assert explain(ids[11]).details["ahead_in_its_line"] == "more than 5"
    assert explain(ids[3]).details["ahead_in_its_line"] == 3
    # Exactly AHEAD_COUNTED ahead is still a count; one more is "more than".
    assert explain(ids[5]).details["ahead_in_its_line"] == 5
    assert explain(ids[6]).details["ahead_in_its_line"] == "more than 5"


def test_waiting__its_line_read_once(published: list[int]) -> None:  # noqa: F811
    job = tasks.dispatched.delay("acme")
    with CaptureQueriesContext(connection) as queries:
        found = explain(job.id)
    assert found.state == "waiting" and found.details["tenant_cap"] is None
    reads = [q["sql"] for q in queries.captured_queries if "fair_jobs_dispatchtenant" in q["sql"]]
    assert len(reads) == 1, reads  # the line and its cap, one read

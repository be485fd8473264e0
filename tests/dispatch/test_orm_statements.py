"""The ORM store's statements per step (SQLite in development and the demo, where each
step is a transaction under the database's one write lock, which every other step waits
for): a start carrying the end before it, and an enqueue into a full queue. Counted
without the transaction's own BEGIN and COMMIT, which SQLite's backend logs and
PostgreSQL's does not."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import db, dispatch
from django_fair_jobs.dispatch.models import DISPATCHED, DispatchJob
from tests.dispatch.conftest import set_capacity
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("collected"),
]

PROCESS = uuid.uuid4()


@pytest.fixture(autouse=True)
def orm_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ORM path, on whichever database the suite runs."""
    monkeypatch.setattr(db, "uses_sql", lambda alias: False)


def _statements(queries: CaptureQueriesContext) -> list[str]:
    return [
        q["sql"] for q in queries.captured_queries if q["sql"].split()[0] not in ("BEGIN", "COMMIT")
    ]


def test_a_start_carrying_an_end__no_savepoint__the_due_read_one_probe() -> None:
    # Two jobs in flight, more waiting: the second job's start carries the first's end,
    # which dispatches the third into its room. No countdown is pending, so the due step
    # is one probe (not the database's clock and a read of the due jobs), the end needs
    # no savepoint inside the start's transaction, the ended line is one update, and the
    # dispatched job's message comes with its line's next head.
    set_capacity(2)
    ids = [DispatchJob.objects.get(task_id=tasks.dispatched.delay("a").id).pk for _ in range(4)]
    dispatched = DispatchJob.objects.filter(state=DISPATCHED).values_list("pk", flat=True)
    assert list(dispatched) == ids[:2]
    assert dispatch.start(ids[0], PROCESS).status == "started"
    with CaptureQueriesContext(connection) as queries:
        started = dispatch.start(ids[1], PROCESS, ended=[ids[0]])
    assert [r.job_id for r in started.ready] == [ids[2]]
    assert started.ready[0].message == DispatchJob.objects.get(pk=ids[2]).message
    statements = _statements(queries)
    assert not [s for s in statements if "SAVEPOINT" in s], statements
    assert len(statements) == 12, "\n".join(statements)


def test_an_enqueue_into_a_full_queue__the_due_read_one_probe() -> None:
    set_capacity(1)
    tasks.dispatched.delay("a")
    tasks.dispatched.delay("a")
    with CaptureQueriesContext(connection) as queries:
        tasks.dispatched.delay("a")
    statements = _statements(queries)
    assert len(statements) == 6, "\n".join(statements)


def test_the_recount_of_lines_whose_counts_agree__one_read_of_the_jobs() -> None:
    # Maintenance recounts every line from the job rows; lines that agree with them are
    # read, not written, and the jobs are counted for all lines in one grouped read, not
    # three reads per line (which on SQLite the database's one write lock would wait for).
    set_capacity(1)
    for tenant in ("a", "b", "c"):
        tasks.dispatched.delay(tenant)
        tasks.dispatched.delay(tenant)
    with CaptureQueriesContext(connection) as queries:
        assert dispatch.recount() == 0
    statements = _statements(queries)
    assert len(statements) == 2, "\n".join(statements)

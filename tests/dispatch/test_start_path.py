"""A dispatched job's path in the worker: its start is the one round trip the process makes
before the job runs. With ``CONN_HEALTH_CHECKS`` (which the library's prerun re-arms before
each job, as Django does before each request), the start stands in for Django's health
check instead of following a ``SELECT 1`` of its own: a broken connection fails the start,
which is sent again at once on a new connection."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import connection

from django_fair_jobs import admission, dispatch
from tests.conftest import cut_kept_connection
from tests.dispatch.conftest import deliver, job_of, set_capacity
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fresh_ledger", "engine", "in_process_worker", "collected"),
]


def test_a_dispatched_job__its_start_stands_in_for_the_health_check(
    health_checks: list[int],
) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    connection.health_check_done = False  # type: ignore[attr-defined]  # the setup used it
    health_checks.clear()
    assert deliver(job) == "ran"
    assert health_checks == []  # no SELECT 1 before the start, nor in the job
    assert connection.health_check_done  # type: ignore[attr-defined]  # the start proved it


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a server connection to cut")
def test_a_connection_cut_while_kept__the_start_sent_again_at_once_on_a_new_one(
    health_checks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    set_capacity(1)
    job = job_of(tasks.dispatched.delay("acme").id)
    pid = cut_kept_connection()
    waited: list[float] = []
    monkeypatch.setattr(time, "sleep", waited.append)
    ran: list[int] = []
    real_start = dispatch.start

    def counted(*args: Any, **kwargs: Any) -> Any:
        ran.append(1)
        return real_start(*args, **kwargs)

    monkeypatch.setattr(dispatch, "start", counted)
    assert deliver(job) == "ran"
    # The first try met the cut connection; the second, at once, a new one.
    assert len(ran) == 2 and max(waited, default=0) < min(admission.REPLY_RETRY_DELAYS)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != pid

"""A job on tenant slots: its acquire is the one round trip the process makes before the
job runs. With ``CONN_HEALTH_CHECKS`` (which the library's prerun re-arms before each job,
as Django does before each request), the acquire stands in for Django's health check
instead of following a ``SELECT 1`` of its own: a broken connection fails the acquire,
which is sent again at once on a new connection."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from django.db import connection

from django_fair_jobs import admission
from django_fair_jobs.models import SlotLease
from tests.conftest import cut_kept_connection, run_as_worker
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of the admission's acquire."""
    real = admission.acquire
    calls: list[int] = []

    def counted(**kwargs: Any) -> Any:
        calls.append(1)
        return real(**kwargs)

    monkeypatch.setattr(admission, "acquire", counted)
    return calls


def test_a_job_on_tenant_slots__its_acquire_stands_in_for_the_health_check(
    in_process_worker: uuid.UUID, health_checks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counted(monkeypatch)
    connection.health_check_done = False  # type: ignore[attr-defined]  # re-armed per job
    health_checks.clear()
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers={}) == "acme:done"
    assert len(calls) == 1
    assert health_checks == []  # no SELECT 1 before the acquire, nor in the job
    assert connection.health_check_done  # type: ignore[attr-defined]  # the acquire proved it
    assert not SlotLease.objects.exists()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a server connection to cut")
def test_a_connection_cut_while_kept__the_acquire_sent_again_at_once_on_a_new_one(
    in_process_worker: uuid.UUID, health_checks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    pid = cut_kept_connection()
    waited: list[float] = []
    monkeypatch.setattr(time, "sleep", waited.append)
    calls = _counted(monkeypatch)
    assert run_as_worker(tasks.limited1, ("acme", 0), task_id="j", headers={}) == "acme:done"
    # The first try met the cut connection; the second, at once, a new one.
    assert len(calls) == 2 and max(waited, default=0) < min(admission.REPLY_RETRY_DELAYS)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != pid
    assert not SlotLease.objects.exists()

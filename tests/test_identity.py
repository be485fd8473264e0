"""A process's identity: made on first use by a process that no worker start prepared."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.db import connections

from django_fair_jobs import identity
from django_fair_jobs.models import WorkerProcess

pytestmark = pytest.mark.django_db(transaction=True)


def test_first_use__outside_a_worker__registers_without_a_node_made_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process where Celery's worker_init never ran (a job run by an embedding program,
    # a script) has no node id yet: the registration makes one while it holds the lock.
    monkeypatch.setattr(identity, "_node_id", None)
    monkeypatch.setattr(identity, "_identity", None)
    monkeypatch.setattr(identity, "_on_register", [])  # no heartbeat thread left behind
    got: list[uuid.UUID] = []

    def first_use() -> None:
        try:
            got.append(identity.current_process_id("embedded@host"))
        finally:
            connections.close_all()

    # On a thread, so that a lock taken twice fails this test instead of hanging the suite.
    thread = threading.Thread(target=first_use, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the first use never returned (the lock is taken twice)"
    assert WorkerProcess.objects.filter(id=got[0], node="embedded@host").exists()
    identity.retire_process(got[0])


def test_a_process_reaped_during_a_stall__registers_again_before_its_next_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process stopped longer than FAIR_JOBS_WORKER_TIMEOUT (SIGSTOP, a paused VM) is
    # reaped by the others. Once it went on, it started its next job under its reaped id
    # before its heartbeat thread noticed; the next reap took that job for a dead
    # process's and put it back in its line, and it ran twice (the chaos suite's SIGSTOP
    # test). Its id is now registered again before it is used.
    from django.test.utils import CaptureQueriesContext

    from django_fair_jobs.conf import fair_settings

    monkeypatch.setattr(identity, "_identity", None)
    monkeypatch.setattr(identity, "_on_register", [])  # no heartbeat thread: beats by hand
    process = identity.current_process_id("stalled@host")
    # In steady state (a beat within the last interval) the id costs no statement.
    with CaptureQueriesContext(connections["default"]) as fresh:
        assert identity.current_process_id() == process
    assert len(fresh.captured_queries) == 0
    # Stopped past the timeout (the clock goes on meanwhile), and reaped.
    real, stalls = time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real() + stalls[0])
    stalls[0] += fair_settings.WORKER_TIMEOUT
    WorkerProcess.objects.filter(id=process).delete()
    assert identity.current_process_id() == process
    assert WorkerProcess.objects.filter(id=process, node="stalled@host").exists()
    # Stopped past the timeout again, not reaped: one beat, and nothing more.
    stalls[0] += fair_settings.WORKER_TIMEOUT
    with CaptureQueriesContext(connections["default"]) as stalled:
        assert identity.current_process_id() == process
    assert len(stalled.captured_queries) == 1
    identity.retire_process(process)

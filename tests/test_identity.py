"""A process's identity: made on first use by a process that no worker start prepared."""

from __future__ import annotations

import threading
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

"""Defects of the slot, queue-limit and planner protocol found in review, each reproduced
on the real database (and the real broker where it takes part), in-process: the job runs
through ``FairTask.__call__`` as a worker runs a delivered message."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery.exceptions import Retry
from celery.signals import before_task_publish

from django_fair_jobs.models import SlotLease, TenantQueueSlot
from tests.conftest import run_as_worker
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def test_self_retry__slot_given_back_before_the_retry_is_published(
    in_process_worker: uuid.UUID, broker_env: dict[str, str]
) -> None:
    # A retry with no countdown (autoretry_for with backoff and jitter can give ~0 s) can
    # start on another process at once: if the lease were still held, that copy would be
    # a 'duplicate' and wait a whole FAIR_JOBS_WORKER_TIMEOUT.
    held_at_publish: list[bool] = []

    def watch(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("id") == "retrying":
            held_at_publish.append(SlotLease.objects.filter(task_id="retrying").exists())

    before_task_publish.connect(watch, weak=False)
    try:
        with pytest.raises(Retry):
            run_as_worker(tasks.retries_now, ("acme",), task_id="retrying", headers={})
    finally:
        before_task_publish.disconnect(watch)
    assert held_at_publish == [False]
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 0
    assert not SlotLease.objects.exists()

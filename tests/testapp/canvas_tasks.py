"""Test tasks for canvas (group, chord, chain, link_error) and ``autoretry_for``, each in
two forms: fair dispatch (``dispatch_*``) and tenant slots that park (``slot_*``).

Every task takes its tenant as the ``tenant`` keyword, so that a chain can pass the
previous result as the first argument. Each run records a ``JobRun`` whose ``queue`` field
holds the step's label (the jobs all run on the ``fair`` queue), so that a test reads
which steps ran, how often and in which order.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import shared_task
from django.conf import settings
from django.db.models.functions import Now

from django_fair_jobs import FairTask
from tests.testapp.models import JobRun


class TenantFromKeyword(FairTask):
    """The tenant is the ``tenant`` keyword argument."""

    @classmethod
    def fair_tenant(cls, *args: Any, **kwargs: Any) -> Any:
        return kwargs.get("tenant")


class Flaky(Exception):
    """What ``*_flaky`` raises on its first attempts: the error ``autoretry_for`` names."""


FLAKY_FAILURES = 2
"""Attempts of a ``*_flaky`` job that fail before one succeeds."""


GATE_SECONDS = 60.0
"""Longest a gated step waits for its gate to open (a test that fails never opens it)."""


def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.CELERY_RESULT_BACKEND)


def open_gate(gate: str) -> None:
    """Let the steps waiting on ``gate`` end."""
    _redis().set(gate, 1, ex=600)


def _record(task: Any, tenant: str, label: str, duration: float, gate: str | None = None) -> None:
    run = JobRun.objects.create(
        task_id=task.request.id,
        tenant=tenant,
        queue=label,
        pid=os.getpid(),
        retries=task.request.retries,
        started_at=Now(),
    )
    time.sleep(duration)
    # A gated step holds its tenant's slot until the test opens the gate: the test decides
    # when the tenant stops being at its limit, whatever the machine's speed.
    deadline = time.monotonic() + GATE_SECONDS
    while gate is not None and not _redis().exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    JobRun.objects.filter(pk=run.pk).update(finished_at=Now())


def _work(
    task: Any, previous: Any, tenant: str, label: str, duration: float, gate: str | None
) -> dict[str, Any]:
    """Record the run; return the path of labels so far (a chain passes it on) and the
    lineage the message carried (what canvas relies on)."""
    _record(task, tenant, label, duration, gate)
    path = previous["path"] if isinstance(previous, dict) else []
    request = task.request
    return {
        "path": [*path, label],
        "group": request.group,
        "root": request.root_id,
        "parent": request.parent_id,
    }


def _collect(task: Any, results: list[dict[str, Any]], tenant: str) -> list[dict[str, Any]]:
    _record(task, tenant, "callback", 0.0)
    return results


def _errback(task: Any, failed_id: str, tenant: str) -> str:
    # The failed job's id is the record's task id: a test counts the errback's runs per job.
    JobRun.objects.create(
        task_id=failed_id,
        tenant=tenant,
        queue="errback",
        pid=os.getpid(),
        started_at=Now(),
        finished_at=Now(),
    )
    return failed_id


def _flaky(task: Any, key: str, tenant: str) -> int:
    # The attempts are counted in Redis, across worker processes and retries.
    attempt = int(_redis().incr(key))
    _record(task, tenant, f"attempt {attempt}", 0.0)
    if attempt <= FLAKY_FAILURES:
        raise Flaky(f"attempt {attempt} fails")
    return attempt


# Fair dispatch: every job waits in its tenant's line and is dispatched when the queue has
# room and the tenant is below its cap (1 here, so one tenant's canvas runs one at a time).

_DISPATCH: dict[str, Any] = {
    "base": TenantFromKeyword,
    "queue": "fair",
    "fair_dispatch": True,
    "fair_max_jobs": 1,
}


@shared_task(bind=True, **_DISPATCH)
def dispatch_work(
    self: Any,
    previous: Any = None,
    *,
    tenant: str,
    label: str,
    duration: float = 0.0,
    gate: str | None = None,
) -> dict[str, Any]:
    """A step of a canvas under fair dispatch."""
    return _work(self, previous, tenant, label, duration, gate)


@shared_task(bind=True, **_DISPATCH)
def dispatch_fail(self: Any, *, tenant: str) -> None:
    """Always fails: its ``link_error`` must run once."""
    _record(self, tenant, "fail", 0.0)
    raise RuntimeError("boom")


@shared_task(bind=True, **_DISPATCH)
def dispatch_collect(
    self: Any, results: list[dict[str, Any]], *, tenant: str
) -> list[dict[str, Any]]:
    """A chord's callback under fair dispatch: returns the header's results."""
    return _collect(self, results, tenant)


@shared_task(bind=True, **_DISPATCH)
def dispatch_errback(self: Any, failed_id: str, *, tenant: str) -> str:
    """A ``link_error`` under fair dispatch (bound, so Celery publishes it as a job)."""
    return _errback(self, failed_id, tenant)


@shared_task(
    bind=True,
    **_DISPATCH,
    autoretry_for=(Flaky,),
    retry_backoff=True,
    retry_jitter=True,
    max_retries=3,
)
def dispatch_flaky(self: Any, key: str, *, tenant: str) -> int:
    """Fails :data:`FLAKY_FAILURES` times, then succeeds; retried by ``autoretry_for``."""
    return _flaky(self, key, tenant)


# Tenant slots: a job whose tenant is at its limit (1) is parked and woken at a release.

_SLOTS: dict[str, Any] = {
    "base": TenantFromKeyword,
    "queue": "fair",
    "fair_max_jobs": 1,
    "fair_on_limit": "park",
}


@shared_task(bind=True, **_SLOTS)
def slot_work(
    self: Any,
    previous: Any = None,
    *,
    tenant: str,
    label: str,
    duration: float = 0.0,
    gate: str | None = None,
) -> dict[str, Any]:
    """A step of a canvas under tenant slots."""
    return _work(self, previous, tenant, label, duration, gate)


@shared_task(bind=True, **_SLOTS)
def slot_fail(self: Any, *, tenant: str) -> None:
    """Always fails: its ``link_error`` must run once."""
    _record(self, tenant, "fail", 0.0)
    raise RuntimeError("boom")


@shared_task(bind=True, **_SLOTS)
def slot_collect(self: Any, results: list[dict[str, Any]], *, tenant: str) -> list[dict[str, Any]]:
    """A chord's callback under tenant slots: returns the header's results."""
    return _collect(self, results, tenant)


@shared_task(bind=True, **_SLOTS)
def slot_errback(self: Any, failed_id: str, *, tenant: str) -> str:
    """A ``link_error`` under tenant slots (bound, so Celery publishes it as a job)."""
    return _errback(self, failed_id, tenant)


@shared_task(
    bind=True,
    **_SLOTS,
    autoretry_for=(Flaky,),
    retry_backoff=True,
    retry_jitter=True,
    max_retries=3,
)
def slot_flaky(self: Any, key: str, *, tenant: str) -> int:
    """Fails :data:`FLAKY_FAILURES` times, then succeeds; retried by ``autoretry_for``."""
    return _flaky(self, key, tenant)

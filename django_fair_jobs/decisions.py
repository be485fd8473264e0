"""Shadow mode and the record of what rules decide about jobs.

With ``FAIR_JOBS_ENFORCE = False`` every mechanism still evaluates its rules, but instead
of deferring, parking, rerouting or holding a job it records what it would have done as a
:class:`~django_fair_jobs.models.JobDecision` and lets the job go on as plain Celery
would. Reroutes are recorded in both modes, because a rerouted job leaves no other trace
that explain could find. Rows older than ``FAIR_JOBS_DECISION_RETENTION`` are pruned by
the maintenance pass.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import DatabaseError

from django_fair_jobs import db
from django_fair_jobs.conf import fair_settings

logger = logging.getLogger("django_fair_jobs.decisions")

_DECISION_PRUNE_BATCH = 10_000
"""Rows deleted per prune statement, so one pass never holds a long lock."""


def enforcing() -> bool:
    """True unless shadow mode is on (``FAIR_JOBS_ENFORCE = False``)."""
    return bool(fair_settings.ENFORCE)


def record(
    *,
    task_id: str,
    task_name: str,
    tenant: str | None,
    queue: str,
    mechanism: str,
    action: str,
    detail: dict[str, Any] | None = None,
) -> None:
    """Store one decision (``enforced`` is the current mode). Never raises: a decision
    that cannot be stored is logged, and the job goes on, so that recording can never
    lose a job or fail a publish."""
    from django_fair_jobs.models import JobDecision

    try:
        JobDecision.objects.create(
            task_id=task_id, task_name=task_name, tenant=tenant or "", queue=queue,
            mechanism=mechanism, action=action, enforced=enforcing(), detail=detail or {},
        )  # fmt: skip
    except DatabaseError:
        logger.warning("Could not record %s %s of %s", mechanism, action, task_id, exc_info=True)


def prune() -> int:
    """Delete decisions older than ``FAIR_JOBS_DECISION_RETENTION``; returns how many."""
    from datetime import timedelta

    from django_fair_jobs.models import JobDecision

    cutoff = db.database_now() - timedelta(seconds=fair_settings.DECISION_RETENTION)
    deleted = 0
    while True:
        ids = list(
            JobDecision.objects.filter(at__lt=cutoff).values_list("pk", flat=True)[
                :_DECISION_PRUNE_BATCH
            ]
        )
        if not ids:
            return deleted
        deleted += JobDecision.objects.filter(pk__in=ids).delete()[0]

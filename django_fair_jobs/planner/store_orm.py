"""The planner's storage on databases other than PostgreSQL (SQLite for development): the
steps :mod:`django_fair_jobs.planner.store` runs as named statements on PostgreSQL, each a
function of the same name and signature, through the ORM. Each is one conditional UPDATE, so
two callers cannot both win."""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


def claim_run(task_name: str, *, interval: float, lock_ttl: float) -> uuid.UUID | None:
    """See :func:`django_fair_jobs.planner.store.claim_run`."""
    from django_fair_jobs.models import PlannerRun

    token = uuid.uuid4()
    PlannerRun.objects.get_or_create(task_name=task_name)
    claimed = (
        PlannerRun.objects.filter(task_name=task_name, next_run_at__lte=Now())
        .filter(Q(locked_until__isnull=True) | Q(locked_until__lt=Now()))
        .update(
            locked_until=Now() + models.Value(timedelta(seconds=lock_ttl)),
            lock_token=token,
            next_run_at=Now() + models.Value(timedelta(seconds=interval)),
            last_run_at=Now(),
        )
    )
    return token if claimed else None

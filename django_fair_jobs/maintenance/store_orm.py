"""The maintenance rows' storage on databases other than PostgreSQL (SQLite for
development): the step :mod:`django_fair_jobs.maintenance.store` runs as a named statement
on PostgreSQL, a function of the same name and signature, through the ORM."""

from __future__ import annotations

from django.db import router, transaction
from django.db.models.functions import Now

from django_fair_jobs import db


def claim_maintenance(name: str, *, interval: float) -> bool:
    """See :func:`django_fair_jobs.maintenance.store.claim_maintenance`."""
    from django_fair_jobs.models import Maintenance

    alias = router.db_for_write(Maintenance)
    with transaction.atomic(using=alias):
        if Maintenance.objects.filter(name=name, last_run_at__lt=db.ago(interval)).update(
            last_run_at=Now()
        ):
            return True
        if Maintenance.objects.filter(name=name).exists():
            return False
        Maintenance.objects.create(name=name)
    return True
    return True

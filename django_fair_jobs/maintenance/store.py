"""The maintenance rows' storage: the cluster-wide pacing of maintenance passes (one
named statement of ``store.sql`` beside this module on PostgreSQL; on other databases the
function of the same name in :mod:`django_fair_jobs.maintenance.store_orm`) and the count of
reaped leases the metrics read."""

from __future__ import annotations

from django.db import IntegrityError, router, transaction
from django.db.models import F

from django_fair_jobs import db
from django_fair_jobs.maintenance import store_orm


def claim_maintenance(name: str, *, interval: float) -> bool:
    """True if this caller may run ``name`` now: nobody ran it for ``interval`` seconds.

    One conditional upsert on PostgreSQL; two callers at once cannot both win.
    """
    from django_fair_jobs.models import Maintenance

    alias = router.db_for_write(Maintenance)
    if not db.uses_sql(alias):
        return store_orm.claim_maintenance(name, interval=interval)
    return bool(db.run(alias, "claim_maintenance", {"name": name, "interval": interval}))


def count_reaped(leases: int) -> None:
    """Add ``leases`` reaped leases to the cluster-wide total (for the metrics)."""
    from django_fair_jobs.models import Maintenance

    if not Maintenance.objects.filter(name="reaped").update(
        leases_reaped_total=F("leases_reaped_total") + leases
    ):
        try:
            with transaction.atomic(using=router.db_for_write(Maintenance)):
                Maintenance.objects.create(name="reaped", leases_reaped_total=leases)
        except IntegrityError:
            Maintenance.objects.filter(name="reaped").update(
                leases_reaped_total=F("leases_reaped_total") + leases
            )

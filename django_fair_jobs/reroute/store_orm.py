"""Rerouting's storage on databases other than PostgreSQL (SQLite for development): the
steps :mod:`django_fair_jobs.reroute.store` runs as named statements on PostgreSQL, each a
function of the same name and signature, through the ORM inside ``transaction.atomic()``;
and the reads both stores share (the database second, a window's counts), which
:mod:`django_fair_jobs.reroute.store` gives under the same names."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from django.db import connections, router, transaction
from django.db.models import F
from django.db.models.functions import Greatest, Now

from django_fair_jobs import db
from django_fair_jobs.reroute.types import Deciding, Recorded

if TYPE_CHECKING:
    from django_fair_jobs.models import TenantWindow


def record(
    *,
    key: str,
    tenant: str,
    task_name: str,
    rules: Sequence[tuple[int, int, str]],
    at: datetime | None = None,
    deciding: Deciding | None = None,
) -> Recorded:
    """See :func:`django_fair_jobs.reroute.store.record`."""
    from django_fair_jobs.models import TenantWindow

    with transaction.atomic(using=router.db_for_write(TenantWindow)):
        recorded = _record(key, tenant, task_name, rules, at)
        if deciding is not None and recorded.rule is not None:
            _decide(deciding, tenant, task_name, rules[recorded.rule], recorded)
        return recorded


def _decide(
    deciding: Deciding,
    tenant: str,
    task_name: str,
    rule: tuple[int, int, str],
    recorded: Recorded,
) -> None:
    """Store the reroute's decision row, as ``record_enqueue`` does on PostgreSQL."""
    from django_fair_jobs.models import JobDecision

    index = recorded.rule or 0
    per, threshold, queue = rule
    JobDecision.objects.create(
        task_id=deciding.task_id, task_name=task_name, tenant=tenant, queue=deciding.queue,
        mechanism="reroute", action="rerouted" if deciding.enforced else "reroute",
        enforced=deciding.enforced,
        detail={"rule": index + 1, "to_queue": queue, "per": per, "threshold": threshold,
                "count": recorded.counts[index]},
    )  # fmt: skip


def _record(
    key: str,
    tenant: str,
    task_name: str,
    rules: Sequence[tuple[int, int, str]],
    at: datetime | None,
) -> Recorded:
    from django_fair_jobs.models import RerouteCount, TenantWindow, WindowBucket

    second = int(at.timestamp()) if at is not None else database_second()
    window, _ = TenantWindow.objects.get_or_create(
        key=key, tenant=tenant, defaults={"last_second": second}
    )
    TenantWindow.objects.filter(pk=window.pk).update(
        total=F("total") + 1, last_second=Greatest(F("last_second"), second)
    )
    window.refresh_from_db(fields=["total", "last_second"])
    second, total = window.last_second, window.total
    if not WindowBucket.objects.filter(window=window, second=second).update(
        cum=Greatest(F("cum"), total)
    ):
        WindowBucket.objects.create(window=window, second=second, cum=total)
    counts = tuple(total - _cum_before(window.pk, second - per) for per, _, _ in rules)
    matches = [
        i
        for i, (n, (_, threshold, _)) in enumerate(zip(counts, rules, strict=True))
        if n > threshold
    ]
    picked = matches[-1] if matches else None
    if picked is not None:
        reroutes, _ = RerouteCount.objects.get_or_create(
            tenant=tenant, task_name=task_name, queue=rules[picked][2]
        )
        RerouteCount.objects.filter(pk=reroutes.pk).update(total=F("total") + 1, last_at=Now())
    return Recorded(counts, picked)


def _cum_before(window_id: int, second: int) -> int:
    from django_fair_jobs.models import WindowBucket

    cum = (
        WindowBucket.objects.filter(window_id=window_id, second__lt=second)
        .order_by("-second")
        .values_list("cum", flat=True)
        .first()
    )
    return cum or 0


def database_second() -> int:
    """The database clock as a Unix second (SQLite: the host's clock, the same one)."""
    from django_fair_jobs.models import TenantWindow

    alias = router.db_for_write(TenantWindow)
    with connections[alias].cursor() as cursor:
        if db.is_postgres(alias):
            cursor.execute("SELECT floor(extract(epoch FROM now()))::bigint")
        else:
            cursor.execute("SELECT CAST(strftime('%s', 'now') AS INTEGER)")
        return int(cursor.fetchone()[0])


def current_counts(window: TenantWindow, pers: Sequence[int], now: int | None = None) -> list[int]:
    """How many enqueues each window of ``pers`` seconds holds at Unix second ``now``
    (default: the database clock's), for the admin."""
    now = database_second() if now is None else now
    return [window.total - _cum_before(window.pk, now - per) for per in pers]


def prune(*, max_window: int) -> int:
    """See :func:`django_fair_jobs.reroute.store.prune`."""
    from django_fair_jobs.models import RerouteCount, TenantWindow, WindowBucket

    alias = router.db_for_write(TenantWindow)
    with transaction.atomic(using=alias):
        cutoff = database_second() - max_window
        idle = list(
            TenantWindow.objects.filter(last_second__lt=cutoff).values_list("pk", flat=True)
        )
        WindowBucket.objects.filter(window_id__in=idle).delete()
        TenantWindow.objects.filter(pk__in=idle).delete()
        RerouteCount.objects.filter(last_at__lt=db.ago(max_window)).delete()
        for window_id in TenantWindow.objects.values_list("pk", flat=True):
            anchor = (
                WindowBucket.objects.filter(window_id=window_id, second__lt=cutoff)
                .order_by("-second")
                .values_list("second", flat=True)
                .first()
            )
            if anchor is not None:
                WindowBucket.objects.filter(window_id=window_id, second__lt=anchor).delete()
    return len(idle)

"""Rerouting's storage: enqueue counts per (counting key, tenant) in per-second buckets, and
reroute counts. On PostgreSQL one statement counts an enqueue, committed at once even
inside the caller's transaction (on a side connection); other databases use the ORM."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F
from django.db.models.functions import Greatest, Now

from django_fair_jobs import db
from django_fair_jobs.sql import queries

if TYPE_CHECKING:
    from django_fair_jobs.models import TenantWindow


@dataclass(frozen=True)
class Recorded:
    """The answer of recording an enqueue: the count within each rule's window (in rule
    order, the enqueue itself included) and the 0-based index of the rule that picks the
    queue (the last one whose count is above its threshold), or None."""

    counts: tuple[int, ...]
    rule: int | None


_side_connections = threading.local()


def _autocommit_connection(alias: str) -> BaseDatabaseWrapper:
    """The connection to count enqueues on: the thread's own, unless it is inside a
    transaction on PostgreSQL; then a second connection of this thread, in autocommit.

    Celery publishes at once, not at commit, so the count must commit at once too. Run in
    the caller's transaction, it would also hold the tenant's hot window row locked until
    that transaction ends (a whole request under ``ATOMIC_REQUESTS``), serializing every
    publisher of that tenant. SQLite has one writer anyway and keeps the caller's.
    """
    connection = connections[alias]
    if not connection.in_atomic_block or connection.vendor != "postgresql":
        return connection
    side: BaseDatabaseWrapper | None = getattr(_side_connections, alias, None)
    if side is None:
        side = connections.create_connection(alias)
        setattr(_side_connections, alias, side)
    return side


def _count_enqueue(connection: BaseDatabaseWrapper, params: dict[str, Any]) -> Any:
    """Run the count of one enqueue on ``connection``; returns (counts, picked rule)."""
    with connection.cursor() as cursor:
        cursor.execute(queries()["record_enqueue"], params)
        return cursor.fetchone()


def _forget_side_connection(alias: str) -> None:
    side: BaseDatabaseWrapper | None = getattr(_side_connections, alias, None)
    if side is not None:
        delattr(_side_connections, alias)
        with contextlib.suppress(DatabaseError):  # a dead connection may refuse to close
            side.close()


def reset(pks: Sequence[int]) -> int:
    """Forget the enqueue counts of windows ``pks`` (their buckets go with them): the
    next enqueue starts a new count. Returns how many windows were reset."""
    from django_fair_jobs.models import TenantWindow

    deleted = TenantWindow.objects.filter(pk__in=list(pks)).delete()[1]
    return int(deleted.get(TenantWindow._meta.label, 0))


def record(
    *,
    key: str,
    tenant: str,
    task_name: str,
    rules: Sequence[tuple[int, int, str]],
    at: datetime | None = None,
) -> Recorded:
    """Count one enqueue and pick the rule that reroutes it.

    ``rules`` are ``(per, threshold, queue)`` in declaration order. A rule matches when
    the count within its last ``per`` seconds (whole seconds of the database clock,
    both ends included, this enqueue included) is above ``threshold``; the last match
    wins and its reroute is counted. ``at`` replaces the database clock (tests, replays).
    One statement on PostgreSQL, committed at once even inside a transaction.
    """
    from django_fair_jobs.models import TenantWindow

    alias = router.db_for_write(TenantWindow)
    if db.uses_sql(alias):
        params = {
            "key": key,
            "tenant": tenant,
            "task_name": task_name,
            "at": at,
            "pers": [per for per, _, _ in rules],
            "thresholds": [threshold for _, threshold, _ in rules],
            "queues": [queue for _, _, queue in rules],
        }
        connection = _autocommit_connection(alias)
        try:
            counts, picked = _count_enqueue(connection, params)
        except DatabaseError as exc:
            if connection is connections[alias]:
                raise
            _forget_side_connection(alias)
            # The side connection lives outside Django's request cycle, so nothing
            # checks it between uses: after a database or pooler restart, or an idle
            # timeout, it is dead at its next use. One more try on a new one (if the
            # count committed before its reply was lost, the enqueue counts twice: a
            # window one higher, no job lost); any other error is raised as it is.
            if not isinstance(exc, OperationalError | InterfaceError):
                raise
            counts, picked = _count_enqueue(_autocommit_connection(alias), params)
        return Recorded(tuple(counts), None if picked is None else picked - 1)
    with transaction.atomic(using=alias):
        return _record_portable(key, tenant, task_name, rules, at)


def _record_portable(
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
    """Delete the windows (with their buckets) and reroute counts of tenants idle for
    longer than ``max_window`` seconds, and the other windows' buckets that no window
    reads any more; returns how many windows went."""
    from django_fair_jobs.models import RerouteCount, TenantWindow, WindowBucket

    alias = router.db_for_write(TenantWindow)
    if db.uses_sql(alias):
        return int(db.run(alias, "prune_windows", {"max_window": max_window})[0][0])
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

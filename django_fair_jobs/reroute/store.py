"""Rerouting's storage: enqueue counts per (counting key, tenant) in per-second buckets, and
reroute counts. On PostgreSQL one statement counts an enqueue, committed at once even
inside the caller's transaction (on a side connection). On other databases each step is the
function of the same name and signature in :mod:`django_fair_jobs.reroute.store_orm`, which
also holds the reads both share (``database_second``, ``current_counts``, given here too)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    connections,
    router,
)
from django.db.backends.base.base import BaseDatabaseWrapper

from django_fair_jobs import db
from django_fair_jobs.reroute import store_orm
from django_fair_jobs.reroute.store_orm import current_counts as current_counts
from django_fair_jobs.reroute.store_orm import database_second as database_second
from django_fair_jobs.reroute.types import Deciding
from django_fair_jobs.reroute.types import Recorded as Recorded

if TYPE_CHECKING:
    pass


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
    return db.run_on(connection, "record_enqueue", params)[0]


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
    deciding: Deciding | None = None,
) -> Recorded:
    """Count one enqueue and pick the rule that reroutes it; with ``deciding``, a picked
    rule's decision row is stored too, in the same statement.

    ``rules`` are ``(per, threshold, queue)`` in declaration order. A rule matches when
    the count within its last ``per`` seconds (whole seconds of the database clock,
    both ends included, this enqueue included) is above ``threshold``; the last match
    wins and its reroute is counted. ``at`` replaces the database clock (tests, replays).
    One statement on PostgreSQL, committed at once even inside a transaction.
    """
    from django_fair_jobs.models import TenantWindow

    alias = router.db_for_write(TenantWindow)
    if not db.uses_sql(alias):
        return store_orm.record(
            key=key, tenant=tenant, task_name=task_name, rules=rules, at=at, deciding=deciding
        )
    params = {
        "key": key,
        "tenant": tenant,
        "task_name": task_name,
        "at": at,
        "pers": [per for per, _, _ in rules],
        "thresholds": [threshold for _, threshold, _ in rules],
        "queues": [queue for _, _, queue in rules],
        "task_id": deciding and deciding.task_id,
        "declared": deciding and deciding.queue,
        "enforced": bool(deciding and deciding.enforced),
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


def prune(*, max_window: int) -> int:
    """Delete the windows (with their buckets) and reroute counts of tenants idle for
    longer than ``max_window`` seconds, and the other windows' buckets that no window
    reads any more; returns how many windows went."""
    from django_fair_jobs.models import TenantWindow

    alias = router.db_for_write(TenantWindow)
    if not db.uses_sql(alias):
        return store_orm.prune(max_window=max_window)
    return int(db.run(alias, "prune_windows", {"max_window": max_window})[0][0])

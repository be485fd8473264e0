"""Enqueue-to-start waits: the counts behind the ``fair_jobs_wait_seconds`` histogram.

Every job of a ``FairTask`` carries the time it was enqueued (the ``fair_enqueued_at``
header, set once by the first publish and kept by re-publishes). When the job starts
(:func:`observe`, called by the admission pipeline), its wait goes into this process's
counts, per queue and **tenant class**: a bounded label that
``FAIR_JOBS_METRICS_TENANT_CLASS`` computes from the tenant (a tier, a plan), never the
tenant itself, so that the histogram's series stay few whatever the number of tenants.

The counts stay in memory until :func:`flush` adds them to the
:class:`~django_fair_jobs.models.WaitBucket` rows in one statement; each worker process's
maintenance thread flushes once per heartbeat interval and at shutdown. Recording a start
is a dictionary update: no database call on the job's path. A process killed before its
flush loses at most one interval's counts, which a histogram can afford.

The wait is measured from the later of the enqueue and the job's ETA (a countdown is not
a wait), on the clocks of the publishing and the starting machines: keep them in sync
(NTP). A retry's run is not counted again.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django_fair_jobs.conf import fair_settings
from django_fair_jobs.validation import weights_callable
from django_fair_jobs.waits import store

logger = logging.getLogger("django_fair_jobs.waits")

BUCKETS: tuple[float, ...] = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    math.inf,
)  # fmt: skip
"""The histogram's upper bounds in seconds (``le``), the last one ``+Inf``."""

ALL = "all"
"""The tenant class of every job when ``FAIR_JOBS_METRICS_TENANT_CLASS`` is not set."""

OTHER = "other"
"""The class of a job whose class could not be computed, or that would be a class beyond
:data:`MAX_CLASSES`."""

MAX_CLASSES = 20
"""Distinct tenant classes one process labels; later ones count as :data:`OTHER`."""

CLASS_MAX_LENGTH = 100
"""Longest tenant class label; a longer one is cut."""

Key = tuple[str, str, int]
"""(queue, tenant class, bucket index)."""

_lock = threading.Lock()
_pending: dict[Key, list[float]] = {}
_classes: set[str] = set()
_classifier: tuple[Any, Callable[[str | None], Any]] | None = None


def tenant_class(tenant: str | None) -> str:
    """The tenant class label of ``tenant``: ``FAIR_JOBS_METRICS_TENANT_CLASS(tenant)``,
    or :data:`ALL` when it is not set. A classifier that raises gives :data:`OTHER` (and a
    warning); so does a class past :data:`MAX_CLASSES` in this process."""
    global _classifier
    spec = fair_settings.METRICS_TENANT_CLASS
    if spec is None:
        return ALL
    try:
        cached = _classifier
        # != rather than "is not": a dotted path read from the environment is a new string
        # at every read, and would import the callable again at every start.
        if cached is None or cached[0] != spec:
            # The same "callable or dotted path" as tenant_weights, checked the same way.
            target: Callable[[str | None], Any] = weights_callable(spec)  # type: ignore[assignment]
            cached = _classifier = (spec, target)
        name = str(cached[1](tenant))[:CLASS_MAX_LENGTH]
    except Exception:
        logger.warning("FAIR_JOBS_METRICS_TENANT_CLASS failed for a tenant", exc_info=True)
        return OTHER
    with _lock:
        if name not in _classes:
            if len(_classes) >= MAX_CLASSES:
                return OTHER
            _classes.add(name)
    return name


def wait_of(enqueued_at: Any, eta: Any, now: float) -> float | None:
    """Seconds from the later of ``enqueued_at`` (epoch seconds) and ``eta`` (an ISO time
    or datetime, or None) to ``now``; None when the enqueue time is missing or invalid."""
    if isinstance(enqueued_at, bool) or not isinstance(enqueued_at, int | float):
        return None
    since = float(enqueued_at)
    if eta:
        try:
            when = eta if isinstance(eta, datetime) else datetime.fromisoformat(str(eta))
            since = max(since, when.timestamp())
        except (TypeError, ValueError):
            pass  # an unreadable ETA: measured from the enqueue
    if not math.isfinite(since):
        return None
    return max(0.0, now - since)


def observe(queue: str, tenant: str | None, enqueued_at: Any, eta: Any = None) -> None:
    """Count one job's start: its wait (see :func:`wait_of`) in its queue's and tenant
    class's bucket, in memory until the next :func:`flush`."""
    wait = wait_of(enqueued_at, eta, time.time())
    if wait is None:
        return
    key = (queue, tenant_class(tenant), bisect.bisect_left(BUCKETS, wait))
    with _lock:
        entry = _pending.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += wait


def flush() -> int:
    """Add this process's counts to the wait rows (one statement) and forget them; returns
    the jobs counted. On a database error the counts are kept for the next flush."""
    global _pending
    with _lock:
        taken, _pending = _pending, {}
    if not taken:
        return 0
    try:
        store.add({key: (int(c), s) for key, (c, s) in taken.items()})
    except Exception:
        with _lock:
            for key, (count, total) in taken.items():
                entry = _pending.setdefault(key, [0, 0.0])
                entry[0] += count
                entry[1] += total
        raise
    return sum(int(c) for c, _ in taken.values())


def pending() -> int:
    """Starts counted in this process and not yet flushed."""
    with _lock:
        return sum(int(c) for c, _ in _pending.values())


def histogram() -> dict[tuple[str, str], tuple[list[int], float]]:
    """The stored histogram: per (queue, tenant class), the count of each bucket of
    :data:`BUCKETS` (not cumulative) and the waits' sum."""
    out: dict[tuple[str, str], tuple[list[int], float]] = {}
    for queue, cls, bucket, count, total in store.rows():
        counts, old = out.get((queue, cls), ([0] * len(BUCKETS), 0.0))
        if 0 <= bucket < len(BUCKETS):
            counts[bucket] += count
        out[(queue, cls)] = (counts, old + total)
    return out

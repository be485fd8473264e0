"""What limits a tenant on a queue now: the one answer that explain, status, the admin
and the metrics all read, so that no two views show two caps.

The tenant's cap is what the fence enforces at a job's start: its tenant slot's
``max_jobs`` override (0: paused; a boost is an override that ends), else the task's own
``fair_max_jobs`` (for fair dispatch, that of the task of the job at the head of the
tenant's line; for tenant slots, the last task default the slot saw). A queue's
``max_jobs`` (0: paused) bounds every tenant on it. A tenant that has a line on the queue
is under fair dispatch's cap, even when a tenant slot row exists for it without an
override (its task default then belongs to tenant slots' jobs, not to the line's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

SOURCES = ("paused", "boost", "override", "task", "none")
"""Where a cap comes from: the tenant slot paused (override 0), boosted, or overridden;
the task's ``fair_max_jobs``; or nothing (no cap)."""


@dataclass(frozen=True)
class Cap:
    """What limits ``tenant`` on ``queue`` now (see the module's docstring)."""

    tenant: str
    queue: str
    limit: int | None
    """The most jobs of the tenant that may run at once on the queue; None: no cap."""
    source: str
    """One of :data:`SOURCES`."""
    running: int
    """The tenant's jobs in flight on the queue (dispatched or running; with tenant
    slots, holding a slot)."""
    queue_max_jobs: int | None
    """The queue's limit for all tenants (0: the queue is paused, by either of its
    limits); None: no limit."""
    boosted_until: datetime | None = None

    @property
    def queue_paused(self) -> bool:
        """True when the queue's limit is 0."""
        return self.queue_max_jobs == 0

    def holds(self) -> str | None:
        """What keeps the tenant's next job from starting, in words, or None: the queue
        paused, the tenant paused, or the tenant at its cap."""
        if self.queue_paused:
            return f"the queue {self.queue} is paused (a limit of 0)"
        if self.source == "paused":
            return "its tenant is paused on this queue (its tenant slot's max_jobs is 0)"
        if self.limit is not None and self.running >= self.limit:
            return f"its tenant is at its cap: {self.running} of {self.limit} running ({self.said})"
        return None

    @property
    def said(self) -> str:
        """Where the cap comes from, in words."""
        if self.source == "boost" and self.boosted_until is not None:
            return f"a boost until {self.boosted_until:%Y-%m-%d %H:%M:%S %Z}"
        return {
            "paused": "paused",
            "boost": "a boost",
            "override": "its tenant slot's max_jobs",
            "task": "the task's fair_max_jobs",
            "none": "no cap",
        }[self.source]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with ``holds`` and ``queue_paused``."""
        out = asdict(self)
        out["boosted_until"] = (
            None if self.boosted_until is None else self.boosted_until.isoformat()
        )
        out["queue_paused"] = self.queue_paused
        out["holds"] = self.holds()
        return out


@dataclass(frozen=True)
class Line:
    """What fair dispatch's line of a tenant on a queue says: its head task's cap and its
    jobs in flight."""

    cap: int | None
    in_flight: int


@dataclass(frozen=True)
class Slot:
    """What a tenant slot row says: its override, boost, task default and jobs holding
    it."""

    max_jobs: int | None
    boost_until: datetime | None
    default_max_jobs: int
    current_jobs: int


def combine(
    tenant: str, queue: str, line: Line | None, slot: Slot | None, queue_max_jobs: int | None
) -> Cap:
    """The :class:`Cap` of ``tenant`` on ``queue`` from its rows (any may be missing)."""
    running = max(line.in_flight if line else 0, slot.current_jobs if slot else 0)
    boosted = None if slot is None else slot.boost_until
    if slot is not None and slot.max_jobs is not None:
        source = "paused" if slot.max_jobs == 0 else "boost" if boosted else "override"
        return Cap(tenant, queue, slot.max_jobs, source, running, queue_max_jobs, boosted)
    # A line's cap is its head task's; a slot's task default counts only without a line.
    task_cap = line.cap if line is not None else None if slot is None else slot.default_max_jobs
    source = "none" if task_cap is None else "task"
    return Cap(tenant, queue, task_cap, source, running, queue_max_jobs)


def of(tenant: str, queue: str) -> Cap:
    """The :class:`Cap` of one tenant on one queue (three reads by key)."""
    return of_many([(tenant, queue)])[(tenant, queue)]


def of_line(tenant: str, queue: str, line: Line | None) -> Cap:
    """The :class:`Cap` of one tenant on one queue whose line the caller has read already
    (two reads by key: its slot and its queue's limit)."""
    return of_many([(tenant, queue)], lines={(tenant, queue): line})[(tenant, queue)]


def of_many(
    pairs: Iterable[tuple[str, str]],
    lines: dict[tuple[str, str], Line | None] | None = None,
) -> dict[tuple[str, str], Cap]:
    """The :class:`Cap` of each ``(tenant, queue)`` pair: three reads in all, two when the
    caller gives the pairs' ``lines`` (None for a pair without one)."""
    from django_fair_jobs.dispatch.models import DispatchTenant
    from django_fair_jobs.models import QueueLimit, TenantQueueSlot

    wanted = sorted(set(pairs))
    if not wanted:
        return {}
    queues = {q for _, q in wanted}
    # A superset of the pairs (every tenant on every queue named), read by the tables'
    # (tenant, queue) keys; the pairs not asked for are dropped below.
    match = {"tenant__in": {t for t, _ in wanted}, "queue__in": queues}
    if lines is None:
        lines = {
            (t, q): Line(cap, n)
            for t, q, cap, n in DispatchTenant.objects.filter(**match).values_list(
                "tenant", "queue", "cap", "in_flight"
            )
        }
    slots = {
        (t, q): Slot(m, b, d, c)
        for t, q, m, b, d, c in TenantQueueSlot.objects.filter(**match).values_list(
            "tenant", "queue", "max_jobs", "boost_until", "default_max_jobs", "current_jobs"
        )
    }
    limits = {
        queue: queue_limit(m, w)
        for queue, m, w in QueueLimit.objects.filter(queue__in=queues).values_list(
            "queue", "max_jobs", "max_jobs_per_worker"
        )
    }
    return {
        (t, q): combine(t, q, lines.get((t, q)), slots.get((t, q)), limits.get(q))
        for t, q in wanted
    }


def queue_limit(max_jobs: int | None, max_jobs_per_worker: int | None) -> int | None:
    """A queue's limit for :class:`Cap`: 0 when either of its limits is 0 (paused, as
    queue limits read it), else its ``max_jobs``."""
    return 0 if 0 in (max_jobs, max_jobs_per_worker) else max_jobs


def queue_limits() -> dict[str, int | None]:
    """:func:`queue_limit` of every queue with a stored limit."""
    from django_fair_jobs.models import QueueLimit

    rows = QueueLimit.objects.values_list("queue", "max_jobs", "max_jobs_per_worker")
    return {queue: queue_limit(m, w) for queue, m, w in rows}


def queue_held_by(
    queue: str, capacity: int, slack: int, in_flight: int, room: int, max_jobs: int | None
) -> str | None:
    """What keeps fair dispatch from sending ``queue`` another job now, in words, or
    None: no live worker, the queue paused, every process busy, or its queue limit
    reached (one reason, the first that holds, so that two never contradict)."""
    if capacity == 0:
        return f"no live worker consumes {queue}: start one with -Q {queue}"
    if max_jobs == 0:
        return f"the queue {queue} is paused (a limit of 0)"
    if in_flight >= capacity + slack:
        return f"every worker process of {queue} is busy"
    if room <= 0:
        return f"the queue {queue} is at its limit"
    return None

"""One read of everything an operator watches: the data behind the admin dashboard,
``manage.py fair_jobs_status`` and the Prometheus exporter.

:func:`snapshot` returns JSON-ready data, every age in seconds of the database clock:

* ``tenants``: per tenant with something going on (running, waiting in fair dispatch's
  line, parked, pending, a limit override, a boost, a reroute in the last hour): per
  queue, its jobs running, waiting in line and parked and the cap in force
  (:mod:`django_fair_jobs.caps`); jobs waiting in line, parked and pending, the oldest
  wait, reroutes in the last hour (a view asks for the first few in an order, see
  :data:`RANKS`); ``tenants_active`` counts them all;
* ``queues``: per limited queue: limits, running in all and by node, parked;
* ``planners``: per planned task: its last run and its tenants' backlogs (the ``first``
  waiting longest, when a view asks for a few; ``tenants_total`` counts them all);
* ``nodes``: per worker node: processes, last heartbeat, alive or presumed dead;
* ``dispatch``: per queue of fair dispatch: capacity, slack, in flight, room, jobs
  waiting and scheduled, lines blocked, and what holds the queue back (``held_by``);
* ``fairness``: Jain's index of the small tenants' current waits, every mechanism's;
* ``totals``: counters since the start (reaped leases, planner runs, deferrals) and the
  decisions of the last hour, shadow mode's included.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import router
from django.db.models import Q

from django_fair_jobs import db
from django_fair_jobs.conf import fair_settings

SMALL_BACKLOG = 10
"""A tenant with at most this many jobs waiting (parked and pending) counts as small for
the fairness index: the index asks whether small tenants wait alike, not whether a flood
waits as long as a trickle."""


def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index of ``values``: ``(sum x)^2 / (n * sum x^2)``, 1 when all are
    equal, ``1/n`` when one holds everything; 1 when all are 0, None when there are none."""
    if not values:
        return None
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0
    return round(sum(values) ** 2 / (len(values) * square_sum), 4)


def age(now: datetime, then: datetime | None) -> float | None:
    """Seconds from ``then`` to ``now`` (never negative, one decimal), or None."""
    return None if then is None else round(max((now - then).total_seconds(), 0.0), 1)


def _oldest(field: Any, in_sql: bool, aggregate: bool = True) -> Any:
    """The age of the oldest ``field`` of a group (of ``field`` itself, without
    ``aggregate``): on PostgreSQL, seconds computed by the database (10,000 timestamps
    cost more to load than to age in SQL); elsewhere the timestamp itself, aged by
    :func:`_seconds`."""
    from django.db.models import FloatField, Func, Min

    value = Min(field) if aggregate else field
    if not in_sql:
        return value
    return Func(
        value, template="EXTRACT(EPOCH FROM (now() - %(expressions)s))",
        output_field=FloatField(),
    )  # fmt: skip


def _seconds(now: datetime, oldest: Any) -> float | None:
    """An age from :func:`_oldest` in seconds (never negative, one decimal), or None."""
    if oldest is None or isinstance(oldest, datetime):
        return age(now, oldest)
    return round(max(float(oldest), 0.0), 1)


RANKS = ("name", "wait", "backlog")
"""Orders of :func:`tenants`: by name; the longest wait first (the dashboard's); the most
jobs waiting first (the exporter's). The last two then put the most running first."""

_ACTIVE = (
    Q(current_jobs__gt=0) | Q(parked_jobs__gt=0) | Q(max_jobs__isnull=False)
    | Q(boost_until__isnull=False)
)  # fmt: skip
"""A tenant queue slot worth showing: running, parked, a limit override or a boost."""


@dataclass
class _Summaries:
    """Per tenant with something going on, one figure per dict: jobs running, waiting in
    fair dispatch's lines, parked and pending, the oldest wait in seconds, reroutes and
    shadow decisions in the last hour. Dicts of plain values rather than a row per
    tenant: with 10,000 active tenants, 10,000 rows kept alive cost the garbage
    collector's passes over them more than the queries cost, and a view shows 100 of
    them."""

    running: dict[str, int] = field(default_factory=dict)
    lined: dict[str, int] = field(default_factory=dict)
    parked: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    oldest: dict[str, float] = field(default_factory=dict)
    reroutes: dict[str, int] = field(default_factory=dict)
    shadow: dict[str, int] = field(default_factory=dict)
    lines: dict[str, list[tuple[str, int | None, int, int]]] = field(default_factory=dict)
    """Per tenant, its fair dispatch lines with jobs: (queue, cap, in flight, waiting),
    read once for the figures and the rows."""

    def names(self) -> set[str]:
        """Every tenant with a figure."""
        return set().union(
            self.running, self.lined, self.parked, self.pending, self.reroutes, self.shadow
        )

    def waiting(self, tenant: str) -> int:
        """The tenant's jobs waiting: in fair dispatch's lines, parked and pending."""
        return self.lined.get(tenant, 0) + self.parked.get(tenant, 0) + self.pending.get(tenant, 0)

    def older(self, tenant: str, seconds: float | None) -> None:
        """Keep ``seconds`` as the tenant's oldest wait if it is older."""
        if seconds is not None and self.oldest.get(tenant, 0) <= seconds:
            self.oldest[tenant] = seconds


def _running_and_lines(out: _Summaries, now: datetime, in_sql: bool) -> None:
    """Jobs running per tenant, and its jobs waiting in fair dispatch's lines with the
    age of each line's head (its oldest waiting job: one row per line, not a scan of its
    jobs). Running is its slots' jobs plus its lines' jobs in flight, less the jobs both
    count (a capped dispatched job holds its tenant slot too: per queue, the smaller of
    the two)."""
    from django.db.models import OuterRef, Q, Subquery, Sum

    from django_fair_jobs.dispatch.models import DispatchJob, DispatchTenant
    from django_fair_jobs.models import TenantQueueSlot

    slots = TenantQueueSlot.objects.filter(_ACTIVE)
    out.running.update(
        slots.values("tenant").annotate(n=Sum("current_jobs")).values_list("tenant", "n")
    )
    head = DispatchJob.objects.filter(pk=OuterRef("head_id")).values("enqueued_at")[:1]
    lines = (
        DispatchTenant.objects.filter(Q(waiting__gt=0) | Q(in_flight__gt=0))
        .annotate(head_age=_oldest(Subquery(head), in_sql, aggregate=False))
        .values_list("tenant", "queue", "waiting", "in_flight", "head_age", "cap")
    )
    flying: dict[tuple[str, str], int] = {}
    running, lined = out.running, out.lined
    for tenant, queue, waiting, flight, head_age, cap in lines:
        out.lines.setdefault(tenant, []).append((queue, cap, flight, waiting))
        if flight:
            flying[(tenant, queue)] = flight
            running[tenant] = running.get(tenant, 0) + flight
        if waiting:
            lined[tenant] = lined.get(tenant, 0) + waiting
            out.older(tenant, _seconds(now, head_age))
    if flying:
        both = slots.filter(current_jobs__gt=0, tenant__in={t for t, _ in flying})
        for tenant, queue, n in both.values_list("tenant", "queue", "current_jobs"):
            if (tenant, queue) in flying:
                running[tenant] -= min(n, flying[(tenant, queue)])


def _summaries(now: datetime) -> _Summaries:
    """The figures of :class:`_Summaries`: a few grouped queries, whatever the number of
    jobs."""
    from django.db.models import Count

    from django_fair_jobs.models import JobDecision, ParkedJob, PlannedJob

    out = _Summaries()
    in_sql = db.is_postgres(router.db_for_read(ParkedJob))
    _running_and_lines(out, now, in_sql)
    waiting = (
        (out.parked, "slot__tenant", "parked_at",
         ParkedJob.objects.filter(woken_at__isnull=True, slot__isnull=False)),
        (out.pending, "tenant", "enqueued_at",
         PlannedJob.objects.filter(promoted_at__isnull=True, failed_at__isnull=True)),
    )  # fmt: skip
    for counts, tenant_field, since, rows in waiting:
        grouped = (
            rows.values(tenant_field)
            .annotate(n=Count("pk"), oldest=_oldest(since, in_sql))
            .values_list(tenant_field, "n", "oldest")
        )
        for tenant, n, oldest in grouped:
            counts[tenant] = n
            out.older(tenant, _seconds(now, oldest))
    recent = (
        JobDecision.objects.filter(at__gte=now - timedelta(hours=1))
        .exclude(tenant="")
        .values("tenant", "mechanism", "enforced")
        .annotate(n=Count("pk"))
        .values_list("tenant", "mechanism", "enforced", "n")
    )
    for tenant, mechanism, enforced, n in recent:
        if enforced and mechanism == "reroute":
            out.reroutes[tenant] = out.reroutes.get(tenant, 0) + n
        elif not enforced:
            out.shadow[tenant] = out.shadow.get(tenant, 0) + n
    return out


def _ranked(summaries: _Summaries, names: set[str], first: int | None, rank: str) -> list[str]:
    """The tenants ``names`` of ``summaries`` in the order ``rank`` names, the first
    ``first``."""
    running = summaries.running
    if rank == "name":
        return sorted(names)[:first]
    if rank == "wait":
        oldest = summaries.oldest

        def key(t: str) -> tuple[float, int, str]:
            return (-oldest.get(t, 0), -running.get(t, 0), t)

    elif rank == "backlog":

        def key(t: str) -> tuple[float, int, str]:
            return (-summaries.waiting(t), -running.get(t, 0), t)

    else:
        raise ValueError(f"rank must be one of {', '.join(RANKS)}, not {rank!r}")
    if first is None:
        return sorted(names, key=key)
    return heapq.nsmallest(first, names, key=key)


def _rows(
    summaries: _Summaries, chosen: list[str], active: int, limits: dict[str, int | None]
) -> list[dict[str, Any]]:
    """The full rows of the ``chosen`` tenants (of ``active`` in all), in their order:
    each one's queues too, with the cap in force on each (``limits``: the queues' limits,
    :func:`django_fair_jobs.caps.queue_limits`)."""
    s = summaries
    per_queue = _queues_of(s, chosen if len(chosen) < active else None, limits)
    return [
        {"tenant": t, "queues": per_queue.get(t, []), "running": s.running.get(t, 0),
         "waiting": s.lined.get(t, 0), "parked": s.parked.get(t, 0),
         "pending": s.pending.get(t, 0), "oldest_wait_seconds": s.oldest.get(t),
         "reroutes_last_hour": s.reroutes.get(t, 0),
         "shadow_decisions_last_hour": s.shadow.get(t, 0)}
        for t in chosen
    ]  # fmt: skip


def _queues_of(
    summaries: _Summaries, chosen: list[str] | None, limits: dict[str, int | None]
) -> dict[str, list[dict[str, Any]]]:
    """Per tenant of ``chosen`` (None: every tenant with something going on), per queue
    where it has a tenant slot worth showing or a line with jobs: jobs running, waiting in
    line and parked, and the cap in force (:func:`django_fair_jobs.caps.combine`). The
    lines are the ones :func:`_summaries` read."""
    from django_fair_jobs import caps
    from django_fair_jobs.models import TenantQueueSlot

    slots = TenantQueueSlot.objects.filter(_ACTIVE)
    if chosen is not None:  # a page of the busiest: read only their rows
        slots = slots.filter(tenant__in=chosen)
    found: dict[tuple[str, str], dict[str, Any]] = {}
    columns = ("tenant", "queue", "max_jobs", "boost_until", "default_max_jobs",
               "current_jobs", "parked_jobs", "deferred_total")  # fmt: skip
    for t, q, override, boost, default, running, parked, deferred in slots.values_list(*columns):
        found[(t, q)] = {"slot": caps.Slot(override, boost, default, running),
                         "parked": parked, "deferred_total": deferred}  # fmt: skip
    for t in summaries.lines if chosen is None else chosen:
        for q, task_cap, flight, waiting in summaries.lines.get(t, ()):
            found.setdefault((t, q), {})["line"] = (caps.Line(task_cap, flight), waiting)
    out: dict[str, list[dict[str, Any]]] = {}
    for (t, q), rows in sorted(found.items()):
        line, waiting = rows.get("line", (None, 0))
        cap = caps.combine(t, q, line, rows.get("slot"), limits.get(q))
        out.setdefault(t, []).append(
            {"queue": q, "running": cap.running, "waiting": waiting,
             "parked": rows.get("parked", 0), "limit": cap.limit, "limit_source": cap.source,
             "override": None if "slot" not in rows else rows["slot"].max_jobs,
             "paused": cap.limit == 0, "queue_paused": cap.queue_paused,
             "boosted_until": None if cap.boosted_until is None else cap.boosted_until.isoformat(),
             "deferred_total": rows.get("deferred_total", 0), "holds": cap.holds()}
        )  # fmt: skip
    return out


def tenants(now: datetime, first: int | None = None, rank: str = "name") -> list[dict[str, Any]]:
    """Per tenant with something going on: slots, parked, pending, oldest wait, reroutes
    in the last hour. The first ``first`` (default: all) in the order ``rank`` names (one
    of :data:`RANKS`); only those tenants' rows are built."""
    summaries = _summaries(now)
    names = summaries.names()
    from django_fair_jobs import caps

    chosen = _ranked(summaries, names, first, rank)
    return _rows(summaries, chosen, len(names), caps.queue_limits())


def nodes(now: datetime) -> list[dict[str, Any]]:
    """Per worker node (one ``celery worker`` start): its processes and last heartbeat."""
    from django.db.models import Count, Max

    from django_fair_jobs.models import WorkerProcess

    rows = (
        WorkerProcess.objects.values("node_id", "node", "hostname")
        .annotate(processes=Count("pk"), last=Max("last_heartbeat_at"))
        .order_by("node", "node_id")
    )
    out = []
    for r in rows:
        beat = age(now, r["last"])
        out.append(
            {"node": r["node"], "node_id": str(r["node_id"]), "hostname": r["hostname"],
             "processes": r["processes"], "last_heartbeat_seconds": beat,
             "alive": beat is not None and beat <= fair_settings.WORKER_TIMEOUT}
        )  # fmt: skip
    return out


def totals(now: datetime) -> dict[str, Any]:
    """Counters since the start and the decisions of the last hour."""
    from django.db.models import Count, Sum

    from django_fair_jobs.models import (
        JobDecision,
        Maintenance,
        PlannerRun,
        QueueLimit,
        TenantQueueSlot,
    )

    reaped = Maintenance.objects.filter(name="reaped").values_list("leases_reaped_total", flat=True)
    decided = (
        JobDecision.objects.filter(at__gte=now - timedelta(hours=1))
        .values("mechanism", "action", "enforced")
        .annotate(n=Count("pk"))
        .order_by("mechanism", "action")
    )
    return {
        "leases_reaped_total": int(reaped.first() or 0),
        "planner_runs_total": dict(PlannerRun.objects.values_list("task_name", "runs_total")),
        "tenant_deferrals_total": int(
            TenantQueueSlot.objects.aggregate(n=Sum("deferred_total"))["n"] or 0
        ),
        "queue_deferrals_total": int(
            QueueLimit.objects.aggregate(n=Sum("deferred_total"))["n"] or 0
        ),
        "decisions_last_hour": list(decided),
    }


def fairness(tenant_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Jain's index of the current waits of the small tenants (at most
    :data:`SMALL_BACKLOG` jobs waiting) among those running or waiting: each tenant's
    wait is the age of its oldest waiting job, 0 if it has none waiting."""
    return _fairness(
        (t["running"], t["waiting"] + t["parked"] + t["pending"], t["oldest_wait_seconds"])
        for t in tenant_rows
    )


def _fairness(tenants: Iterable[tuple[int, int, float | None]]) -> dict[str, Any]:
    """:func:`fairness` of (running, waiting, oldest wait) per tenant."""
    small = [
        float(oldest or 0.0)
        for running, waiting, oldest in tenants
        if (running or waiting) and waiting <= SMALL_BACKLOG
    ]
    return {"jain_index": jain_index(small), "small_tenants": len(small)}


def snapshot(first: int | None = None, rank: str = "name") -> dict[str, Any]:
    """Everything the dashboard shows, as JSON-ready data (see the module docstring): the
    tenants as :func:`tenants` gives them for ``first`` and ``rank``, and how many are
    active in all (``tenants_active``); the fairness index is over every tenant."""
    from django_fair_jobs import caps
    from django_fair_jobs.planner import status as planner_status
    from django_fair_jobs.queue_limits import queue_status

    now = db.database_now()
    summaries = _summaries(now)
    limits = caps.queue_limits()  # read once for the tenants' caps and the queues
    names = summaries.names()
    return {
        "at": now.isoformat(),
        "enforce": bool(fair_settings.ENFORCE),
        "tenants": _rows(summaries, _ranked(summaries, names, first, rank), len(names), limits),
        "tenants_active": len(names),
        "queues": queue_status(),
        "dispatch": _dispatch_queues(limits),
        "planners": planner_status(first=first),
        "nodes": nodes(now),
        "fairness": _fairness(
            (summaries.running.get(t, 0), summaries.waiting(t), summaries.oldest.get(t))
            for t in names
        ),
        "totals": totals(now),
    }


def _dispatch_queues(limits: dict[str, int | None]) -> list[dict[str, Any]]:
    """Fair dispatch's queues (:func:`_dispatch_rows`), each with
    what holds it back (``held_by``, :func:`django_fair_jobs.caps.queue_held_by`, under
    the queues' ``limits``)."""
    from django_fair_jobs import caps

    rows = _dispatch_rows()
    for d in rows:
        d["held_by"] = caps.queue_held_by(
            d["queue"], d["capacity"], d["slack"], d["in_flight"], d["room"],
            limits.get(d["queue"]),
        )  # fmt: skip
    return rows


def _dispatch_rows() -> list[dict[str, Any]]:
    """Per queue of fair dispatch: its capacity and slack, jobs in flight, room, jobs
    waiting and scheduled, failed jobs, and lines blocked (at their cap or paused)."""
    from django.db.models import Count, Q

    from django_fair_jobs import dispatch
    from django_fair_jobs.dispatch.models import (
        FAILED,
        SCHEDULED,
        WAITING,
        DispatchJob,
        DispatchQueue,
        DispatchTenant,
    )

    using = dispatch.alias()
    flight, free = dispatch.in_flight(), dispatch.room()
    jobs: dict[str, dict[str, Any]] = {
        row["queue"]: dict(row)
        for row in DispatchJob.objects.using(using)
        .values("queue")
        .annotate(
            waiting=Count("pk", filter=Q(state=WAITING)),
            scheduled=Count("pk", filter=Q(state=SCHEDULED)),
            failed=Count("pk", filter=Q(state=FAILED)),
        )
    }
    blocked = dict(
        DispatchTenant.objects.using(using)
        .filter(blocked=True, waiting__gt=0)
        .values("queue")
        .annotate(n=Count("pk"))
        .values_list("queue", "n")
    )
    capacity = {q.queue: q for q in DispatchQueue.objects.using(using)}
    out = []
    for queue in sorted(set(capacity) | set(jobs)):
        row, counts = capacity.get(queue), dict(jobs.get(queue) or {})
        out.append({
            "queue": queue,
            "capacity": 0 if row is None else row.capacity,
            "slack": 0 if row is None else row.slack,
            "in_flight": flight.get(queue, 0),
            "room": free.get(queue, 0),
            "waiting": counts.get("waiting", 0),
            "scheduled": counts.get("scheduled", 0),
            "failed": counts.get("failed", 0),
            "blocked_tenants": blocked.get(queue, 0),
        })  # fmt: skip
    return out


def as_text(snap: dict[str, Any]) -> str:
    """The snapshot as the text ``fair_jobs_status`` prints: tenants, queues, planners,
    nodes, fairness and totals, one line per item."""
    shadow = "" if snap["enforce"] else " (SHADOW MODE: rules are recorded, not enforced)"
    lines = [f"django-fair-jobs at {snap['at']}{shadow}"]
    lines.append("tenants:" if snap["tenants"] else "tenants: none active")
    for t in snap["tenants"]:
        queues = ", ".join(_queue_text(q) for q in t["queues"])
        wait = t["oldest_wait_seconds"]
        lines.append(
            f"  {_tenant_text(t['tenant'])}: running {queues or t['running']}; waiting in "
            f"line {t['waiting']}, parked {t['parked']}, pending {t['pending']}, oldest "
            f"wait {'-' if wait is None else f'{wait:g} s'}, reroutes "
            f"last hour {t['reroutes_last_hour']}"
            + (f", shadow decisions {t['shadow_decisions_last_hour']}"
               if t["shadow_decisions_last_hour"] else "")
        )  # fmt: skip
    lines.append("queues:" if snap["queues"] else "queues: no limits stored (see fair_jobs_limit)")
    for q in snap["queues"]:
        nodes_text = ", ".join(f"{n}: {c}" for n, c in q["running_by_node"].items()) or "-"
        oldest = q["oldest_parked_seconds"]
        lines.append(
            f"  {q['queue']}{' PAUSED' if q['paused'] else ''}: max_jobs {_show(q['max_jobs'])}, "
            f"max_jobs_per_worker {_show(q['max_jobs_per_worker'])}; "
            f"running {q['running']} ({nodes_text}); "
            f"parked {q['parked']}{'' if oldest is None else f', oldest {oldest:g} s'}; "
            f"deferred ever {q['deferred_total']}"
        )  # fmt: skip
    for d in snap.get("dispatch", []):
        failed = f", {d['failed']} FAILED (see the admin)" if d["failed"] else ""
        lines.append(
            f"fair dispatch {d['queue']}: capacity {d['capacity']} + slack {d['slack']}, "
            f"in flight {d['in_flight']}, room {d['room']}; waiting {d['waiting']}, "
            f"scheduled {d['scheduled']}, tenants blocked {d['blocked_tenants']}{failed}"
            + (f"; held back: {d['held_by']}" if d["held_by"] else "")
        )
    lines.extend(_planner_lines(snap["planners"]))
    lines.append("nodes:" if snap["nodes"] else "nodes: no worker has registered")
    for n in snap["nodes"]:
        state = "alive" if n["alive"] else "PRESUMED DEAD"
        lines.append(
            f"  {n['node']} ({n['hostname']}): {n['processes']} process(es), last heartbeat "
            f"{n['last_heartbeat_seconds']:g} s ago, {state}"
        )
    fair = snap["fairness"]
    index = fair["jain_index"]
    lines.append(
        f"fairness: Jain's index {'-' if index is None else f'{index:.3f}'} over "
        f"{fair['small_tenants']} small tenant(s)"
    )
    tot = snap["totals"]
    lines.append(
        f"totals: leases reaped {tot['leases_reaped_total']}, deferrals (tenant slots) "
        f"{tot['tenant_deferrals_total']}, deferrals (queues) {tot['queue_deferrals_total']}"
    )
    for d in tot["decisions_last_hour"]:
        shadow = "" if d["enforced"] else " (shadow)"
        lines.append(f"  last hour: {d['mechanism']} {d['action']}{shadow}: {d['n']}")
    return "\n".join(lines)


def _planner_lines(planners: list[dict[str, Any]]) -> list[str]:
    """The planners' part of :func:`as_text`: each planner's last run, then its tenants."""
    lines: list[str] = []
    for plan in planners:
        skipped = (
            " (skipped: queue latency above threshold)"
            if plan["last_skipped_for_backpressure"]
            else ""
        )
        lines.append(
            f"planner {plan['task']}: last run {plan['last_run_at'] or 'never'}, promoted "
            f"{plan['last_promoted'] or 0}{skipped}"
        )
        for t in plan["tenants"]:
            oldest = t["oldest_pending_seconds"]
            wait = "" if oldest is None else f", oldest pending {oldest:g} s"
            paused = " PAUSED" if t["paused"] else ""
            failed = f", {t['failed']} failed (see the admin)" if t.get("failed") else ""
            lines.append(f"    {t['tenant']}{paused}: {t['pending']} pending{wait}{failed}")
    return lines


def _queue_text(q: dict[str, Any]) -> str:
    """One queue of a tenant in :func:`as_text`: running / cap in force ("-": none), jobs
    waiting in line, and what holds it."""
    text = f"{q['queue']} {q['running']}/{'-' if q['limit'] is None else q['limit']}"
    if q["boosted_until"]:
        text += f" (boosted until {q['boosted_until']})"
    if q["waiting"]:
        text += f", {q['waiting']} in line"
    if q["holds"]:
        text += f" ({q['holds']})"
    return text


def _tenant_text(tenant: str) -> str:
    """A tenant as :func:`as_text` names it (fair dispatch's line of jobs without a
    tenant has the empty name)."""
    return tenant if tenant else "(no tenant)"


def _show(limit: int | None) -> str:
    return "none" if limit is None else str(limit)

"""The Prometheus exporter (optional: the ``metrics`` extra, which installs prometheus-client).

:class:`FairJobsCollector` reads the database at every scrape (nothing is cached, nothing
is counted in the process): :func:`django_fair_jobs.status.snapshot`, the data behind the
admin dashboard, and a few grouped queries for the counters of every tenant, queue and
planned task. Every metric it exposes is listed in :data:`METRICS` and in
``docs/metrics.md``.

Two ways to serve it:

* :func:`metrics_view`, a plain Django view on a private registry that holds only this
  collector. It does no access control: protect it (``staff_member_required``, a network
  rule, or an internal port).
* :func:`register`, which adds the collector to a ``prometheus_client`` registry (the
  default one unless told), for projects that already serve one with
  ``prometheus_client.start_http_server`` or django-prometheus.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

try:
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "django_fair_jobs.metrics needs prometheus-client: install django-fair-jobs with "
        "its metrics extra (the wheel's [metrics]), or pip install prometheus-client"
    ) from exc

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.http import HttpRequest, HttpResponse

from django_fair_jobs import status, waits
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.tenants import shorten

logger = logging.getLogger("django_fair_jobs.metrics")

TENANT_LABEL_MAX_LENGTH = 100
"""Longest ``tenant`` label value. A longer tenant is shown as its first 91 characters,
``~`` and the first 8 hex digits of its SHA-256, so that two long tenants that share a
prefix stay two series."""


Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily


@dataclass(frozen=True)
class MetricSpec:
    """One metric the exporter exposes: its name as queried in Prometheus (a counter's
    ends in ``_total``), its type, its label names and its help text."""

    name: str
    kind: Literal["gauge", "counter", "histogram"]
    labels: tuple[str, ...]
    help: str

    def family(self) -> Family:
        """A new, empty metric family for this metric."""
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=self.labels)
        if self.kind == "histogram":
            return HistogramMetricFamily(self.name, self.help, labels=self.labels)
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)


def _gauge(name: str, labels: tuple[str, ...], text: str) -> MetricSpec:
    return MetricSpec(name, "gauge", labels, text)


def _counter(name: str, labels: tuple[str, ...], text: str) -> MetricSpec:
    return MetricSpec(name, "counter", labels, text)


def _histogram(name: str, labels: tuple[str, ...], text: str) -> MetricSpec:
    return MetricSpec(name, "histogram", labels, text)


T, Q, K, N = ("tenant",), ("queue",), ("task",), ("node",)

METRICS: tuple[MetricSpec, ...] = (
    _gauge("fair_jobs_up", (), "1 if the database was read at this scrape, 0 if not "
           "(then no other fair_jobs_ metric but the scrape duration is exposed)."),
    _gauge("fair_jobs_scrape_duration_seconds", (),
           "Seconds this scrape spent reading the database."),
    _gauge("fair_jobs_enforce", (), "1 if rules are enforced, 0 in shadow mode "
           "(FAIR_JOBS_ENFORCE = False: decisions are recorded, not applied)."),
    _gauge("fair_jobs_tenant_running", (*T, *Q), "Jobs of the tenant running on the queue "
           "(slots held, or fair dispatch's jobs in flight)."),
    _gauge("fair_jobs_tenant_max_jobs", (*T, *Q), "Jobs the tenant may run at once on the "
           "queue: the cap in force (its tenant slot's override, else the task's "
           "fair_max_jobs; 0: paused); absent when the tenant has no cap."),
    _gauge("fair_jobs_tenant_waiting", (*T, *Q), "Jobs of the tenant waiting in fair "
           "dispatch's line on the queue, not yet dispatched."),
    _gauge("fair_jobs_tenant_parked", T, "Jobs of the tenant parked, waiting for one of its "
           "slots or for a place in a limited queue."),
    _gauge("fair_jobs_tenant_pending", T, "Jobs of the tenant held in a fair planner's "
           "virtual queue, not yet promoted."),
    _gauge("fair_jobs_tenant_oldest_wait_seconds", T, "Age of the tenant's oldest waiting "
           "job (in fair dispatch's line, parked or pending), in seconds."),
    _gauge("fair_jobs_tenants_omitted", (), "Active tenants left out of the fair_jobs_tenant_"
           "gauges this scrape (beyond FAIR_JOBS_METRICS_TENANTS, the least busy)."),
    _counter("fair_jobs_tenant_deferrals_total", (*T, *Q), "Jobs of the tenant ever deferred "
             "because its slot on the queue was full."),
    _counter("fair_jobs_reroutes_total", (*T, *K, *Q), "Jobs of the tenant and task ever "
             "rerouted to the queue by a rerouting rule."),
    _gauge("fair_jobs_queue_running", Q, "Jobs running from the stored queue, cluster-wide."),
    _gauge("fair_jobs_queue_node_running", (*Q, *N), "Jobs running from the queue on the "
           "worker node."),
    _gauge("fair_jobs_queue_max_jobs", Q, "The queue's cluster-wide max_jobs (0: paused); "
           "absent when it has none."),
    _gauge("fair_jobs_queue_max_jobs_per_worker", Q, "The queue's max_jobs_per_worker on "
           "each worker node (0: paused); absent when it has none."),
    _gauge("fair_jobs_queue_paused", Q, "1 if either of the queue's limits is 0, else 0."),
    _gauge("fair_jobs_queue_parked", Q, "Jobs parked in the queue's line."),
    _gauge("fair_jobs_queue_oldest_parked_seconds", Q, "Age of the oldest job parked in the "
           "queue's line, in seconds; absent when none is."),
    _counter("fair_jobs_queue_deferrals_total", Q, "Jobs ever deferred (parked or postponed) "
             "because the queue was at a limit."),
    _histogram("fair_jobs_wait_seconds", (*Q, "tenant_class"), "Seconds from enqueue (or "
               "ETA) to start of the queue's jobs, by tenant class "
               "(FAIR_JOBS_METRICS_TENANT_CLASS); flushed by each worker process once per "
               "heartbeat interval."),
    _gauge("fair_jobs_queue_waiting", Q, "Jobs of fair dispatch due and waiting in the "
           "queue's tenants' lines, not yet dispatched."),
    _gauge("fair_jobs_queue_in_flight", Q, "Jobs of fair dispatch dispatched to the queue "
           "(in the broker) or running from it."),
    _gauge("fair_jobs_queue_capacity", Q, "Live worker processes (or threads) that consume "
           "the queue: fair dispatch keeps this many jobs in flight on it, plus the slack."),
    _gauge("fair_jobs_queue_slack", Q, "Messages fair dispatch keeps in the broker beyond "
           "the queue's capacity (FAIR_JOBS_DISPATCH_SLACK per live worker node)."),
    _gauge("fair_jobs_planner_pending", (*K, *T), "Jobs of the tenant in the task's virtual "
           "queue, not yet promoted."),
    _gauge("fair_jobs_planner_oldest_pending_seconds", (*K, *T), "Age of the tenant's oldest "
           "job not yet promoted by the task's planner, in seconds."),
    _gauge("fair_jobs_planner_promoted_not_started", (*K, *T), "Jobs of the tenant promoted "
           "to the broker by the task's planner and not started yet."),
    _gauge("fair_jobs_planner_failed", (*K, *T), "Jobs of the tenant whose publish failed "
           "too often: never promoted again until put back in line."),
    _counter("fair_jobs_planner_promoted_total", (*K, *T), "Jobs of the tenant ever promoted "
             "by the task's planner."),
    _gauge("fair_jobs_planner_tenant_paused", (*K, *T), "1 for each tenant whose promotion "
           "is paused in the task's planner; absent otherwise."),
    _counter("fair_jobs_planner_runs_total", K, "Runs of the task's planner ever finished."),
    _gauge("fair_jobs_planner_last_run_age_seconds", K, "Seconds since the task's planner "
           "last ran; absent before its first run."),
    _gauge("fair_jobs_planner_last_promoted", K, "Jobs the task's planner promoted at its "
           "last run."),
    _gauge("fair_jobs_planner_last_latency_seconds", K, "Queue latency the last run measured "
           "(age of the oldest promoted job not started); absent when none waited."),
    _gauge("fair_jobs_planner_last_run_skipped", K, "1 if the last run promoted nothing "
           "because the latency was above the threshold (backpressure), else 0."),
    _counter("fair_jobs_leases_reaped_total", (), "Leases of dead worker processes ever "
             "released by the reaper."),
    _gauge("fair_jobs_worker_heartbeat_age_seconds", N, "Seconds since the node's last "
           "heartbeat (its most recent process's)."),
    _gauge("fair_jobs_worker_processes", N, "Registered processes of the worker node."),
    _gauge("fair_jobs_worker_alive", N, "1 if the node beat within FAIR_JOBS_WORKER_TIMEOUT, "
           "else 0 (presumed dead until reaped)."),
    _gauge("fair_jobs_workers_alive", (), "Worker nodes alive."),
    _gauge("fair_jobs_fairness_index", (), "Jain's index of the small tenants' current waits "
           "(1: equal waits, 1/n: one waits alone); absent when no small tenant is active."),
    _gauge("fair_jobs_fairness_small_tenants", (), "Tenants the fairness index is computed "
           "over (running or waiting, at most 10 jobs waiting)."),
    _gauge("fair_jobs_decisions_last_hour", ("mechanism", "action", "enforced"),
           "Decisions recorded in the last hour; enforced=\"false\": shadow mode."),
)  # fmt: skip
"""Every metric the exporter exposes, in the order of the exposition."""


def tenant_label(tenant: str) -> str:
    """The ``tenant`` label value of ``tenant``: the tenant itself up to
    :data:`TENANT_LABEL_MAX_LENGTH` characters, else a prefix and a short hash."""
    # The same cut as the logs' (django_fair_jobs.tenants.for_log), so that a long
    # tenant's label and its log lines carry the same digest.
    return shorten(tenant, TENANT_LABEL_MAX_LENGTH)


class _Families:
    """The families of one scrape, by name, filled sample by sample."""

    def __init__(self) -> None:
        self.by_name: dict[str, Family] = {}
        self._samples: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        self._histograms: dict[str, HistogramMetricFamily] = {}
        for spec in METRICS:
            family = self.by_name[spec.name] = spec.family()
            if isinstance(family, HistogramMetricFamily):
                self._histograms[spec.name] = family
            else:
                self._samples[spec.name] = family

    def add(self, name: str, labels: Iterable[str], value: float | None) -> None:
        """Add one sample of a gauge or a counter (and of its deprecated old name, see
        :data:`DEPRECATED_METRICS`); a None value adds nothing."""
        if value is not None:
            labels = list(labels)
            self._samples[name].add_metric(labels, float(value))

    def add_histogram(
        self, name: str, labels: Iterable[str], counts: list[int], total: float
    ) -> None:
        """Add one histogram series: ``counts`` per bucket of :data:`waits.BUCKETS` (not
        cumulative) and the observations' sum."""
        family = self._histograms[name]
        cumulative, running = [], 0
        for bound, count in zip(waits.BUCKETS, counts, strict=True):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else f"{bound:g}", running))
        family.add_metric(list(labels), cumulative, total)


class FairJobsCollector(Collector):
    """A ``prometheus_client`` collector that reads django-fair-jobs' rows at every
    scrape: the metrics of :data:`METRICS`.

    If the database cannot be read, the scrape still answers, with ``fair_jobs_up 0``
    (and the error logged), so that a registry shared with other collectors keeps working.
    A database connection the scrape opened is closed after it (unless inside a
    transaction), so scrapes from threads outside Django's request cycle (as those of
    ``prometheus_client.start_http_server``) leave no connection behind.
    """

    def describe(self) -> Iterator[Metric]:
        """The metric families, without samples and without reading the database (so that
        registering the collector does not query it)."""
        for spec in METRICS:
            yield spec.family()

    def collect(self) -> Iterator[Metric]:
        """Read the database and yield every metric family (see :data:`METRICS`)."""
        started = time.perf_counter()
        connection = connections[DEFAULT_DB_ALIAS]
        opened_here = connection.connection is None
        families = _Families()
        up = 1
        try:
            self._fill(families)
        except DatabaseError:
            logger.warning("Could not read django-fair-jobs' rows for the metrics", exc_info=True)
            families, up = _Families(), 0
        finally:
            if opened_here and not connection.in_atomic_block:
                connection.close()
        families.add("fair_jobs_up", [], up)
        families.add("fair_jobs_scrape_duration_seconds", [], time.perf_counter() - started)
        yield from families.by_name.values()

    def _fill(self, out: _Families) -> None:
        # The busiest tenants' series only (most jobs waiting, then running), at most
        # FAIR_JOBS_METRICS_TENANTS: past that, the series cost every scrape and Prometheus
        # more than they tell (see docs/metrics.md, Labels and cardinality).
        snap = status.snapshot(first=fair_settings.METRICS_TENANTS, rank="backlog")
        now = datetime.fromisoformat(snap["at"])
        out.add("fair_jobs_enforce", [], 1 if snap["enforce"] else 0)
        out.add("fair_jobs_tenants_omitted", [], snap["tenants_active"] - len(snap["tenants"]))
        self._tenants(out, snap["tenants"])
        self._queues(out, snap["queues"])
        self._dispatch(out, snap["dispatch"])
        for (queue, cls), (counts, total) in sorted(waits.histogram().items()):
            out.add_histogram("fair_jobs_wait_seconds", [queue, cls], counts, total)
        self._planners(out, now, snap["totals"]["planner_runs_total"])
        self._nodes(out, snap["nodes"])
        fairness = snap["fairness"]
        out.add("fair_jobs_fairness_index", [], fairness["jain_index"])
        out.add("fair_jobs_fairness_small_tenants", [], fairness["small_tenants"])
        totals = snap["totals"]
        out.add("fair_jobs_leases_reaped_total", [], totals["leases_reaped_total"])
        for d in totals["decisions_last_hour"]:
            labels = [d["mechanism"], d["action"], "true" if d["enforced"] else "false"]
            out.add("fair_jobs_decisions_last_hour", labels, d["n"])

    def _tenants(self, out: _Families, rows: list[dict[str, Any]]) -> None:
        from django_fair_jobs.models import RerouteCount, TenantQueueSlot

        for row in rows:
            tenant = tenant_label(row["tenant"])
            for queue in row["queues"]:
                labels = [tenant, queue["queue"]]
                out.add("fair_jobs_tenant_running", labels, queue["running"])
                out.add("fair_jobs_tenant_max_jobs", labels, queue["limit"])
                out.add("fair_jobs_tenant_waiting", labels, queue["waiting"])
            out.add("fair_jobs_tenant_parked", [tenant], row["parked"])
            out.add("fair_jobs_tenant_pending", [tenant], row["pending"])
            out.add("fair_jobs_tenant_oldest_wait_seconds", [tenant], row["oldest_wait_seconds"])
        # Counters of every slot that ever deferred, active or not: a series must not
        # vanish while the tenant is idle, or rate() would miss its next increase.
        deferred = (
            TenantQueueSlot.objects.filter(deferred_total__gt=0)
            .order_by("tenant", "queue")
            .values_list("tenant", "queue", "deferred_total")
        )
        for tenant, queue, n in deferred:
            out.add("fair_jobs_tenant_deferrals_total", [tenant_label(tenant), queue], n)
        reroutes = RerouteCount.objects.order_by("tenant", "task_name", "queue").values_list(
            "tenant", "task_name", "queue", "total"
        )
        for tenant, task, queue, n in reroutes:
            out.add("fair_jobs_reroutes_total", [tenant_label(tenant), task, queue], n)

    def _queues(self, out: _Families, rows: list[dict[str, Any]]) -> None:
        for q in rows:
            name = q["queue"]
            out.add("fair_jobs_queue_running", [name], q["running"])
            for node, n in q["running_by_node"].items():
                out.add("fair_jobs_queue_node_running", [name, node], n)
            out.add("fair_jobs_queue_max_jobs", [name], q["max_jobs"])
            out.add("fair_jobs_queue_max_jobs_per_worker", [name], q["max_jobs_per_worker"])
            out.add("fair_jobs_queue_paused", [name], 1 if q["paused"] else 0)
            out.add("fair_jobs_queue_parked", [name], q["parked"])
            out.add("fair_jobs_queue_oldest_parked_seconds", [name], q["oldest_parked_seconds"])
            out.add("fair_jobs_queue_deferrals_total", [name], q["deferred_total"])

    def _dispatch(self, out: _Families, rows: list[dict[str, Any]]) -> None:
        # The snapshot's rows (status's dispatch rows): read once for status and metrics.
        for q in rows:
            out.add("fair_jobs_queue_waiting", [q["queue"]], q["waiting"])
            out.add("fair_jobs_queue_in_flight", [q["queue"]], q["in_flight"])
            out.add("fair_jobs_queue_capacity", [q["queue"]], q["capacity"])
            out.add("fair_jobs_queue_slack", [q["queue"]], q["slack"])

    def _planners(self, out: _Families, now: datetime, runs_total: dict[str, int]) -> None:
        # From the rows, not from the Celery app's task registry (which planner.status
        # reads): a web process may not have imported the modules of the planned tasks.
        from django.db.models import Count, Min, Q

        from django_fair_jobs.models import PlannedJob, PlannerRun, PlannerTenant

        waiting = Q(promoted_at__isnull=True, failed_at__isnull=True)
        jobs = (
            PlannedJob.objects.values("task_name", "tenant")
            .annotate(
                pending=Count("pk", filter=waiting),
                oldest=Min("enqueued_at", filter=waiting),
                in_flight=Count("pk", filter=Q(promoted_at__isnull=False)),
                failed=Count("pk", filter=Q(failed_at__isnull=False)),
            )
            .order_by("task_name", "tenant")
        )
        for j in jobs:
            labels = [j["task_name"], tenant_label(j["tenant"])]
            out.add("fair_jobs_planner_pending", labels, j["pending"])
            out.add("fair_jobs_planner_oldest_pending_seconds", labels, _age(now, j["oldest"]))
            out.add("fair_jobs_planner_promoted_not_started", labels, j["in_flight"])
            out.add("fair_jobs_planner_failed", labels, j["failed"])
        standing = PlannerTenant.objects.order_by("task_name", "tenant").values_list(
            "task_name", "tenant", "promoted_total", "paused"
        )
        for task, tenant, promoted, paused in standing:
            labels = [task, tenant_label(tenant)]
            out.add("fair_jobs_planner_promoted_total", labels, promoted)
            out.add("fair_jobs_planner_tenant_paused", labels, 1 if paused else None)
        for task, n in sorted(runs_total.items()):
            out.add("fair_jobs_planner_runs_total", [task], n)
        for run in PlannerRun.objects.order_by("task_name"):
            labels = [run.task_name]
            out.add("fair_jobs_planner_last_run_age_seconds", labels, _age(now, run.last_run_at))
            if run.last_run_at is not None:
                out.add("fair_jobs_planner_last_promoted", labels, run.last_promoted)
                out.add("fair_jobs_planner_last_latency_seconds", labels, run.last_latency)
                out.add("fair_jobs_planner_last_run_skipped", labels, 1 if run.last_skipped else 0)

    def _nodes(self, out: _Families, rows: list[dict[str, Any]]) -> None:
        # One series per node name: a restarted node is a new node id under the same name
        # until the reaper deletes the old one's rows.
        by_name: dict[str, dict[str, Any]] = {}
        for n in rows:
            seen = by_name.setdefault(n["node"], {"age": None, "processes": 0, "alive": False})
            age = n["last_heartbeat_seconds"]
            if age is not None and (seen["age"] is None or age < seen["age"]):
                seen["age"] = age
            seen["processes"] += n["processes"]
            seen["alive"] = seen["alive"] or n["alive"]
        for name, seen in sorted(by_name.items()):
            out.add("fair_jobs_worker_heartbeat_age_seconds", [name], seen["age"])
            out.add("fair_jobs_worker_processes", [name], seen["processes"])
            out.add("fair_jobs_worker_alive", [name], 1 if seen["alive"] else 0)
        out.add("fair_jobs_workers_alive", [], sum(1 for s in by_name.values() if s["alive"]))


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else round(max((now - then).total_seconds(), 0.0), 1)


_view_registry = CollectorRegistry(auto_describe=False)
_view_registry.register(FairJobsCollector())

_registered: weakref.WeakKeyDictionary[CollectorRegistry, FairJobsCollector] = (
    weakref.WeakKeyDictionary()
)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The metrics in Prometheus' text format, from a private registry that holds only
    :class:`FairJobsCollector` (no process metrics).

    No access control: wrap it (``staff_member_required``) or serve it where only the
    Prometheus server can reach it."""
    return HttpResponse(generate_latest(_view_registry), content_type=CONTENT_TYPE_LATEST)


def register(registry: CollectorRegistry = REGISTRY) -> FairJobsCollector:
    """Add a :class:`FairJobsCollector` to ``registry`` (default: ``prometheus_client``'s
    default registry) and return it. Calling it again for the same registry returns the
    collector already added."""
    collector = _registered.get(registry)
    if collector is None:
        collector = FairJobsCollector()
        registry.register(collector)
        _registered[registry] = collector
    return collector

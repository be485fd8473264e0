"""The Prometheus exporter: real rows in, the exposition parsed back out."""

from __future__ import annotations

import builtins
import importlib
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.models import User
from django.db import OperationalError, connections
from django.test import Client, RequestFactory, override_settings
from django.urls import path
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from django_fair_jobs import identity, metrics
from django_fair_jobs.db import database_now
from django_fair_jobs.metrics import (
    METRICS,
    FairJobsCollector,
    metrics_view,
    tenant_label,
)
from django_fair_jobs.models import (
    JobDecision,
    Maintenance,
    ParkedJob,
    PlannedJob,
    PlannerRun,
    PlannerTenant,
    QueueLimit,
    RerouteCount,
    TenantQueueSlot,
    WorkerProcess,
)
from django_fair_jobs.queue_limits import set_limits
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.slots import store as slot_store

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent

# The URLconf of the view tests (override_settings(ROOT_URLCONF=__name__)).
urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view),
    path("staff-metrics", staff_member_required(metrics_view)),
]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition: {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape() -> Samples:
    registry = CollectorRegistry()
    registry.register(FairJobsCollector())
    return parse(generate_latest(registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def named(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def acquire(process: uuid.UUID, task_id: str, tenant: str = "acme", limit: int = 1) -> Any:
    return slot_store.try_acquire(
        tenant=tenant, queue="q", task_id=task_id, limit=limit, process_id=process, timeout=60
    ).grant


def plan(tenant: str, task_id: str, waited: float, task: str = "app.report") -> None:
    PlannedJob.objects.create(
        task_name=task, tenant=tenant, queue="q", task_id=task_id, signature="{}",
        enqueued_at=database_now() - timedelta(seconds=waited),
    )  # fmt: skip


def test_tenant_running_and_limit__per_slot(process: uuid.UUID) -> None:
    assert acquire(process, "j1", limit=3) is not None
    assert acquire(process, "j2", limit=3) is not None
    assert acquire(process, "j3", tenant="beta", limit=1) is not None
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_running", tenant="acme", queue="q") == 2
    assert value(samples, "fair_jobs_tenant_max_jobs", tenant="acme", queue="q") == 3
    assert value(samples, "fair_jobs_tenant_running", tenant="beta", queue="q") == 1
    assert value(samples, "fair_jobs_tenant_max_jobs", tenant="beta", queue="q") == 1
    assert value(samples, "fair_jobs_tenant_parked", tenant="acme") == 0
    assert value(samples, "fair_jobs_up") == 1


def test_parked_job__tenant_parked_wait_and_deferral_counter(process: uuid.UUID) -> None:
    acquire(process, "j1")
    outcome = slot_store.try_park(
        tenant="acme", queue="q", task_id="j2", task_name="t", limit=1, signature="{}"
    )
    assert outcome == "parked"
    ParkedJob.objects.filter(task_id="j2").update(parked_at=database_now() - timedelta(seconds=120))
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_parked", tenant="acme") == 1
    wait = value(samples, "fair_jobs_tenant_oldest_wait_seconds", tenant="acme")
    assert wait is not None
    assert 119 <= wait < 150
    assert value(samples, "fair_jobs_tenant_deferrals_total", tenant="acme", queue="q") == 1


def test_deferral_counter__stays_when_the_slot_is_idle(process: uuid.UUID) -> None:
    TenantQueueSlot.objects.create(tenant="idle", queue="q", deferred_total=7)
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_deferrals_total", tenant="idle", queue="q") == 7
    # Not active: no gauges for it.
    assert value(samples, "fair_jobs_tenant_running", tenant="idle", queue="q") is None


def test_tenant_without_wait__no_oldest_wait_sample(process: uuid.UUID) -> None:
    acquire(process, "j1")
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_oldest_wait_seconds", tenant="acme") is None


def test_fairness_index__jain_of_the_small_tenants_waits() -> None:
    plan("a", "a1", waited=1000)
    plan("b", "b1", waited=3000)
    samples = scrape()
    # (1000 + 3000)^2 / (2 * (1000^2 + 3000^2)) = 0.8
    assert value(samples, "fair_jobs_fairness_index") == pytest.approx(0.8, abs=0.002)
    assert value(samples, "fair_jobs_fairness_small_tenants") == 2
    assert value(samples, "fair_jobs_tenant_pending", tenant="a") == 1
    waited = value(samples, "fair_jobs_tenant_oldest_wait_seconds", tenant="b")
    assert waited == pytest.approx(3000, abs=30)


def test_tenant_pending__a_failed_planned_job_is_not_waiting() -> None:
    # A planned job whose publish failed for good stays unpromoted; it waits for no one
    # (the planner skips it), so it is neither pending nor the tenant's oldest wait, as
    # the planner's own gauges and the admin count it.
    plan("acme", "p1", waited=50)
    plan("acme", "p2", waited=3000)
    PlannedJob.objects.filter(task_id="p2").update(failed_at=database_now())
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_pending", tenant="acme") == 1
    waited = value(samples, "fair_jobs_tenant_oldest_wait_seconds", tenant="acme")
    assert waited == pytest.approx(50, abs=30)
    labels = {"task": "app.report", "tenant": "acme"}
    assert value(samples, "fair_jobs_planner_pending", **labels) == 1


def test_fairness_index__absent_when_no_tenant_is_active() -> None:
    samples = scrape()
    assert value(samples, "fair_jobs_fairness_index") is None
    assert value(samples, "fair_jobs_fairness_small_tenants") == 0
    assert value(samples, "fair_jobs_up") == 1


def test_reroutes__counter_per_tenant_task_and_queue() -> None:
    RerouteCount.objects.create(tenant="acme", task_name="app.sync", queue="slow", total=5)
    RerouteCount.objects.create(tenant="beta", task_name="app.sync", queue="slow", total=2)
    samples = scrape()
    assert (
        value(samples, "fair_jobs_reroutes_total", tenant="acme", task="app.sync", queue="slow")
        == 5
    )
    assert (
        value(samples, "fair_jobs_reroutes_total", tenant="beta", task="app.sync", queue="slow")
        == 2
    )


def test_queue_limits__running_limit_paused_parked_deferrals(process: uuid.UUID) -> None:
    set_limits("q", max_jobs=2)
    set_limits("stopped", max_jobs_per_worker=0)
    node_id = WorkerProcess.objects.get().node_id
    held = queue_store.try_acquire(
        queue="q", tenant=None, limit=1, task_id="j1", process_id=process, node_id=node_id
    )
    assert held.status == "held"
    QueueLimit.objects.filter(queue="q").update(deferred_total=4)
    samples = scrape()
    assert value(samples, "fair_jobs_queue_max_jobs", queue="q") == 2
    assert value(samples, "fair_jobs_queue_max_jobs_per_worker", queue="q") is None
    assert value(samples, "fair_jobs_queue_running", queue="q") == 1
    assert value(samples, "fair_jobs_queue_node_running", queue="q", node="n@h") == 1
    assert value(samples, "fair_jobs_queue_paused", queue="q") == 0
    assert value(samples, "fair_jobs_queue_parked", queue="q") == 0
    assert value(samples, "fair_jobs_queue_oldest_parked_seconds", queue="q") is None
    assert value(samples, "fair_jobs_queue_deferrals_total", queue="q") == 4
    assert value(samples, "fair_jobs_queue_max_jobs", queue="stopped") is None
    assert value(samples, "fair_jobs_queue_max_jobs_per_worker", queue="stopped") == 0
    assert value(samples, "fair_jobs_queue_paused", queue="stopped") == 1


def test_renamed_gauges__only_the_max_jobs_names(process: uuid.UUID) -> None:
    # One name per concept: the limits' gauges are named max_jobs, with no old twin.
    assert acquire(process, "j1", tenant="acme", limit=3) is not None
    set_limits("q", max_jobs=2, max_jobs_per_worker=1)
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_max_jobs", tenant="acme", queue="q") == 3
    assert value(samples, "fair_jobs_queue_max_jobs", queue="q") == 2
    old = ("fair_jobs_tenant_limit", "fair_jobs_queue_limit", "fair_jobs_queue_limit_per_worker")
    assert not [name for (name, _) in samples if name in old]
    assert not [spec.name for spec in METRICS if spec.name in old]


def test_queue_line__parked_and_oldest(process: uuid.UUID) -> None:
    set_limits("q", max_jobs=0)
    node_id = WorkerProcess.objects.get().node_id
    outcome = queue_store.try_park(
        queue="q", tenant=None, limit=1, task_id="j1", task_name="t", signature="{}",
        node_id=node_id,
    )  # fmt: skip
    assert outcome == "parked"
    ParkedJob.objects.update(parked_at=database_now() - timedelta(seconds=60))
    samples = scrape()
    assert value(samples, "fair_jobs_queue_parked", queue="q") == 1
    oldest = value(samples, "fair_jobs_queue_oldest_parked_seconds", queue="q")
    assert oldest == pytest.approx(60, abs=30)
    assert value(samples, "fair_jobs_queue_deferrals_total", queue="q") == 1


def test_planner__pending_promoted_runs() -> None:
    plan("acme", "p1", waited=50)
    plan("acme", "p2", waited=10)
    PlannedJob.objects.create(
        task_name="app.report", tenant="acme", queue="q", task_id="p3", signature="{}",
        promoted_at=database_now(),
    )  # fmt: skip
    PlannerTenant.objects.create(task_name="app.report", tenant="acme", promoted_total=9)
    PlannerTenant.objects.create(task_name="app.report", tenant="held", paused=True)
    PlannerRun.objects.create(
        task_name="app.report", runs_total=3, last_run_at=database_now() - timedelta(seconds=20),
        last_promoted=4, last_latency=1.5, last_skipped=True,
    )  # fmt: skip
    samples = scrape()
    labels = {"task": "app.report", "tenant": "acme"}
    assert value(samples, "fair_jobs_planner_pending", **labels) == 2
    oldest = value(samples, "fair_jobs_planner_oldest_pending_seconds", **labels)
    assert oldest == pytest.approx(50, abs=30)
    assert value(samples, "fair_jobs_planner_promoted_not_started", **labels) == 1
    assert value(samples, "fair_jobs_planner_promoted_total", **labels) == 9
    assert value(samples, "fair_jobs_planner_tenant_paused", **labels) is None
    assert value(samples, "fair_jobs_planner_tenant_paused", task="app.report", tenant="held") == 1
    assert value(samples, "fair_jobs_planner_runs_total", task="app.report") == 3
    assert value(samples, "fair_jobs_planner_last_promoted", task="app.report") == 4
    assert value(samples, "fair_jobs_planner_last_latency_seconds", task="app.report") == 1.5
    assert value(samples, "fair_jobs_planner_last_run_skipped", task="app.report") == 1
    age = value(samples, "fair_jobs_planner_last_run_age_seconds", task="app.report")
    assert age == pytest.approx(20, abs=30)


def test_planner_never_run__no_last_run_samples() -> None:
    PlannerRun.objects.create(task_name="app.report")
    samples = scrape()
    assert value(samples, "fair_jobs_planner_runs_total", task="app.report") == 0
    for name in ("last_run_age_seconds", "last_promoted", "last_latency_seconds"):
        assert value(samples, f"fair_jobs_planner_{name}", task="app.report") is None


def test_workers__heartbeat_age_alive_and_count() -> None:
    identity.register_process(process_id=uuid.uuid4(), node="w1@h", hostname="h", pid=1)
    stale = uuid.uuid4()
    identity.register_process(process_id=stale, node="w2@h", hostname="h", pid=2)
    WorkerProcess.objects.filter(pk=stale).update(
        last_heartbeat_at=database_now() - timedelta(seconds=100)
    )
    samples = scrape()
    fresh_age = value(samples, "fair_jobs_worker_heartbeat_age_seconds", node="w1@h")
    assert fresh_age is not None
    assert fresh_age < 3
    stale_age = value(samples, "fair_jobs_worker_heartbeat_age_seconds", node="w2@h")
    assert stale_age == pytest.approx(100, abs=5)
    assert value(samples, "fair_jobs_worker_alive", node="w1@h") == 1
    assert value(samples, "fair_jobs_worker_alive", node="w2@h") == 0
    assert value(samples, "fair_jobs_worker_processes", node="w1@h") == 1
    assert value(samples, "fair_jobs_workers_alive") == 1


def test_workers__restarted_node_is_one_series() -> None:
    old, new = uuid.uuid4(), uuid.uuid4()
    identity.register_process(process_id=old, node="w1@h", hostname="h", pid=1)
    identity.register_process(process_id=new, node="w1@h", hostname="h", pid=2)
    WorkerProcess.objects.filter(pk=old).update(
        last_heartbeat_at=database_now() - timedelta(seconds=100)
    )
    samples = scrape()
    assert len(named(samples, "fair_jobs_worker_heartbeat_age_seconds")) == 1
    age = value(samples, "fair_jobs_worker_heartbeat_age_seconds", node="w1@h")
    assert age is not None
    assert age < 3
    assert value(samples, "fair_jobs_worker_processes", node="w1@h") == 2
    assert value(samples, "fair_jobs_workers_alive") == 1


def test_leases_reaped__counter() -> None:
    Maintenance.objects.create(name="reaped", leases_reaped_total=4)
    assert value(scrape(), "fair_jobs_leases_reaped_total") == 4


def test_enforce__1_by_default_0_in_shadow_mode() -> None:
    assert value(scrape(), "fair_jobs_enforce") == 1
    with override_settings(FAIR_JOBS_ENFORCE=False):
        assert value(scrape(), "fair_jobs_enforce") == 0


def test_decisions_last_hour__by_mechanism_action_and_mode() -> None:
    for n in range(3):
        JobDecision.objects.create(
            task_id=f"s{n}", task_name="t", tenant="acme", queue="q", mechanism="slots",
            action="defer", enforced=False,
        )  # fmt: skip
    JobDecision.objects.create(
        task_id="r1", task_name="t", tenant="acme", queue="slow", mechanism="reroute",
        action="rerouted", enforced=True,
    )  # fmt: skip
    old = JobDecision.objects.create(
        task_id="o1", task_name="t", tenant="acme", queue="q", mechanism="slots",
        action="defer", enforced=False,
    )  # fmt: skip
    JobDecision.objects.filter(pk=old.pk).update(at=database_now() - timedelta(hours=2))
    samples = scrape()
    name = "fair_jobs_decisions_last_hour"
    assert value(samples, name, mechanism="slots", action="defer", enforced="false") == 3
    assert value(samples, name, mechanism="reroute", action="rerouted", enforced="true") == 1
    assert len(named(samples, name)) == 2


def test_tenant_label__truncated_to_100_characters_and_distinct(process: uuid.UUID) -> None:
    first, second = "x" * 200 + "1", "x" * 200 + "2"
    acquire(process, "j1", tenant=first)
    acquire(process, "j2", tenant=second)
    running = named(scrape(), "fair_jobs_tenant_running")
    tenants = sorted(dict(labels)["tenant"] for labels in running)
    assert len(tenants) == 2
    assert tenants == sorted([tenant_label(first), tenant_label(second)])
    assert all(len(t) == 100 and t.startswith("x" * 91 + "~") for t in tenants)
    assert tenant_label("acme") == "acme"
    assert tenant_label("y" * 100) == "y" * 100


def test_collector__reads_the_rows_at_every_scrape(process: uuid.UUID) -> None:
    collector = FairJobsCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    grant = acquire(process, "j1", limit=2)
    assert registry.get_sample_value("fair_jobs_tenant_running", {"tenant": "acme", "queue": "q"})
    acquire(process, "j2", limit=2)
    assert (
        registry.get_sample_value("fair_jobs_tenant_running", {"tenant": "acme", "queue": "q"}) == 2
    )
    slot_store.release(grant)
    assert (
        registry.get_sample_value("fair_jobs_tenant_running", {"tenant": "acme", "queue": "q"}) == 1
    )


def test_collector__database_error__answers_up_0(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**options: Any) -> dict[str, Any]:
        raise OperationalError("database is gone")

    monkeypatch.setattr("django_fair_jobs.status.snapshot", broken)
    samples = scrape()
    assert value(samples, "fair_jobs_up") == 0
    assert {name for name, _ in samples} == {"fair_jobs_up", "fair_jobs_scrape_duration_seconds"}


def test_collector__closes_a_connection_it_opened_outside_requests(process: uuid.UUID) -> None:
    acquire(process, "j1")
    registry = CollectorRegistry()
    registry.register(FairJobsCollector())
    seen: dict[str, Any] = {}

    def scrape_in_thread() -> None:
        try:
            seen["running"] = registry.get_sample_value(
                "fair_jobs_tenant_running", {"tenant": "acme", "queue": "q"}
            )
            seen["left_open"] = connections["default"].connection is not None
        finally:
            connections.close_all()

    thread = threading.Thread(target=scrape_in_thread)
    thread.start()
    thread.join(30)
    assert seen == {"running": 1, "left_open": False}


def test_describe__lists_every_metric_without_reading_the_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unexpected() -> dict[str, Any]:
        raise AssertionError("describe read the database")

    monkeypatch.setattr("django_fair_jobs.status.snapshot", unexpected)
    names = [family.name for family in FairJobsCollector().describe()]
    assert names == [spec.name.removesuffix("_total") for spec in METRICS]
    registry = CollectorRegistry(auto_describe=True)
    registry.register(FairJobsCollector())  # no scrape at registration


def test_exposition__types_and_names() -> None:
    text = generate_latest(_registry_with_collector()).decode()
    assert "# TYPE fair_jobs_reroutes_total counter" in text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    for spec in METRICS:
        assert families[spec.name.removesuffix("_total")] == spec.kind
    assert all(spec.name.endswith("_total") == (spec.kind == "counter") for spec in METRICS)


def _registry_with_collector() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics.register(registry)
    return registry


def test_register__adds_the_collector_once() -> None:
    registry = CollectorRegistry()
    first = metrics.register(registry)
    assert metrics.register(registry) is first
    text = generate_latest(registry).decode()
    assert text.count("# TYPE fair_jobs_up gauge") == 1


def test_register__default_registry() -> None:
    from prometheus_client import REGISTRY

    collector = metrics.register()
    try:
        assert REGISTRY.get_sample_value("fair_jobs_up") == 1
    finally:
        REGISTRY.unregister(collector)
        metrics._registered.pop(REGISTRY, None)


def test_view__request_factory(process: uuid.UUID) -> None:
    acquire(process, "j1")
    response = metrics_view(RequestFactory().get("/metrics"))
    assert response.status_code == 200
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    samples = parse(response.content.decode())
    assert value(samples, "fair_jobs_tenant_running", tenant="acme", queue="q") == 1
    # Only the collector: no process or platform metrics of the default registry.
    assert all(name.startswith("fair_jobs_") for name, _ in samples)


@override_settings(ROOT_URLCONF=__name__)
def test_view__staff_member_required(client: Client, process: uuid.UUID) -> None:
    acquire(process, "j1")
    anonymous = client.get("/staff-metrics")
    assert anonymous.status_code == 302
    assert "/admin/login/" in anonymous["Location"]
    client.force_login(User.objects.create_user("ops", password="pw", is_staff=True))
    response = client.get("/staff-metrics")
    assert response.status_code == 200
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    samples = parse(response.content.decode())
    assert value(samples, "fair_jobs_tenant_max_jobs", tenant="acme", queue="q") == 1


@override_settings(ROOT_URLCONF=__name__)
def test_view__plain_route(client: Client) -> None:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert value(parse(response.content.decode()), "fair_jobs_up") == 1


def test_import__without_prometheus_client__says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_import = builtins.__import__

    def no_prometheus(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    monkeypatch.delitem(sys.modules, "django_fair_jobs.metrics")
    with pytest.raises(ImportError, match=r"metrics extra.*pip install prometheus-client"):
        importlib.import_module("django_fair_jobs.metrics")


def test_docs__list_every_metric() -> None:
    doc = (ROOT / "docs/metrics.md").read_text()
    for spec in METRICS:
        assert f"`{spec.name}`" in doc, spec.name


def test_tenant_gauges__the_busiest_tenants_only__the_rest_counted(
    process: uuid.UUID, settings: Any
) -> None:
    settings.FAIR_JOBS_METRICS_TENANTS = 1
    assert acquire(process, "j1", tenant="calm", limit=1) is not None
    assert acquire(process, "j2", tenant="busy", limit=1) is not None
    slot_store.try_park(
        tenant="busy", queue="q", task_id="j3", task_name="t", limit=1, signature="{}"
    )
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_parked", tenant="busy") == 1
    assert value(samples, "fair_jobs_tenant_running", tenant="calm", queue="q") is None
    assert value(samples, "fair_jobs_tenants_omitted") == 1
    settings.FAIR_JOBS_METRICS_TENANTS = 1000
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_running", tenant="calm", queue="q") == 1
    assert value(samples, "fair_jobs_tenants_omitted") == 0

"""The library at scale, asserted as behaviour, never as time: the admin's list pages send
the same queries whatever the rows, show at most a page, and count and filter with bounded
reads; pruning leaves a bounded number of window rows whatever the idle data; and the
``bench_load`` command measures every operation, small against large."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib import admin as django_admin
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_fair_jobs import admin as fair_admin
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.dispatch.models import DispatchJob, DispatchTenant
from django_fair_jobs.models import (
    JobDecision,
    LimitChange,
    ParkedJob,
    PlannedJob,
    PlannerTenant,
    QueueLimit,
    RerouteCount,
    SlotLease,
    TenantQueueSlot,
    TenantWindow,
    WindowBucket,
    WorkerProcess,
)
from django_fair_jobs.reroute import prune
from django_fair_jobs.reroute import store as reroute_store
from tests.test_example_project import run_manage

LIST_PAGES = [
    f"/admin/fair_jobs/{model._meta.model_name}/"
    for model in django_admin.site._registry
    if model._meta.app_label == "fair_jobs"
]


def _fill(first: int, n: int) -> None:
    """``n`` more rows in every table an admin page lists (tenants ``first`` on), shaped as
    the library writes them: slots with a running job and parked jobs, windows, planned
    jobs, planner tenants, reroute counts, decisions, limit changes and queue limits."""
    tenants = [f"t{i:06d}" for i in range(first, first + n)]
    process = WorkerProcess.objects.filter(node="load@test").first()
    if process is None:
        process = WorkerProcess.objects.create(node="load@test", hostname="test", pid=1)
    slots = TenantQueueSlot.objects.bulk_create(
        [TenantQueueSlot(tenant=t, queue="load", current_jobs=1, parked_jobs=1) for t in tenants]
    )
    SlotLease.objects.bulk_create(
        [SlotLease(slot=s, task_id=f"run-{s.tenant}", process=process) for s in slots]
    )
    ParkedJob.objects.bulk_create(
        [ParkedJob(slot=s, task_id=f"park-{s.tenant}", task_name=f"load.task{i % 3}",
                   signature="{}", default_max_jobs=1) for i, s in enumerate(slots)]
    )  # fmt: skip
    second = reroute_store.database_second()
    windows = TenantWindow.objects.bulk_create(
        [TenantWindow(key="task:load", tenant=t, total=3, last_second=second) for t in tenants]
    )
    WindowBucket.objects.bulk_create(
        [WindowBucket(window=w, second=second - j, cum=3 - j) for w in windows for j in range(3)]
    )
    RerouteCount.objects.bulk_create(
        [RerouteCount(tenant=t, task_name="load.task", queue="load.slow") for t in tenants]
    )
    PlannedJob.objects.bulk_create(
        [PlannedJob(task_name="load.planned", tenant=t, queue=f"load{i % 2}",
                    task_id=f"plan-{t}", signature="{}") for i, t in enumerate(tenants)]
    )  # fmt: skip
    PlannerTenant.objects.bulk_create(
        [PlannerTenant(task_name="load.planned", tenant=t) for t in tenants]
    )
    DispatchTenant.objects.bulk_create([DispatchTenant(queue="load", tenant=t) for t in tenants])
    DispatchJob.objects.bulk_create(
        [DispatchJob(queue="load", tenant=t, task_name="load.task", task_id=f"disp-{t}",
                     message="{}") for t in tenants]
    )  # fmt: skip
    JobDecision.objects.bulk_create(
        [JobDecision(task_id=f"park-{t}", task_name="load.task", tenant=t, queue="load",
                     mechanism="slots", action="defer", enforced=False) for t in tenants]
    )  # fmt: skip
    LimitChange.objects.bulk_create(
        [LimitChange(source="command", tenant=t, queue="load", field="max_jobs", new_value="1")
         for t in tenants]
    )  # fmt: skip
    QueueLimit.objects.bulk_create([QueueLimit(queue=f"load.{t}", max_jobs=2) for t in tenants])
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")  # as autovacuum would: the planner knows the sizes


def _page(client: Client, url: str) -> tuple[list[str], int, int]:
    """Render ``url``; return its SQL, the rows it shows and its page size."""
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    assert response.status_code == 200, url
    context: Any = response.context_data
    if "cl" in context:
        shown, per_page = len(context["cl"].result_list), context["cl"].list_per_page
    else:  # the dashboard: its busiest tenants
        shown, per_page = len(context["tenants"]), fair_admin.DASHBOARD_TENANTS
    return [q["sql"] for q in queries.captured_queries], shown, per_page


BIG_TABLES = ("parkedjob", "plannedjob", "jobdecision", "tenantqueueslot", "tenantwindow",
              "plannertenant", "reroutecount", "limitchange")  # fmt: skip


def _unbounded(sql: str) -> bool:
    """A read of a whole large table: a count or a DISTINCT with no LIMIT. The limit
    history keeps its date drill-down: it grows with operators' changes, not with jobs."""
    table = re.search(r'FROM "fair_jobs_(\w+)"', sql)
    if table is None or table.group(1) not in BIG_TABLES or "LIMIT" in sql:
        return False
    if table.group(1) == "limitchange" and "TRUNC(" in sql.upper():
        return False
    return "COUNT(" in sql.upper().split("FROM", 1)[0] or sql.startswith("SELECT DISTINCT")


@pytest.mark.django_db
def test_list_pages__same_queries_at_10x_the_rows_one_page_shown_and_bounded_reads(
    admin_client: Client,
) -> None:
    _fill(0, 120)
    small = {url: _page(admin_client, url) for url in LIST_PAGES}
    _fill(120, 1080)
    large = {url: _page(admin_client, url) for url in LIST_PAGES}
    assert len(LIST_PAGES) >= 11
    for url in LIST_PAGES:
        (sql_small, _, _), (sql_large, shown, per_page) = small[url], large[url]
        assert len(sql_large) == len(sql_small), (url, sql_small, sql_large)
        assert 0 < shown <= per_page, (url, shown, per_page)
        if "dashboard" not in url:  # the dashboard is the status snapshot, not a list
            assert not [q for q in sql_large if _unbounded(q)], url


@pytest.mark.django_db
def test_planner_tenants_page__shows_each_tenants_pending_jobs(admin_client: Client) -> None:
    PlannerTenant.objects.create(task_name="load.planned", tenant="busy")
    PlannerTenant.objects.create(task_name="load.planned", tenant="idle")
    PlannedJob.objects.bulk_create(
        [PlannedJob(task_name="load.planned", tenant="busy", queue="q", task_id=f"b{i}",
                    signature="{}") for i in range(3)]
    )  # fmt: skip
    PlannedJob.objects.filter(task_id="b0").update(promoted_at=timezone.now())  # not pending
    context: Any = admin_client.get("/admin/fair_jobs/plannertenant/").context_data
    rows = {row.tenant: row for row in context["cl"].result_list}
    model_admin = django_admin.site._registry[PlannerTenant]
    assert model_admin.pending(rows["busy"]) == 2  # type: ignore[attr-defined]
    assert model_admin.pending(rows["idle"]) == 0  # type: ignore[attr-defined]
    assert model_admin.oldest_pending(rows["idle"]) == "-"  # type: ignore[attr-defined]
    assert float(model_admin.oldest_pending(rows["busy"])) >= 0  # type: ignore[attr-defined]


@pytest.mark.django_db
def test_paginator__exact_up_to_the_limit_then_an_estimate_on_postgresql(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fair_admin.base, "EXACT_COUNT_LIMIT", 50)
    _fill(0, 40)
    assert fair_admin.EstimatedCountPaginator(ParkedJob.objects.order_by("id"), 10).count == 40
    _fill(40, 80)
    count = fair_admin.EstimatedCountPaginator(ParkedJob.objects.order_by("id"), 10).count
    if connection.vendor == "postgresql":
        # The planner's estimate after ANALYZE: past the limit, never below what was seen.
        assert 51 <= count <= 240
    else:
        assert count == 120  # SQLite (development) counts exactly


@pytest.mark.django_db
def test_recent_values_filter__offers_the_newest_rows_values_and_the_selected_one(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fair_admin.base, "RECENT_ROWS", 5)
    for i in range(10):
        JobDecision.objects.create(
            task_id=f"j{i}", task_name=f"old{i}" if i < 5 else "new", queue="q",
            mechanism="slots", action="defer", enforced=False,
        )  # fmt: skip

    def offered(url: str) -> set[str]:
        context: Any = admin_client.get(url).context_data
        spec = next(
            f for f in context["cl"].filter_specs if getattr(f, "lookup_kwarg", "") == "task_name"
        )
        return {str(v) for v in spec.lookup_choices}

    assert offered("/admin/fair_jobs/jobdecision/") == {"new"}
    assert offered("/admin/fair_jobs/jobdecision/?task_name=old1") == {"new", "old1"}


def _windows(active: int, idle: int, buckets: int) -> None:
    """``active`` windows with ``buckets`` buckets spread over twice the maximum window,
    and ``idle`` windows whose last enqueue is older than the maximum window."""
    now = reroute_store.database_second()
    span = 2 * fair_settings.REROUTE_MAX_WINDOW
    rows = [TenantWindow(key="task:load", tenant=f"a{i}", total=buckets, last_second=now - 1)
            for i in range(active)]  # fmt: skip
    rows += [TenantWindow(key="task:load", tenant=f"i{i}", total=buckets,
                          last_second=now - span) for i in range(idle)]  # fmt: skip
    windows = TenantWindow.objects.bulk_create(rows)
    WindowBucket.objects.bulk_create(
        [WindowBucket(window=w, second=w.last_second - (buckets - j) * (span // buckets),
                      cum=j) for w in windows for j in range(1, buckets + 1)]
    )  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize("idle", [10, 200])
def test_prune__leaves_the_same_bounded_rows_whatever_the_idle_data(idle: int) -> None:
    _windows(active=5, idle=idle, buckets=20)
    assert WindowBucket.objects.count() == (5 + idle) * 20
    prune()
    # Idle tenants leave nothing; active windows keep the buckets inside the maximum window
    # (half of them here) plus one anchor before it.
    assert set(TenantWindow.objects.values_list("tenant", flat=True)) == {f"a{i}" for i in range(5)}
    assert WindowBucket.objects.count() == 5 * (10 + 1)
    prune()
    assert WindowBucket.objects.count() == 5 * (10 + 1)


@pytest.mark.django_db(transaction=True)
def test_bench_load__tiny_run_reports_every_operation_with_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    result = run_manage(
        tmp_path, "bench_load", "--tenants", "30", "--window-rows", "600", "--jobs", "200",
        "--repeat", "3", "--batch", "10", "--json", str(out),
    )  # fmt: skip
    if connection.vendor != "postgresql":
        # It fills the tables with PostgreSQL's generate_series; elsewhere it must say so.
        assert result.returncode != 0
        assert "needs PostgreSQL" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    figures = {f["operation"]: f for f in data["figures"]}
    expected: list[Callable[[str], bool]] = [
        lambda n: n.startswith("acquire + release"),
        lambda n: n.startswith("park + wake"),
        lambda n: n.startswith("enqueue with 2 rerouting rules"),
        lambda n: n.startswith("planned enqueue"),
        lambda n: n.startswith("planner run promoting 10 jobs"),
        lambda n: n.startswith("maintenance pass"),
        lambda n: n.startswith("prune idle windows"),
    ]
    for matches in expected:
        assert [n for n in figures if matches(n)], sorted(figures)
    pages = [f for n, f in figures.items() if n.startswith("admin: ")]
    assert len(pages) == len(LIST_PAGES)
    for figure in figures.values():
        assert figure["ratio"] > 0 and f"| {figure['operation']} |" in result.stdout
    for page in pages:
        for case in ("small_page", "large_page"):
            assert 0 < page[case]["rows_shown"] <= page[case]["per_page"], page
            assert page[case]["queries"] > 0
    assert data["rows"]["large"]["windowbucket"] == 600
    assert data["rows"]["large"]["parkedjob"] == data["rows"]["large"]["plannedjob"] == 200
    # Pruning removed the idle windows: what is left is bounded by the active ones.
    large = data["prune"]["large"]
    assert large["windows_after"] == 3 and large["buckets_after"] < large["buckets_before"]
    assert large["pruned_again"] == 0
    assert not TenantQueueSlot.objects.exists() and not User.objects.exists()
    assert "Admin pages over list_per_page: none." in result.stdout

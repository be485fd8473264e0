"""The admin pages of what the mechanisms counted and decided: rerouting windows and
counts, the planner's virtual queues and tenants, the limit history, recorded decisions,
and the dashboard."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from django_fair_jobs import db
from django_fair_jobs.admin.base import (
    EstimatedCountPaginator,
    RecentValuesFilter,
    _ChangeAdmin,
    _DashboardAdmin,
    _DecisionAdmin,
    _PlannedAdmin,
    _PlannerTenantAdmin,
    _ReadOnly,
    _RerouteAdmin,
    _WindowAdmin,
)
from django_fair_jobs.models import (
    Dashboard,
    JobDecision,
    LimitChange,
    PlannedJob,
    PlannerTenant,
    RerouteCount,
    TenantWindow,
)
from django_fair_jobs.planner import store as planner_store
from django_fair_jobs.reroute import store as reroute_store


@admin.register(TenantWindow)
class TenantWindowAdmin(_ReadOnly, _WindowAdmin):
    """Each tenant's enqueue counts, now, in every window its rules count over."""

    list_display = ("tenant", "key", "window_counts", "total", "last_enqueue")
    list_filter = (("key", RecentValuesFilter),)
    search_fields = ("tenant",)
    ordering = ("tenant", "key")
    # One row per tenant and key: bounded counts and filters (see the classes).
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    actions = ("reset_windows",)

    def has_reset_permission(self, request: HttpRequest) -> bool:
        """Resetting a window changes routing: it needs the change permission, which the
        page itself never uses (rows are written by the library only)."""
        return bool(request.user.has_perm("fair_jobs.change_tenantwindow"))

    @admin.action(
        description="Reset the selected windows (counts start again from zero)",
        permissions=["reset"],
    )
    def reset_windows(self, request: HttpRequest, queryset: QuerySet[TenantWindow]) -> None:
        count = reroute_store.reset(list(queryset.values_list("pk", flat=True)))
        self.message_user(
            request, f"Reset {count} window(s); those tenants' next jobs use their normal queue."
        )

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        from django_fair_jobs.reroute import windows_by_key

        # Computed once per page: which windows each key's rules count over, and when.
        self._windows = windows_by_key()
        self._now = reroute_store.database_second()
        return super().changelist_view(request, extra_context)

    @admin.display(description="enqueues in window (now)")
    def window_counts(self, obj: TenantWindow) -> str:
        pers = getattr(self, "_windows", {}).get(obj.key) or []
        if not pers:
            return "no task counts under this key now"
        counts = reroute_store.current_counts(obj, pers, getattr(self, "_now", None))
        return ", ".join(f"{n} in {per} s" for per, n in zip(pers, counts, strict=True))

    @admin.display(description="last enqueue (UTC)", ordering="last_second")
    def last_enqueue(self, obj: TenantWindow) -> str:
        from datetime import UTC, datetime

        return datetime.fromtimestamp(obj.last_second, UTC).strftime("%Y-%m-%d %H:%M:%S")


@admin.register(RerouteCount)
class RerouteCountAdmin(_ReadOnly, _RerouteAdmin):
    """How many jobs were rerouted, per tenant, task and destination queue."""

    list_display = ("tenant", "task_name", "queue", "total", "first_at", "last_at")
    list_filter = (("queue", RecentValuesFilter), ("task_name", RecentValuesFilter))
    search_fields = ("tenant",)
    ordering = ("-last_at",)
    # One row per tenant, task and queue: bounded counts and filters (see the classes).
    paginator = EstimatedCountPaginator
    show_full_result_count = False


class PlannedStateFilter(admin.SimpleListFilter):
    """A planned job's state: pending in its virtual queue, promoted and not started, or
    failed (its publish failed too often; never promoted again)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("pending", "pending"), ("promoted", "promoted"), ("failed", "failed")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "pending":
            return queryset.filter(promoted_at__isnull=True, failed_at__isnull=True)
        if value == "promoted":
            return queryset.filter(promoted_at__isnull=False)
        if value == "failed":
            return queryset.filter(failed_at__isnull=False)
        return queryset


@admin.register(PlannedJob)
class PlannedJobAdmin(_ReadOnly, _PlannedAdmin):
    """Jobs in the planners' virtual queues (not promoted yet), promoted ones that have
    not started, and failed ones, whose publish failed too often (read-only; revoke a job
    with Celery to drop it, or put a failed one back in line once its cause is removed)."""

    list_display = ("task_id", "task_name", "tenant", "queue", "enqueued_at", "promoted_at",
                    "attempts", "failed_at", "last_error")  # fmt: skip
    list_filter = (
        PlannedStateFilter,
        ("task_name", RecentValuesFilter),
        ("queue", RecentValuesFilter),
    )
    search_fields = ("task_id", "tenant")
    actions = ("put_back_failed",)
    ordering = ("id",)
    # A flood of 100,000 planned jobs: bounded counts and filters (see the classes).
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    def has_put_back_permission(self, request: HttpRequest) -> bool:
        """Putting a failed job back in line needs the change permission on planned jobs
        (the rows stay read-only otherwise)."""
        return bool(request.user.has_perm("fair_jobs.change_plannedjob"))

    @admin.action(description="Put the selected failed jobs back in line", permissions=["put_back"])
    def put_back_failed(self, request: HttpRequest, queryset: QuerySet[PlannedJob]) -> None:
        count = planner_store.put_back_failed(queryset)
        self.message_user(request, f"Put {count} failed job(s) back in line, in their old place.")


@admin.register(PlannerTenant)
class PlannerTenantAdmin(_PlannerTenantAdmin):
    """Each tenant's backlog in each planner: jobs pending and the oldest's age; pause or
    resume a tenant's promotion."""

    list_display = ("tenant", "task_name", "pending", "oldest_pending", "paused",
                    "promoted_total", "pass_value")  # fmt: skip
    list_filter = (("task_name", RecentValuesFilter), "paused")
    search_fields = ("tenant",)
    ordering = ("task_name", "tenant")
    fields = readonly_fields = ("task_name", "tenant", "paused", "promoted_total", "pass_value")
    actions = ("pause_promotion", "resume_promotion")
    # One row per tenant and planned task: bounded counts and filters (see the classes).
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[PlannerTenant]:
        from django.db.models import IntegerField, Min, OuterRef, Subquery
        from django.db.models.functions import Coalesce

        # The backlog of each tenant shown, read on its virtual queue's index, rather than
        # every tenant's (a scan of all planned jobs) at each page view.
        waiting = (
            PlannedJob.objects.filter(
                task_name=OuterRef("task_name"), tenant=OuterRef("tenant"),
                promoted_at__isnull=True, failed_at__isnull=True,
            )
            .order_by()
            .values("task_name")
        )  # fmt: skip
        return (
            super()
            .get_queryset(request)
            .annotate(
                pending_count=Coalesce(
                    Subquery(waiting.annotate(n=Count("pk")).values("n"),
                             output_field=IntegerField()),
                    0,
                ),
                oldest_pending_at=Subquery(waiting.annotate(m=Min("enqueued_at")).values("m")),
            )
        )  # fmt: skip

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:

        # Ages on the database clock, read once for the page.
        self._now = db.database_now()
        return super().changelist_view(request, extra_context)

    @admin.display(description="pending", ordering="pending_count")
    def pending(self, obj: PlannerTenant) -> int:
        return int(getattr(obj, "pending_count", 0))

    @admin.display(description="oldest pending (s)", ordering="oldest_pending_at")
    def oldest_pending(self, obj: PlannerTenant) -> str:
        oldest, now = getattr(obj, "oldest_pending_at", None), getattr(self, "_now", None)
        if oldest is None or now is None:
            return "-"
        return f"{round(max((now - oldest).total_seconds(), 0.0), 1):g}"

    @admin.action(description="Pause promotion of the selected tenants", permissions=["change"])
    def pause_promotion(self, request: HttpRequest, queryset: QuerySet[PlannerTenant]) -> None:
        count = queryset.update(paused=True)
        self.message_user(request, f"Paused {count} tenant(s); their jobs wait, none is lost.")

    @admin.action(description="Resume promotion of the selected tenants", permissions=["change"])
    def resume_promotion(self, request: HttpRequest, queryset: QuerySet[PlannerTenant]) -> None:
        count = queryset.update(paused=False)
        self.message_user(request, f"Resumed {count} tenant(s) from the next planner run.")


@admin.register(LimitChange)
class LimitChangeAdmin(_ReadOnly, _ChangeAdmin):
    """The history of limit changes: who changed which limit, when, from where."""

    list_display = ("at", "user", "source", "tenant", "queue", "field", "old_value",
                    "new_value", "note")  # fmt: skip
    list_filter = (("source", RecentValuesFilter), ("field", RecentValuesFilter),
                   ("queue", RecentValuesFilter))  # fmt: skip
    search_fields = ("tenant", "queue", "user")
    date_hierarchy = "at"
    ordering = ("-at", "-id")
    # One row per change, kept for ever: bounded counts and filters (see the classes).
    paginator = EstimatedCountPaginator
    show_full_result_count = False


@admin.register(JobDecision)
class JobDecisionAdmin(_ReadOnly, _DecisionAdmin):
    """What rules did (reroutes) or, in shadow mode, would have done to jobs; kept for
    ``FAIR_JOBS_DECISION_RETENTION``."""

    list_display = ("at", "task_id", "task_name", "tenant", "queue", "mechanism", "action",
                    "enforced")  # fmt: skip
    list_filter = (("mechanism", RecentValuesFilter), ("action", RecentValuesFilter),
                   "enforced", ("task_name", RecentValuesFilter))  # fmt: skip
    search_fields = ("task_id", "tenant")
    ordering = ("-at", "-id")
    # Shadow mode writes a row per job held back: bounded counts and filters (see the
    # classes), and no date drill-down, whose DISTINCT over the days reads every row (the
    # rows are kept for FAIR_JOBS_DECISION_RETENTION, a day by default, anyway).
    paginator = EstimatedCountPaginator
    show_full_result_count = False


DASHBOARD_TENANTS = 100
"""Tenants the dashboard lists, the longest-waiting first."""


@admin.register(Dashboard)
class DashboardAdmin(_ReadOnly, _DashboardAdmin):
    """The dashboard: per tenant, per queue and per worker node at a glance, reloading
    itself every ``FAIR_JOBS_DASHBOARD_REFRESH`` seconds. Needs the dashboard's view
    permission."""

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        from django.core.exceptions import PermissionDenied

        from django_fair_jobs.conf import fair_settings
        from django_fair_jobs.status import snapshot

        if not self.has_view_permission(request):
            raise PermissionDenied
        # The longest-waiting tenants only (then the most running): a page of 10,000 rows
        # helps nobody, and the slot list pages through the rest.
        snap = snapshot(first=DASHBOARD_TENANTS, rank="wait")
        context = {
            **self.admin_site.each_context(request),
            "title": "Fair jobs dashboard",
            "opts": self.model._meta,
            "snapshot": snap,
            "tenants": snap["tenants"],
            "tenants_hidden": snap["tenants_active"] - len(snap["tenants"]),
            "refresh": fair_settings.DASHBOARD_REFRESH,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/fair_jobs/dashboard.html", context)

"""The admin page of fair dispatch's lines: each tenant's jobs waiting and in flight on
each queue, its weight and cap; cancel a tenant's waiting jobs from here."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from django_fair_jobs import dispatch
from django_fair_jobs.admin.base import (
    EstimatedCountPaginator,
    RecentValuesFilter,
    _CancelsBacklog,
    _ReadOnly,
)
from django_fair_jobs.dispatch.models import DispatchJob, DispatchTenant


@admin.register(DispatchTenant)
class DispatchTenantAdmin(_CancelsBacklog, _ReadOnly, admin.ModelAdmin):  # type: ignore[type-arg]
    """Fair dispatch's lines, one row per tenant and queue (read-only: the library keeps
    them). The action cancels the selected tenants' waiting jobs on that queue."""

    list_display = ("tenant", "queue", "waiting", "in_flight", "cap", "blocked", "weight",
                    "dispatched_total")  # fmt: skip
    list_filter = (("queue", RecentValuesFilter),)
    search_fields = ("tenant",)
    ordering = ("-waiting", "tenant")
    list_per_page = 100
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    actions = ("cancel_backlog",)

    @admin.action(
        description="Cancel the selected tenants' waiting jobs on their queue",
        permissions=["cancel"],
    )
    def cancel_backlog(
        self, request: HttpRequest, queryset: QuerySet[DispatchTenant]
    ) -> TemplateResponse | None:
        return self._cancel_rows(request, [(r.tenant, r.queue, None) for r in queryset])


@admin.register(DispatchJob)
class DispatchJobAdmin(_ReadOnly, admin.ModelAdmin):  # type: ignore[type-arg]
    """Fair dispatch's jobs, from ``delay()`` to their end: scheduled, waiting, dispatched,
    running, and failed (their publish failed too often; read-only, and a failed job can be
    put back in line once its cause is removed)."""

    list_display = ("task_id", "task_name", "tenant", "queue", "state", "enqueued_at",
                    "publish_failures")  # fmt: skip
    list_filter = ("state", ("queue", RecentValuesFilter))
    search_fields = ("task_id", "tenant")
    ordering = ("id",)
    list_per_page = 100
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    actions = ("put_back_failed",)

    def has_retry_permission(self, request: HttpRequest) -> bool:
        """Putting a failed job back in line needs the change permission on its rows."""
        return bool(request.user.has_perm("fair_jobs.change_dispatchjob"))

    @admin.action(description="Put the selected failed jobs back in line", permissions=["retry"])
    def put_back_failed(self, request: HttpRequest, queryset: QuerySet[DispatchJob]) -> None:
        from celery import current_app

        count = dispatch.put_back_failed(current_app, list(queryset.values_list("pk", flat=True)))
        self.message_user(request, f"Put {count} failed job(s) back in line.")

"""The admin page of fair dispatch's lines: each tenant's jobs waiting and in flight on
each queue, its weight and cap; cancel a tenant's waiting jobs from here."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from django_fair_jobs.admin.base import (
    EstimatedCountPaginator,
    RecentValuesFilter,
    _CancelsBacklog,
    _ReadOnly,
)
from django_fair_jobs.dispatch.models import DispatchTenant


@admin.register(DispatchTenant)
class DispatchTenantAdmin(_CancelsBacklog, _ReadOnly, admin.ModelAdmin):  # type: ignore[type-arg]
    """Fair dispatch's lines, one row per tenant and queue (read-only: the library keeps
    them). The action cancels the selected tenants' waiting jobs on that queue."""

    list_display = ("tenant", "queue", "waiting", "in_flight", "cap", "weight",
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

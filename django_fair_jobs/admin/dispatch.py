"""The admin page of fair dispatch's lines: each tenant's jobs waiting and in flight on
each queue, its weight and cap; cancel a tenant's waiting jobs from here."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from django_fair_jobs import backlog, caps, dispatch
from django_fair_jobs.admin.base import (
    CANCEL_COUNTED,
    EstimatedCountPaginator,
    RecentValuesFilter,
    _CancelsBacklog,
    _cap_text,
    _ReadOnly,
    _user,
)
from django_fair_jobs.dispatch.models import FAILED, DispatchJob, DispatchTenant
from django_fair_jobs.models import QueueLimit, TenantQueueSlot


@admin.register(DispatchTenant)
class DispatchTenantAdmin(_CancelsBacklog, _ReadOnly, admin.ModelAdmin):  # type: ignore[type-arg]
    """Fair dispatch's lines, one row per tenant and queue (read-only: the library keeps
    them). The action cancels the selected tenants' waiting jobs on that queue."""

    list_display = ("tenant_name", "queue", "waiting", "in_flight", "cap_in_force", "blocked",
                    "weight", "dispatched_total")  # fmt: skip
    list_filter = (("queue", RecentValuesFilter),)
    search_fields = ("tenant",)
    ordering = ("-waiting", "tenant")
    list_per_page = 100
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    actions = ("cancel_backlog",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[DispatchTenant]:
        from django.db.models import OuterRef, Subquery

        # The tenant slot's override and the queue's limit, read with each row shown: the
        # cap in force is theirs when set (see django_fair_jobs.caps).
        slot = TenantQueueSlot.objects.filter(tenant=OuterRef("tenant"), queue=OuterRef("queue"))
        limit = QueueLimit.objects.filter(queue=OuterRef("queue"))
        rows: QuerySet[DispatchTenant] = super().get_queryset(request)
        return rows.annotate(
            slot_max_jobs=Subquery(slot.values("max_jobs")[:1]),
            slot_boost_until=Subquery(slot.values("boost_until")[:1]),
            slot_current_jobs=Subquery(slot.values("current_jobs")[:1]),
            queue_max_jobs=Subquery(limit.values("max_jobs")[:1]),
            queue_max_jobs_per_worker=Subquery(limit.values("max_jobs_per_worker")[:1]),
        )

    @admin.display(description="tenant", ordering="tenant")
    def tenant_name(self, obj: DispatchTenant) -> str:
        return obj.tenant or "(no tenant)"

    @admin.display(description="cap in force")
    def cap_in_force(self, obj: DispatchTenant) -> str:
        current = getattr(obj, "slot_current_jobs", None)
        slot = None
        if current is not None:  # the tenant has a slot row on the queue
            slot = caps.Slot(obj.slot_max_jobs, obj.slot_boost_until, 0, current)  # type: ignore[attr-defined]
        line = caps.Line(obj.cap, obj.in_flight)
        limit = caps.queue_limit(
            getattr(obj, "queue_max_jobs", None), getattr(obj, "queue_max_jobs_per_worker", None)
        )
        cap = caps.combine(obj.tenant, obj.queue, line, slot, limit)
        text = _cap_text(cap)
        return f"{text}; queue paused" if cap.queue_paused else text

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
    running, and failed (their publish failed too often, or the worker that received them
    had no such task: ``failure``; read-only, and a failed job can be put back in line once
    its cause is removed, or cancelled)."""

    list_display = ("task_id", "task_name", "tenant", "queue", "state", "enqueued_at",
                    "publish_failures", "failure")  # fmt: skip
    list_filter = ("state", ("queue", RecentValuesFilter))
    search_fields = ("task_id", "tenant")
    ordering = ("id",)
    list_per_page = 100
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    actions = ("put_back_failed", "cancel_failed")

    def has_put_back_permission(self, request: HttpRequest) -> bool:
        """Putting a failed job back in line needs the change permission on its rows."""
        return bool(request.user.has_perm("fair_jobs.change_dispatchjob"))

    @admin.action(description="Put the selected failed jobs back in line", permissions=["put_back"])
    def put_back_failed(self, request: HttpRequest, queryset: QuerySet[DispatchJob]) -> None:
        from celery import current_app

        count = dispatch.put_back_failed(current_app, list(queryset.values_list("pk", flat=True)))
        self.message_user(request, f"Put {count} failed job(s) back in line.")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """Cancelling failed jobs needs the permission that cancels a tenant's backlog."""
        return bool(request.user.has_perm("fair_jobs.cancel_backlog"))

    @admin.action(description="Cancel the selected failed jobs", permissions=["cancel"])
    def cancel_failed(
        self, request: HttpRequest, queryset: QuerySet[DispatchJob]
    ) -> TemplateResponse | None:
        failed = list(queryset.filter(state=FAILED).order_by("id").values_list("pk", flat=True))
        if not failed:
            self.message_user(request, "None of the selected jobs has failed: nothing cancelled.")
            return None
        if request.POST.get("post") != "yes":
            return self._confirm_cancel_failed(request, failed)
        count = backlog.cancel_failed(
            failed, user=_user(request), source="admin",
            reason=request.POST.get("reason", "").strip()[:200],
        )  # fmt: skip
        self.message_user(request, f"Cancelled {count} failed job(s); their results are REVOKED.")
        return None

    def _confirm_cancel_failed(self, request: HttpRequest, failed: list[int]) -> TemplateResponse:
        """The page that lists the failed jobs the action would cancel and asks to go on;
        it posts their ids back (not the selection: a filter may match more by then)."""
        from django.contrib.admin import helpers

        shown = DispatchJob.objects.using(dispatch.alias()).filter(pk__in=failed[:CANCEL_COUNTED])
        context = {
            **self.admin_site.each_context(request),
            "title": "Cancel failed jobs?",
            "opts": self.model._meta,
            "failed": list(shown.order_by("id")),
            "total": len(failed),
            "ids": failed,
            "action": request.POST.get("action", ""),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/fair_jobs/cancel_failed.html", context)

"""The admin pages of the rows that hold jobs: tenant slots (limits, boosts, pause and
resume), queue limits, parked jobs and worker processes."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from django_fair_jobs import caps, db
from django_fair_jobs.admin.base import (
    EstimatedCountPaginator,
    RecentValuesFilter,
    _BoundedLimits,
    _CancelsBacklog,
    _cap_text,
    _LeaseInline,
    _ParkedAdmin,
    _ProcessAdmin,
    _QueueAdmin,
    _ReadOnly,
    _SlotAdmin,
    _SlotForm,
    _user,
)
from django_fair_jobs.conf import MAX_LIMIT
from django_fair_jobs.dispatch.models import DispatchTenant
from django_fair_jobs.models import (
    ParkedJob,
    QueueLimit,
    SlotLease,
    TenantQueueSlot,
    WorkerProcess,
)


class SlotLeaseInline(_LeaseInline):
    """Live leases of a slot, read-only: they change only through the slot protocol."""

    model = SlotLease
    extra = 0
    can_delete = False
    fields = readonly_fields = ("task_id", "process", "acquired_at")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class TenantSlotForm(_SlotForm):
    """The slot's override plus an optional temporary boost (limit N until a time)."""

    boost_max_jobs = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=MAX_LIMIT,
        label="Boost to",
        help_text="A temporary limit; with 'boost until', it replaces max_jobs until then, "
        "and the limit comes back by itself.",
    )
    boost_until_time = forms.DateTimeField(
        required=False, label="Boost until", help_text="When the boost ends (server time)."
    )

    class Meta:
        model = TenantQueueSlot
        fields = ("tenant", "queue", "max_jobs")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        boost, until = data.get("boost_max_jobs"), data.get("boost_until_time")
        if (boost is None) != (until is None):
            raise forms.ValidationError("A boost needs both a limit and an end time.")
        if boost is not None and "max_jobs" in self.changed_data:
            raise forms.ValidationError("Change max_jobs or set a boost, not both at once.")
        if until is not None and until <= db.database_now():
            raise forms.ValidationError("A boost must end in the future.")
        return data


@admin.register(TenantQueueSlot)
class TenantQueueSlotAdmin(_CancelsBacklog, _BoundedLimits, _SlotAdmin):
    """Tenant limits: edit ``max_jobs`` (empty: the task's default; 0: paused) or boost
    it for a while. Every change is recorded in the limit history."""

    form = TenantSlotForm
    list_display = (
        "tenant",
        "queue",
        "max_jobs",
        "limit_in_force",
        "boost",
        "current_jobs",
        "live_leases",
        "parked_jobs",
        "deferred_total",
        "updated_at",
    )
    list_editable = ("max_jobs",)
    list_filter = (("queue", RecentValuesFilter), ("boost_until", admin.EmptyFieldListFilter))
    search_fields = ("tenant", "queue")
    ordering = ("tenant", "queue")
    list_per_page = 100
    # At scale (10,000 tenants and more), no count(*) over the whole table per page view.
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    fields = (
        "tenant",
        "queue",
        "max_jobs",
        "boost_max_jobs",
        "boost_until_time",
        "boost",
        "default_max_jobs",
        "current_jobs",
        "parked_jobs",
        "deferred_total",
    )
    readonly_fields = ("boost", "default_max_jobs", "current_jobs", "parked_jobs",
                       "deferred_total")  # fmt: skip
    inlines = (SlotLeaseInline,)
    actions = ("pause_tenants", "clear_overrides", "cancel_backlog", "reap_dead_workers")

    def get_queryset(self, request: HttpRequest) -> QuerySet[TenantQueueSlot]:
        from django.db.models import IntegerField, OuterRef, Subquery
        from django.db.models.functions import Coalesce

        # A count per slot shown, not a join grouped over every slot: the page reads its
        # rows on the (tenant, queue) index, whatever the number of tenants.
        leases = (
            SlotLease.objects.filter(slot=OuterRef("pk"))
            .order_by()
            .values("slot")
            .annotate(n=Count("pk"))
            .values("n")
        )
        count = Coalesce(Subquery(leases, output_field=IntegerField()), 0)
        # The tenant's line on the queue, if fair dispatch has one: its cap is then the
        # one in force when the slot has no override (see django_fair_jobs.caps).
        line = DispatchTenant.objects.filter(tenant=OuterRef("tenant"), queue=OuterRef("queue"))
        return (
            super()
            .get_queryset(request)
            .annotate(
                lease_count=count,
                line_id=Subquery(line.values("pk")[:1]),
                line_cap=Subquery(line.values("cap")[:1]),
                line_in_flight=Subquery(line.values("in_flight")[:1]),
            )
        )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # Tenant and queue form the key that workers look up; editing them would orphan
        # leases, so they are fixed once the row exists.
        base = tuple(self.readonly_fields)
        return (*base, "tenant", "queue") if obj is not None else base

    @admin.display(description="cap in force")
    def limit_in_force(self, obj: TenantQueueSlot) -> str:
        line = None
        if getattr(obj, "line_id", None) is not None:
            line = caps.Line(obj.line_cap, obj.line_in_flight)  # type: ignore[attr-defined]
        slot = caps.Slot(obj.max_jobs, obj.boost_until, obj.default_max_jobs, obj.current_jobs)
        return _cap_text(caps.combine(obj.tenant, obj.queue, line, slot, None))

    @admin.display(description="boost", ordering="boost_until")
    def boost(self, obj: TenantQueueSlot) -> str:
        if obj.boost_until is None:
            return "-"
        back = "the task's default" if obj.boost_restore is None else obj.boost_restore
        return f"{obj.max_jobs} until {obj.boost_until:%Y-%m-%d %H:%M:%S %Z}, then {back}"

    @admin.display(description="live leases", ordering="lease_count")
    def live_leases(self, obj: TenantQueueSlot) -> int:
        return int(getattr(obj, "lease_count", 0))

    def save_model(
        self, request: HttpRequest, obj: TenantQueueSlot, form: Any, change: bool
    ) -> None:
        # Only the limit is written, through the slot API (history, wake-ups); the
        # counters belong to the running workers.
        from django_fair_jobs import slots

        data = form.cleaned_data
        if data.get("boost_max_jobs") is not None:
            row = slots.boost(
                obj.tenant, obj.queue, data["boost_max_jobs"], data["boost_until_time"],
                user=_user(request), source="admin",
            )  # fmt: skip
        elif not change or "max_jobs" in form.changed_data:
            row = slots.set_tenant_limit(obj.tenant, obj.queue, obj.max_jobs,
                                         user=_user(request), source="admin")  # fmt: skip
        else:
            return
        obj.pk = row.pk

    @admin.action(
        description="Pause selected tenants on their queue (limit 0)", permissions=["change"]
    )
    def pause_tenants(self, request: HttpRequest, queryset: QuerySet[TenantQueueSlot]) -> None:
        from django_fair_jobs.slots import set_tenant_limit

        rows = list(queryset)
        for row in rows:
            set_tenant_limit(row.tenant, row.queue, 0, user=_user(request), source="admin")
        self.message_user(
            request,
            f"Paused {len(rows)} slot(s); running jobs finish, new ones wait (in their tenant's "
            "line under fair dispatch, else parked).",
        )

    @admin.action(
        description="Resume: clear the limit override (use the task's default)",
        permissions=["change"],
    )
    def clear_overrides(self, request: HttpRequest, queryset: QuerySet[TenantQueueSlot]) -> None:
        from django_fair_jobs.slots import set_tenant_limit

        rows = list(queryset)
        for row in rows:
            set_tenant_limit(row.tenant, row.queue, None, user=_user(request), source="admin")
        self.message_user(request, f"Cleared {len(rows)} override(s); parked jobs were woken.")

    @admin.action(
        description="Cancel the selected tenants' waiting jobs on their queue",
        permissions=["cancel"],
    )
    def cancel_backlog(
        self, request: HttpRequest, queryset: QuerySet[TenantQueueSlot]
    ) -> TemplateResponse | None:
        return self._cancel_rows(request, [(r.tenant, r.queue, None) for r in queryset])

    @admin.action(description="Reap the leases of dead workers now", permissions=["change"])
    def reap_dead_workers(self, request: HttpRequest, queryset: QuerySet[TenantQueueSlot]) -> None:
        _reap(self, request)


@admin.register(QueueLimit)
class QueueLimitAdmin(_BoundedLimits, _QueueAdmin):
    """Queue limits, editable at runtime: ``max_jobs`` across the cluster, ``max_jobs per
    worker`` on each node (empty: none; 0: paused). A change applies at once and wakes the
    jobs it lets start; it survives restarts (settings only seed queues with no row)."""

    list_display = (
        "queue",
        "max_jobs",
        "max_jobs_per_worker",
        "current_jobs",
        "running_by_node",
        "waiting",
        "oldest_waiting",
        "deferred_total",
        "updated_at",
    )
    list_editable = ("max_jobs", "max_jobs_per_worker")
    list_filter = (("max_jobs", admin.EmptyFieldListFilter),)
    search_fields = ("queue",)
    ordering = ("queue",)
    fields = ("queue", "max_jobs", "max_jobs_per_worker", "current_jobs", "parked_jobs")
    readonly_fields = ("current_jobs", "parked_jobs")
    actions = ("pause_queues", "reap_dead_workers")

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        from django_fair_jobs.queue_limits import queue_status

        # One pass for the page: node names and oldest waits, by queue.
        self._status = {q["queue"]: q for q in queue_status()}
        return super().changelist_view(request, extra_context)

    def _of(self, obj: QueueLimit) -> dict[str, Any]:
        status: dict[str, Any] = getattr(self, "_status", {}).get(obj.queue, {})
        return status

    @admin.display(description="running by node")
    def running_by_node(self, obj: QueueLimit) -> str:
        by_node = self._of(obj).get("running_by_node") or {}
        return ", ".join(f"{node}: {n}" for node, n in by_node.items()) or "-"

    @admin.display(description="parked", ordering="parked_jobs")
    def waiting(self, obj: QueueLimit) -> int:
        return int(self._of(obj).get("parked", obj.parked_jobs))

    @admin.display(description="oldest parked (s)")
    def oldest_waiting(self, obj: QueueLimit) -> str:
        age = self._of(obj).get("oldest_parked_seconds")
        return "-" if age is None else f"{age:g}"

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # Leases and parked jobs point at the row: the queue name is fixed once it exists.
        base = tuple(self.readonly_fields)
        return (*base, "queue") if obj is not None else base

    def save_model(self, request: HttpRequest, obj: QueueLimit, form: Any, change: bool) -> None:
        # Only the limits are written (the counters belong to the workers), then the jobs
        # the new limits let start are woken.
        from django_fair_jobs.queue_limits import set_limits

        row = set_limits(
            obj.queue, max_jobs=obj.max_jobs, max_jobs_per_worker=obj.max_jobs_per_worker,
            user=_user(request), source="admin",
        )  # fmt: skip
        obj.pk = row.pk

    @admin.action(description="Pause selected queues (limit 0)", permissions=["change"])
    def pause_queues(self, request: HttpRequest, queryset: QuerySet[QueueLimit]) -> None:
        from django_fair_jobs.queue_limits import set_limits

        names = list(queryset.values_list("queue", flat=True))
        for name in names:
            set_limits(name, max_jobs=0, user=_user(request), source="admin")
        self.message_user(
            request,
            f"Paused {len(names)} queue(s); running jobs finish, new ones wait (in their tenant's "
            "line under fair dispatch, else parked).",
        )

    @admin.action(description="Reap the leases of dead workers now", permissions=["change"])
    def reap_dead_workers(self, request: HttpRequest, queryset: QuerySet[QueueLimit]) -> None:
        _reap(self, request)


def _reap(model_admin: Any, request: HttpRequest) -> None:
    from django_fair_jobs.maintenance import run_maintenance

    report = run_maintenance()
    model_admin.message_user(
        request,
        f"{report.summary()}. Live workers are never reaped.",
        messages.SUCCESS,
    )


@admin.register(ParkedJob)
class ParkedJobAdmin(_ReadOnly, _ParkedAdmin):
    """Jobs waiting for a slot, oldest first (read-only). Deleting a parked row would lose
    the job silently; revoke it with Celery instead."""

    list_display = ("task_id", "task_name", "tenant", "queue", "parked_at", "woken_at")
    list_filter = (("slot__queue", RecentValuesFilter), ("task_name", RecentValuesFilter))
    search_fields = ("task_id", "slot__tenant")
    list_select_related = ("slot", "queue_limit")
    ordering = ("id",)
    # A backlog of 100,000 parked jobs: bounded counts and filters (see the classes).
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    @admin.display(ordering="slot__tenant")
    def tenant(self, obj: ParkedJob) -> str:
        return "-" if obj.slot is None else obj.slot.tenant

    @admin.display()
    def queue(self, obj: ParkedJob) -> str:
        waiting_on = obj.slot or obj.queue_limit
        return "-" if waiting_on is None else waiting_on.queue


@admin.register(WorkerProcess)
class WorkerProcessAdmin(_ReadOnly, _ProcessAdmin):
    """Processes that run fair tasks and their heartbeats (read-only). A live worker deleted
    here would have its leases reaped while its jobs run; the reaper removes dead ones."""

    list_display = (
        "node",
        "node_id",
        "hostname",
        "pid",
        "started_at",
        "last_heartbeat_at",
        "lease_count",
    )
    search_fields = ("node", "hostname")
    ordering = ("node", "pid")

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerProcess]:
        return super().get_queryset(request).annotate(n_leases=Count("leases"))

    @admin.display(description="leases", ordering="n_leases")
    def lease_count(self, obj: WorkerProcess) -> int:
        return int(getattr(obj, "n_leases", 0))

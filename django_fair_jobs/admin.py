"""The admin: an operations console for tenant slots, queue limits, leases, parked jobs,
workers, and the rerouting windows and reroute counts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db.models import Count, QuerySet
from django.http import HttpRequest

from django_fair_jobs.models import (
    ParkedJob,
    PlannedJob,
    PlannerTenant,
    QueueLimit,
    RerouteCount,
    SlotLease,
    TenantQueueSlot,
    TenantWindow,
    WorkerProcess,
)

if TYPE_CHECKING:
    # The admin classes are generic only for the type checker.
    _LeaseInline = admin.TabularInline[SlotLease, TenantQueueSlot]
    _SlotAdmin = admin.ModelAdmin[TenantQueueSlot]
    _ParkedAdmin = admin.ModelAdmin[ParkedJob]
    _ProcessAdmin = admin.ModelAdmin[WorkerProcess]
    _WindowAdmin = admin.ModelAdmin[TenantWindow]
    _RerouteAdmin = admin.ModelAdmin[RerouteCount]
    _QueueAdmin = admin.ModelAdmin[QueueLimit]
    _PlannedAdmin = admin.ModelAdmin[PlannedJob]
    _PlannerTenantAdmin = admin.ModelAdmin[PlannerTenant]
else:
    _LeaseInline = admin.TabularInline
    _SlotAdmin = _ParkedAdmin = _ProcessAdmin = _WindowAdmin = _RerouteAdmin = admin.ModelAdmin
    _QueueAdmin = _PlannedAdmin = _PlannerTenantAdmin = admin.ModelAdmin


class _ReadOnly:
    """Rows that only the library writes: viewable, never added, edited or deleted."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class SlotLeaseInline(_LeaseInline):
    """Live leases of a slot, read-only: they change only through the slot protocol."""

    model = SlotLease
    extra = 0
    can_delete = False
    fields = readonly_fields = ("task_id", "process", "acquired_at")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(TenantQueueSlot)
class TenantQueueSlotAdmin(_SlotAdmin):
    """Tenant limits: edit ``max_jobs`` (empty: the task's default; 0: paused)."""

    list_display = (
        "tenant",
        "queue",
        "max_jobs",
        "limit_in_force",
        "current_jobs",
        "live_leases",
        "parked_jobs",
        "deferred_total",
        "updated_at",
    )
    list_editable = ("max_jobs",)
    list_filter = ("queue",)
    search_fields = ("tenant",)
    ordering = ("tenant", "queue")
    fields = (
        "tenant",
        "queue",
        "max_jobs",
        "default_max_jobs",
        "current_jobs",
        "parked_jobs",
        "deferred_total",
    )
    readonly_fields = ("default_max_jobs", "current_jobs", "parked_jobs", "deferred_total")
    inlines = (SlotLeaseInline,)
    actions = ("pause_tenants", "clear_overrides", "reap_dead_workers")

    def get_queryset(self, request: HttpRequest) -> QuerySet[TenantQueueSlot]:
        return super().get_queryset(request).annotate(lease_count=Count("leases"))

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # Tenant and queue form the key that workers look up; editing them would orphan
        # leases, so they are fixed once the row exists.
        base = tuple(self.readonly_fields)
        return (*base, "tenant", "queue") if obj is not None else base

    @admin.display(description="limit in force")
    def limit_in_force(self, obj: TenantQueueSlot) -> int:
        return obj.effective_max_jobs

    @admin.display(description="live leases", ordering="lease_count")
    def live_leases(self, obj: TenantQueueSlot) -> int:
        return int(getattr(obj, "lease_count", 0))

    def save_model(
        self, request: HttpRequest, obj: TenantQueueSlot, form: Any, change: bool
    ) -> None:
        # Only the override is written: the counters belong to the running workers.
        if change:
            TenantQueueSlot.objects.filter(pk=obj.pk).update(max_jobs=obj.max_jobs)
        else:
            super().save_model(request, obj, form, change)
        if obj.pk is not None:
            from django_fair_jobs.slots import wake

            woken = wake(obj.pk, limit=None)
            if woken:
                self.message_user(request, f"{obj}: woke {woken} parked job(s).")

    @admin.action(
        description="Pause selected tenants on their queue (limit 0)", permissions=["change"]
    )
    def pause_tenants(self, request: HttpRequest, queryset: QuerySet[TenantQueueSlot]) -> None:
        count = queryset.update(max_jobs=0)
        self.message_user(request, f"Paused {count} slot(s); running jobs finish, new ones park.")

    @admin.action(
        description="Resume: clear the limit override (use the task's default)",
        permissions=["change"],
    )
    def clear_overrides(self, request: HttpRequest, queryset: QuerySet[TenantQueueSlot]) -> None:
        from django_fair_jobs.slots import wake

        ids = list(queryset.values_list("pk", flat=True))
        TenantQueueSlot.objects.filter(pk__in=ids).update(max_jobs=None)
        woken = sum(wake(pk, limit=None) for pk in ids)
        self.message_user(request, f"Cleared {len(ids)} override(s); woke {woken} parked job(s).")

    @admin.action(description="Release the leases of dead workers now", permissions=["change"])
    def reap_dead_workers(self, request: HttpRequest, queryset: QuerySet[TenantQueueSlot]) -> None:
        _reap(self, request)


@admin.register(QueueLimit)
class QueueLimitAdmin(_QueueAdmin):
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
    search_fields = ("queue",)
    ordering = ("queue",)
    fields = ("queue", "max_jobs", "max_jobs_per_worker", "current_jobs", "parked_jobs")
    readonly_fields = ("current_jobs", "parked_jobs")
    actions = ("pause_queues", "reap_dead_workers")

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        from django_fair_jobs.limits import queue_status

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
        from django_fair_jobs.limits import set_limits

        row = set_limits(
            obj.queue, max_jobs=obj.max_jobs, max_jobs_per_worker=obj.max_jobs_per_worker
        )
        obj.pk = row.pk

    @admin.action(description="Pause selected queues (limit 0)", permissions=["change"])
    def pause_queues(self, request: HttpRequest, queryset: QuerySet[QueueLimit]) -> None:
        count = queryset.update(max_jobs=0)
        self.message_user(request, f"Paused {count} queue(s); running jobs finish, new ones park.")

    @admin.action(description="Release the leases of dead workers now", permissions=["change"])
    def reap_dead_workers(self, request: HttpRequest, queryset: QuerySet[QueueLimit]) -> None:
        _reap(self, request)


def _reap(model_admin: Any, request: HttpRequest) -> None:
    from django_fair_jobs.workers import run_maintenance

    report = run_maintenance()
    model_admin.message_user(
        request,
        f"Reaped {report.leases_reaped} lease(s) of dead workers; woke {report.jobs_woken} "
        "parked job(s). Live workers are never reaped.",
        messages.SUCCESS,
    )


@admin.register(ParkedJob)
class ParkedJobAdmin(_ReadOnly, _ParkedAdmin):
    """Jobs waiting for a slot, oldest first (read-only). Deleting a parked row would lose
    the job silently; revoke it with Celery instead."""

    list_display = ("task_id", "task_name", "tenant", "queue", "parked_at", "woken_at")
    list_filter = ("slot__queue", "task_name")
    search_fields = ("task_id", "slot__tenant")
    list_select_related = ("slot", "queue_limit")
    ordering = ("id",)

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


@admin.register(TenantWindow)
class TenantWindowAdmin(_ReadOnly, _WindowAdmin):
    """Each tenant's enqueue counts, now, in every window its rules count over."""

    list_display = ("tenant", "key", "window_counts", "total", "last_enqueue")
    list_filter = ("key",)
    search_fields = ("tenant",)
    ordering = ("tenant", "key")

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        from django_fair_jobs.windows import windows_by_key

        # Computed once per page: which windows each key's rules count over, and when.
        self._windows = windows_by_key()
        self._now = TenantWindow.objects.database_second()
        return super().changelist_view(request, extra_context)

    @admin.display(description="enqueues in window (now)")
    def window_counts(self, obj: TenantWindow) -> str:
        pers = getattr(self, "_windows", {}).get(obj.key) or []
        if not pers:
            return "no task counts under this key now"
        counts = TenantWindow.objects.current_counts(obj, pers, getattr(self, "_now", None))
        return ", ".join(f"{n} in {per} s" for per, n in zip(pers, counts, strict=True))

    @admin.display(description="last enqueue (UTC)", ordering="last_second")
    def last_enqueue(self, obj: TenantWindow) -> str:
        from datetime import UTC, datetime

        return datetime.fromtimestamp(obj.last_second, UTC).strftime("%Y-%m-%d %H:%M:%S")


@admin.register(RerouteCount)
class RerouteCountAdmin(_ReadOnly, _RerouteAdmin):
    """How many jobs were rerouted, per tenant, task and destination queue."""

    list_display = ("tenant", "task_name", "queue", "total", "first_at", "last_at")
    list_filter = ("queue", "task_name")
    search_fields = ("tenant",)
    ordering = ("-last_at",)


@admin.register(PlannedJob)
class PlannedJobAdmin(_ReadOnly, _PlannedAdmin):
    """Jobs in the planners' virtual queues (not promoted yet) and promoted ones that have
    not started (read-only; revoke a job with Celery to drop it)."""

    list_display = ("task_id", "task_name", "tenant", "queue", "enqueued_at", "promoted_at")
    list_filter = ("task_name", "queue")
    search_fields = ("task_id", "tenant")
    ordering = ("id",)


@admin.register(PlannerTenant)
class PlannerTenantAdmin(_PlannerTenantAdmin):
    """Each tenant's backlog in each planner: jobs pending and the oldest's age; pause or
    resume a tenant's promotion."""

    list_display = ("tenant", "task_name", "pending", "oldest_pending", "paused",
                    "promoted_total", "pass_value")  # fmt: skip
    list_filter = ("task_name", "paused")
    search_fields = ("tenant",)
    ordering = ("task_name", "tenant")
    fields = readonly_fields = ("task_name", "tenant", "paused", "promoted_total", "pass_value")
    actions = ("pause_promotion", "resume_promotion")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        from django_fair_jobs.planner import status

        # One pass for the page: every tenant's backlog, by task.
        self._backlog = {
            (plan["task"], t["tenant"]): t for plan in status() for t in plan["tenants"]
        }
        return super().changelist_view(request, extra_context)

    def _of(self, obj: PlannerTenant) -> dict[str, Any]:
        found: dict[str, Any] = getattr(self, "_backlog", {}).get((obj.task_name, obj.tenant), {})
        return found

    @admin.display(description="pending")
    def pending(self, obj: PlannerTenant) -> int:
        return int(self._of(obj).get("pending", 0))

    @admin.display(description="oldest pending (s)")
    def oldest_pending(self, obj: PlannerTenant) -> str:
        age = self._of(obj).get("oldest_pending_seconds")
        return "-" if age is None else f"{age:g}"

    @admin.action(description="Pause promotion of the selected tenants", permissions=["change"])
    def pause_promotion(self, request: HttpRequest, queryset: QuerySet[PlannerTenant]) -> None:
        count = queryset.update(paused=True)
        self.message_user(request, f"Paused {count} tenant(s); their jobs wait, none is lost.")

    @admin.action(description="Resume promotion of the selected tenants", permissions=["change"])
    def resume_promotion(self, request: HttpRequest, queryset: QuerySet[PlannerTenant]) -> None:
        count = queryset.update(paused=False)
        self.message_user(request, f"Resumed {count} tenant(s) from the next planner run.")

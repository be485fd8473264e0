"""The admin: an operations console. A dashboard page (refreshing itself), then tenant
slots (limits, boosts), queue limits, leases, parked jobs, workers, rerouting windows and
counts, the planner's virtual queues, the limit history and recorded decisions.

Every page and action needs the app's model permissions: view to see a page, change to
act (pause, resume, boost, reap, reset a window). Every limit change is recorded with the
user who made it."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.core.validators import MaxValueValidator
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from django_fair_jobs.conf import MAX_LIMIT
from django_fair_jobs.models import (
    Dashboard,
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
    WorkerProcess,
)
from django_fair_jobs.planner import store as planner_store
from django_fair_jobs.windows import store as window_store

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
    _DashboardAdmin = admin.ModelAdmin[Dashboard]
    _ChangeAdmin = admin.ModelAdmin[LimitChange]
    _DecisionAdmin = admin.ModelAdmin[JobDecision]
    _SlotForm = forms.ModelForm[TenantQueueSlot]
else:
    _LeaseInline = admin.TabularInline
    _SlotAdmin = _ParkedAdmin = _ProcessAdmin = _WindowAdmin = _RerouteAdmin = admin.ModelAdmin
    _QueueAdmin = _PlannedAdmin = _PlannerTenantAdmin = admin.ModelAdmin
    _DashboardAdmin = _ChangeAdmin = _DecisionAdmin = admin.ModelAdmin
    _SlotForm = forms.ModelForm


def _user(request: HttpRequest) -> str:
    return str(getattr(request.user, "username", "") or "")


_LIMIT_FIELDS = frozenset({"max_jobs", "max_jobs_per_worker"})


class _BoundedLimits:
    """Limit fields (on the change form and in the list) accept whole numbers from 0 to
    ``MAX_LIMIT`` on every database: SQLite's columns would take more than PostgreSQL's,
    and a value one database refuses must be a form error, never a server error."""

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        field = super().formfield_for_dbfield(db_field, request, **kwargs)  # type: ignore[misc]
        if db_field.name in _LIMIT_FIELDS and isinstance(field, forms.IntegerField):
            field.max_value = MAX_LIMIT
            field.validators.append(MaxValueValidator(MAX_LIMIT))
            field.widget.attrs["max"] = MAX_LIMIT
        return field


class _ReadOnly:
    """Rows that only the library writes: viewable, never added, edited or deleted."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


EXACT_COUNT_LIMIT = 10_000
"""List pages count their rows exactly up to this many; above it, see
:class:`EstimatedCountPaginator`."""

RECENT_ROWS = 10_000
"""How many of a table's newest rows a :class:`RecentValuesFilter` takes its choices from."""


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]  # generic in the stubs only
    """Counts a list page's rows exactly up to :data:`EXACT_COUNT_LIMIT`, and above that,
    on PostgreSQL, takes the query planner's estimate.

    An exact ``count(*)`` reads every row at every page view: with 100,000 parked or
    planned jobs that is most of the page's time, and it grows with the table. A count
    capped at the limit reads at most the limit's rows, and an estimate costs a plan. Above
    the limit the total shown is approximate, and the last pages may be off by the
    estimate's error; filters and search still reach every row. Other databases (SQLite,
    for development) count exactly."""

    @cached_property
    def count(self) -> int:
        """The number of rows: exact up to the limit, else an estimate on PostgreSQL."""
        import json

        from django.db import connections

        rows = self.object_list
        if not isinstance(rows, QuerySet):
            return len(rows)
        unordered = rows.order_by()  # ordering changes no count, and may cost a sort
        capped = unordered[: EXACT_COUNT_LIMIT + 1].count()
        if capped <= EXACT_COUNT_LIMIT:
            return capped
        if connections[unordered.db].vendor != "postgresql":
            return unordered.count()
        plan = json.loads(unordered.explain(format="json"))
        return max(int(plan[0]["Plan"]["Plan Rows"]), capped)


class RecentValuesFilter(admin.AllValuesFieldListFilter):
    """A filter on a column's values, offered from the newest :data:`RECENT_ROWS` rows.

    Django's own filter reads ``SELECT DISTINCT column`` over the whole table at every page
    view, a scan that grows with the table (100,000 parked jobs, decisions, planned jobs).
    This one reads the newest rows on the primary key, so its cost is bounded; a value
    seen only in older rows is not offered, but the page's search and a URL parameter still
    filter on it (a selected value is always shown)."""

    def __init__(
        self, field: Any, request: HttpRequest, params: Any, model: Any, model_admin: Any,
        field_path: str,
    ) -> None:  # fmt: skip
        from django.contrib.admin.utils import reverse_field_path

        super().__init__(field, request, params, model, model_admin, field_path)
        # The parent's choices are a lazy DISTINCT over the table: replaced before use.
        parent_model, _ = reverse_field_path(model, field_path)
        newest = parent_model._default_manager.order_by("-pk").values_list(field.name, flat=True)
        found = set(newest[:RECENT_ROWS])
        found.update(self.lookup_val or ())
        known = sorted(value for value in found if value is not None)
        self.lookup_choices = [*known, None] if None in found else known  # type: ignore[assignment]


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
        if until is not None:
            from django_fair_jobs.db import database_now

            if until <= database_now():
                raise forms.ValidationError("A boost must end in the future.")
        return data


@admin.register(TenantQueueSlot)
class TenantQueueSlotAdmin(_BoundedLimits, _SlotAdmin):
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
    actions = ("pause_tenants", "clear_overrides", "reap_dead_workers")

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
        return super().get_queryset(request).annotate(lease_count=count)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # Tenant and queue form the key that workers look up; editing them would orphan
        # leases, so they are fixed once the row exists.
        base = tuple(self.readonly_fields)
        return (*base, "tenant", "queue") if obj is not None else base

    @admin.display(description="limit in force")
    def limit_in_force(self, obj: TenantQueueSlot) -> int:
        return obj.effective_max_jobs

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
            request, f"Paused {len(rows)} slot(s); running jobs finish, new ones park."
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

    @admin.action(description="Release the leases of dead workers now", permissions=["change"])
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
            obj.queue, max_jobs=obj.max_jobs, max_jobs_per_worker=obj.max_jobs_per_worker,
            user=_user(request), source="admin",
        )  # fmt: skip
        obj.pk = row.pk

    @admin.action(description="Pause selected queues (limit 0)", permissions=["change"])
    def pause_queues(self, request: HttpRequest, queryset: QuerySet[QueueLimit]) -> None:
        from django_fair_jobs.limits import set_limits

        names = list(queryset.values_list("queue", flat=True))
        for name in names:
            set_limits(name, max_jobs=0, user=_user(request), source="admin")
        self.message_user(
            request, f"Paused {len(names)} queue(s); running jobs finish, new ones park."
        )

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
        count = window_store.reset(list(queryset.values_list("pk", flat=True)))
        self.message_user(
            request, f"Reset {count} window(s); those tenants' next jobs use their normal queue."
        )

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        from django_fair_jobs.windows import windows_by_key

        # Computed once per page: which windows each key's rules count over, and when.
        self._windows = windows_by_key()
        self._now = window_store.database_second()
        return super().changelist_view(request, extra_context)

    @admin.display(description="enqueues in window (now)")
    def window_counts(self, obj: TenantWindow) -> str:
        pers = getattr(self, "_windows", {}).get(obj.key) or []
        if not pers:
            return "no task counts under this key now"
        counts = window_store.current_counts(obj, pers, getattr(self, "_now", None))
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
    actions = ("retry_failed",)
    ordering = ("id",)
    # A flood of 100,000 planned jobs: bounded counts and filters (see the classes).
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    def has_retry_permission(self, request: HttpRequest) -> bool:
        """Putting a failed job back in line needs the change permission on planned jobs
        (the rows stay read-only otherwise)."""
        return bool(request.user.has_perm("fair_jobs.change_plannedjob"))

    @admin.action(description="Put the selected failed jobs back in line", permissions=["retry"])
    def retry_failed(self, request: HttpRequest, queryset: QuerySet[PlannedJob]) -> None:
        count = planner_store.retry_failed(queryset)
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
        from django_fair_jobs.db import database_now

        # Ages on the database clock, read once for the page.
        self._now = database_now()
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
        snap = snapshot()
        # The busiest tenants first (longest wait, then most running); a page of 10,000
        # rows helps nobody, and the slot list pages through the rest.
        ranked = sorted(
            snap["tenants"],
            key=lambda t: (-(t["oldest_wait_seconds"] or 0), -t["running"], t["tenant"]),
        )
        context = {
            **self.admin_site.each_context(request),
            "title": "Fair jobs dashboard",
            "opts": self.model._meta,
            "snapshot": snap,
            "tenants": ranked[:DASHBOARD_TENANTS],
            "tenants_hidden": max(len(ranked) - DASHBOARD_TENANTS, 0),
            "refresh": fair_settings.DASHBOARD_REFRESH,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/fair_jobs/dashboard.html", context)

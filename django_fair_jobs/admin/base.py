"""What every page of the admin shares: the user named in the history, bounded limit
fields, read-only pages, and the paginator and filter that stay fast on large tables."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin
from django.core.paginator import Paginator
from django.core.validators import MaxValueValidator
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from django_fair_jobs import caps
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


def _cap_text(cap: caps.Cap) -> str:
    """A cap in force as a list page shows it: the number, or "-" for none, and where a
    pause or a boost comes from."""
    if cap.limit is None:
        return "-"
    if cap.source == "paused":
        return "0 (paused)"
    return f"{cap.limit} ({cap.said})" if cap.source == "boost" else str(cap.limit)


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


CANCEL_COUNTED = 100
"""Selected rows whose waiting jobs the cancel's confirmation page counts one by one."""


class _CancelsBacklog:
    """The admin action that cancels the selected rows' tenants' waiting jobs (on the
    row's queue, or of the row's task): see :mod:`django_fair_jobs.backlog`. It needs the
    ``fair_jobs.cancel_backlog`` permission, and asks for confirmation first, as Django's
    delete action does: a page says what would be cancelled and takes an optional reason
    for the history."""

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """Whether the user may cancel tenants' backlogs."""
        return bool(request.user.has_perm("fair_jobs.cancel_backlog"))

    def _cancel_rows(self, request: HttpRequest, rows: list[tuple[str, str | None, str | None]]
                     ) -> TemplateResponse | None:  # fmt: skip
        from django_fair_jobs import backlog

        if request.POST.get("post") != "yes":
            return self._confirm_cancel(request, rows)
        user, reason = _user(request), request.POST.get("reason", "").strip()[:200]
        done = [
            backlog.cancel(t, queue=q, task=k, user=user, source="admin", reason=reason)
            for t, q, k in rows
        ]
        self.message_user(  # type: ignore[attr-defined]
            request,
            f"Cancelled {sum(d.total for d in done)} waiting job(s) of {len(done)} "
            "tenant(s); their results are REVOKED. Jobs in the broker or running go on.",
        )
        return None

    def _confirm_cancel(
        self, request: HttpRequest, rows: list[tuple[str, str | None, str | None]]
    ) -> TemplateResponse:
        """The page that says what the cancel would drop and asks to go on."""
        from django.contrib.admin import helpers

        from django_fair_jobs import backlog

        counted = [backlog.count(t, queue=q, task=k) for t, q, k in rows[:CANCEL_COUNTED]]
        context = {
            **self.admin_site.each_context(request),  # type: ignore[attr-defined]
            "title": "Cancel waiting jobs?",
            "opts": self.model._meta,  # type: ignore[attr-defined]
            "counted": counted,
            "total": sum(c.total for c in counted),
            "not_counted": max(len(rows) - CANCEL_COUNTED, 0),
            "action": request.POST.get("action", ""),
            "ids": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across") == "1",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/fair_jobs/cancel_backlog.html", context)


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

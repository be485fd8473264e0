"""The admin: an operations console. A dashboard page (refreshing itself), then tenant
slots (limits, boosts), queue limits, leases, parked jobs, workers, rerouting windows and
counts, the planner's virtual queues, the limit history and recorded decisions.

Every page and action needs the app's model permissions: view to see a page, change to
act (pause, resume, boost, reap, reset a window, put failed jobs back); cancelling a
tenant's waiting jobs, or fair dispatch's failed jobs, needs ``fair_jobs.cancel_backlog``.
Every limit change and cancel is recorded with the user who made it."""

from __future__ import annotations

from django_fair_jobs.admin import base as base
from django_fair_jobs.admin import dispatch as dispatch
from django_fair_jobs.admin import history as history
from django_fair_jobs.admin import slots as slots
from django_fair_jobs.admin.base import EXACT_COUNT_LIMIT as EXACT_COUNT_LIMIT
from django_fair_jobs.admin.base import RECENT_ROWS as RECENT_ROWS
from django_fair_jobs.admin.base import EstimatedCountPaginator as EstimatedCountPaginator
from django_fair_jobs.admin.base import RecentValuesFilter as RecentValuesFilter
from django_fair_jobs.admin.dispatch import DispatchJobAdmin as DispatchJobAdmin
from django_fair_jobs.admin.dispatch import DispatchTenantAdmin as DispatchTenantAdmin
from django_fair_jobs.admin.history import DASHBOARD_TENANTS as DASHBOARD_TENANTS
from django_fair_jobs.admin.history import DashboardAdmin as DashboardAdmin
from django_fair_jobs.admin.history import JobDecisionAdmin as JobDecisionAdmin
from django_fair_jobs.admin.history import LimitChangeAdmin as LimitChangeAdmin
from django_fair_jobs.admin.history import PlannedJobAdmin as PlannedJobAdmin
from django_fair_jobs.admin.history import PlannerTenantAdmin as PlannerTenantAdmin
from django_fair_jobs.admin.history import RerouteCountAdmin as RerouteCountAdmin
from django_fair_jobs.admin.history import TenantWindowAdmin as TenantWindowAdmin
from django_fair_jobs.admin.slots import ParkedJobAdmin as ParkedJobAdmin
from django_fair_jobs.admin.slots import QueueLimitAdmin as QueueLimitAdmin
from django_fair_jobs.admin.slots import TenantQueueSlotAdmin as TenantQueueSlotAdmin
from django_fair_jobs.admin.slots import WorkerProcessAdmin as WorkerProcessAdmin

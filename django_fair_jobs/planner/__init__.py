"""Mechanism C, the fair planner: per-tenant virtual queues in the database, promoted to
the broker in weighted rounds that remember past rounds, held back while the queue lags.

A task with ``fair_plan = {"enqueue_interval": 60, "enqueue_jobs": 100, ...}`` publishes
nothing at ``delay()``: the job (arguments, task id, queue, priority, headers, links and
its countdown or ETA) is stored in its tenant's virtual queue (:class:`PlannedJob`), FIFO,
and ``AsyncResult`` for its task id works as usual. Every ``enqueue_interval`` seconds one
planner run per task (a row lock with a TTL: at most one at a time, and two at once are
still safe) promotes up to ``enqueue_jobs`` jobs across the tenants with jobs due, by the
weights ``tenant_weights(tenant_ids)`` returns.

**Weighted fair with memory (stride scheduling).** Each tenant has a virtual time, its
``pass``: every promotion adds ``1 / weight`` to it, and each promotion goes to the tenant
with the lowest pass (ties by tenant id). Passes are kept between runs, so a tenant
promoted little in one run is first in the next, and over many runs each backlogged
tenant's share of promotions converges to its share of the weights: after any number of
promotions, a backlogged tenant's count is within one of its exact weighted share. A tenant
that was idle re-enters at the current virtual time (it gets no credit for being idle).

**Bound on waiting.** A tenant of weight ``w`` whose jobs become due, among tenants of
total weight ``W`` (its own included), ``n`` of them, is promoted within
``ceil(((W - w) / w + n) / enqueue_jobs) + 1`` runs, whatever the others' backlogs.

**Backpressure.** Before promoting, the run measures the latency of the queues its jobs go
to from our own rows: the age of the oldest job promoted there and not yet started (a job's
row is deleted when it starts). Strictly above ``latency_threshold`` seconds, the run promotes
nothing; at the threshold it proceeds.

**At-least-once.** A run claims a tenant's oldest rows with ``FOR UPDATE SKIP LOCKED``,
publishes them, and marks them promoted in the same transaction: a crash between the
publish and the commit leaves them in line, and the next run publishes them again with the
same task id (the duplicate is visible as a second start of that id). Two runs at once
never publish the same job twice, because each claims rows the other skips.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone
from kombu.utils.json import dumps, loads

from django_fair_jobs import broker, db
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.errors import (
    FairArgumentsError,
)
from django_fair_jobs.errors import (
    PlanError as PlanError,
)
from django_fair_jobs.errors import (
    PublishFailedError as PublishFailedError,
)
from django_fair_jobs.planner import store as planner_store
from django_fair_jobs.planner.plans import KNOWN_KEYS as KNOWN_KEYS
from django_fair_jobs.planner.plans import REQUIRED_KEYS as REQUIRED_KEYS
from django_fair_jobs.planner.plans import Plan as Plan
from django_fair_jobs.planner.plans import parse_plan as parse_plan
from django_fair_jobs.planner.plans import plan_errors as plan_errors
from django_fair_jobs.planner.stride import MAX_WEIGHT as MAX_WEIGHT
from django_fair_jobs.planner.stride import MIN_WEIGHT as MIN_WEIGHT
from django_fair_jobs.planner.stride import Allocation as Allocation
from django_fair_jobs.planner.stride import allocate as allocate
from django_fair_jobs.planner.stride import wait_bound as wait_bound
from django_fair_jobs.planner.stride import weights as weights
from django_fair_jobs.routing import declared_queue
from django_fair_jobs.tenants import for_log, normalize_tenant, warn_missing_tenant

if TYPE_CHECKING:
    from celery import Celery, Task
    from celery.result import AsyncResult

    from django_fair_jobs.models import PlannedJob

logger = logging.getLogger("django_fair_jobs.planner")

PUBLISH_ATTEMPTS = 3
"""Publishes a planned job may fail for a reason of its own before it is failed for good
(``failed_at``): a few, so that an error that passes is not fatal, and few enough that a
job that can never be published holds nothing back for long. A broker or database outage
is not counted (:func:`django_fair_jobs.broker.unreachable`)."""

STALE_FACTOR = 10
"""A promoted job not started after this many times its plan's ``latency_threshold`` (or
``enqueue_interval``, if longer), and at least :data:`STALE_MIN_SECONDS`, is presumed lost
(see :func:`stale_after`)."""

STALE_MIN_SECONDS = 3600.0
"""The least time a promoted job may wait in the broker before it is presumed lost: an
hour, as long as Redis's default visibility timeout before it redelivers a message."""


# Publishing --------------------------------------------------------------------------


NO_TENANT = ""
"""The tenant of the virtual queue that holds a task's planned jobs without a tenant: no
real tenant can be empty (:func:`~django_fair_jobs.tenants.normalize_tenant`)."""


def _row(
    task: Task[Any, Any], tenant: Any, args: Any, kwargs: Any, options: dict[str, Any]
) -> PlannedJob:
    from django_fair_jobs.models import PlannedJob

    tenant = normalize_tenant(tenant)
    if tenant is None:
        # Never refused at delay(): it waits in the virtual queue of the jobs without a
        # tenant, which the planner promotes as one more tenant.
        warn_missing_tenant(task.name, "planned")
        tenant = NO_TENANT
    options = dict(options)
    task_id = str(options.pop("task_id", None) or uuid.uuid4())
    countdown, eta = options.pop("countdown", None), options.pop("eta", None)
    not_before = None
    if eta is not None:
        not_before = eta if timezone.is_aware(eta) else timezone.make_aware(eta, UTC)
    elif countdown:
        not_before = timezone.now() + timedelta(seconds=float(countdown))
    queue = options.get("queue") or declared_queue(task, args, kwargs)
    signature = task.signature(args, kwargs, task_id=task_id, **options)
    try:
        stored = dumps(dict(signature))
    except (TypeError, ValueError) as exc:
        # At publish, not in the planner: a row that cannot be read back would never run.
        raise FairArgumentsError(
            f"{task.name}: the job cannot be stored in its tenant's virtual queue as JSON "
            f"({exc}); pass arguments, headers and options that JSON can hold."
        ) from None
    return PlannedJob(
        task_name=task.name,
        tenant=str(tenant),
        queue=str(getattr(queue, "name", queue)),
        task_id=task_id,
        signature=stored,
        not_before=not_before,
    )


def intercept(
    task: Task[Any, Any], tenant: Any, args: Any, kwargs: Any, options: dict[str, Any]
) -> AsyncResult[Any]:
    """Store a job in its tenant's virtual queue instead of publishing it (one INSERT,
    no lock shared across tenants); returns its ``AsyncResult``."""
    row = _row(task, tenant, args, kwargs, options)
    row.save(force_insert=True)
    return task.AsyncResult(row.task_id)


def bulk_enqueue(
    task: Task[Any, Any],
    tenant_of: Callable[..., Any],
    items: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
    options: dict[str, Any],
) -> list[AsyncResult[Any]]:
    """Store many jobs in their tenants' virtual queues in one INSERT."""
    from django_fair_jobs.models import PlannedJob

    options = dict(options)
    if options.get("task_id") is not None:
        raise PlanError(
            f"{task.name}: bulk_enqueue gives each job a task id of its own; remove task_id= "
            "from its options (apply_async(task_id=...) publishes a job with an id you choose)."
        )
    explicit = options.pop("fair_tenant", None)
    rows = []
    for a, k in items:
        tenant = explicit if explicit is not None else tenant_of(*a, **k)
        rows.append(_row(task, tenant, tuple(a), dict(k), options))
    PlannedJob.objects.bulk_create(rows)
    return [task.AsyncResult(row.task_id) for row in rows]


_pending_starts: list[str] = []
_pending_starts_lock = threading.Lock()


def started(task_id: str) -> None:
    """A promoted job starts: its row goes, so it no longer counts in the queue's latency.
    A database error is logged, never raised (the job still runs); the process remembers
    the start and deletes the row at its next heartbeat (:func:`retry_pending_starts`), so
    the row does not hold the queue's planners back."""

    try:
        if not planner_store.started(task_id):
            logger.debug("%s started with no planned row (a retry, or a second copy)", task_id)
    except Exception:
        logger.exception("Could not mark planned job %s started; retried at the next heartbeat",
                         task_id)  # fmt: skip
        with _pending_starts_lock:
            _pending_starts.append(task_id)


def retry_pending_starts() -> int:
    """Delete the rows of jobs whose start failed to delete them earlier in this process
    (called by the heartbeat); returns how many starts were recorded. Stops at the first
    error and keeps the rest for the next heartbeat."""

    with _pending_starts_lock:
        pending = list(_pending_starts)
        _pending_starts.clear()
    done = 0
    for position, task_id in enumerate(pending):
        try:
            planner_store.started(task_id)
        except Exception:
            # Kept whatever the error: a start dropped here would hold its queue back.
            with _pending_starts_lock:
                _pending_starts.extend(pending[position:])
            break
        done += 1
    return done


# Planning ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunReport:
    """What one planner run did."""

    task_name: str
    promoted: int
    latency: float | None
    depth: int
    skipped_for_backpressure: bool
    counts: dict[str, int]


def stale_after(plan: Plan) -> float:
    """Seconds after which a promoted job of ``plan`` that has not started is presumed lost:
    :data:`STALE_FACTOR` times the longer of its ``latency_threshold`` and
    ``enqueue_interval``, and at least :data:`STALE_MIN_SECONDS`. Such a row no longer
    counts in the latency, and its planner puts it back in line."""
    return max(STALE_FACTOR * max(plan.latency_threshold, plan.enqueue_interval), STALE_MIN_SECONDS)


def run(
    task: Task[Any, Any], app: Celery | None = None, *, due_only: bool = True
) -> RunReport | None:
    """Run ``task``'s planner once if it is due (``due_only``) and nobody runs it; returns
    what it did, or None if it did not run."""
    from django_fair_jobs.models import PlannerRun

    plan = parse_plan(task.fair_plan)  # type: ignore[attr-defined]
    name = task.name
    if not due_only:
        # Due a second ago: clear of any rounding between the clocks' text forms (SQLite).
        from django.db.models import Value
        from django.db.models.functions import Now

        # On the database clock, the claim's.
        due = Now() - Value(timedelta(seconds=1))
        PlannerRun.objects.filter(task_name=name).update(next_run_at=due)
    token = planner_store.claim_run(
        name, interval=plan.enqueue_interval, lock_ttl=plan.planner_lock_ttl
    )
    if token is None:
        return None
    counts: dict[str, int] = {}
    latency, depth = None, 0
    skipped = False
    try:
        lost_after = stale_after(plan)
        requeued = planner_store.requeue_stale(name, lost_after)
        if requeued:
            # Its message is gone (a purged queue), or its start could not delete the row
            # and the process died before retrying: publishing it again loses no job.
            logger.warning(
                "Planner of %s put %s job(s) back in line: promoted more than %g s ago and "
                "never started (message lost?); they are published again",
                name, requeued, lost_after,
            )  # fmt: skip
        latency, depth = planner_store.latency(name, stale_after=lost_after)
        if latency is not None and latency > plan.latency_threshold:
            skipped = True
        else:
            counts = _promote(task, plan, app)
    finally:
        planner_store.finish_run(
            name, token, last_promoted=sum(counts.values()), last_latency=latency,
            last_skipped=skipped,
        )  # fmt: skip
    return RunReport(name, sum(counts.values()), latency, depth, skipped, counts)


def _allocation(name: str, plan: Plan) -> tuple[Allocation, dict[str, float]] | None:
    """How many jobs of each tenant of task ``name`` this run promotes, and in which order
    (None: no tenant with jobs due and not paused), with the tenants' weights."""
    from django_fair_jobs.models import PlannerRun, PlannerTenant

    pending = planner_store.pending(name)
    # Every tenant with jobs due gets its row (pausable in the admin before its first
    # promotion); a new tenant starts at the current virtual time (see allocate).
    PlannerTenant.objects.bulk_create(
        [PlannerTenant(task_name=name, tenant=t) for t in sorted(pending)],
        ignore_conflicts=True,
    )
    paused = set(
        PlannerTenant.objects.filter(task_name=name, paused=True).values_list("tenant", flat=True)
    )
    tenants = sorted(t for t in pending if t not in paused)
    if not tenants:
        return None
    tenant_weights = weights(plan, tenants, task_name=name)
    state = PlannerRun.objects.get(task_name=name)
    # A row never promoted has no pass yet: allocate() starts it at the virtual time.
    passes = dict(
        PlannerTenant.objects.filter(
            task_name=name, tenant__in=tenants, promoted_total__gt=0
        ).values_list("tenant", "pass_value")
    )
    plan_out = allocate(
        {t: pending[t][0] for t in tenants}, tenant_weights, passes, state.virtual_time,
        plan.enqueue_jobs,
    )  # fmt: skip
    return plan_out, tenant_weights


def _promote(task: Task[Any, Any], plan: Plan, app: Celery | None) -> dict[str, int]:
    from django.db.models import F

    from django_fair_jobs.models import PlannerRun, PlannerTenant

    name = task.name
    allocated = _allocation(name, plan)
    if allocated is None:
        return {}
    plan_out, tenant_weights = allocated
    celery_app = app or task.app
    done: dict[str, int] = {}
    complete = True
    for tenant in plan_out.order:
        wanted = plan_out.counts[tenant]
        try:
            promoted = planner_store.promote(
                name, tenant, wanted, lambda row: _publish(celery_app, row),
                transient=broker.unreachable, max_attempts=PUBLISH_ATTEMPTS,
                gave_up=lambda row, exc: _gave_up(celery_app, row, exc),
            )  # fmt: skip
        except Exception as exc:
            # One tenant's batch never stops the others: its jobs stay in line, its pass
            # stays, and the other tenants are promoted.
            logger.exception(
                "Planner of %s could not promote tenant %s; its jobs stay in line",
                name, for_log(tenant),
            )  # fmt: skip
            complete = False
            if broker.unreachable(exc):
                break  # the broker is unreachable: every other tenant would wait as long
            continue
        done[tenant] = len(promoted)
        # Rows another planner took were not ours: this tenant's pass only moves by what
        # this run promoted.
        final = plan_out.passes[tenant] - (wanted - len(promoted)) / tenant_weights[tenant]
        # The row exists: every tenant with jobs due got one at the start of this run.
        PlannerTenant.objects.filter(task_name=name, tenant=tenant).update(
            pass_value=final, promoted_total=F("promoted_total") + len(promoted)
        )
    if complete:
        # After a tenant's error, the virtual time stays: tenants not served keep their turn.
        PlannerRun.objects.filter(task_name=name).update(virtual_time=plan_out.virtual_time)
    return done


def _publish(app: Celery, row: PlannedJob) -> None:
    sig = app.signature(loads(row.signature))
    sig.apply_async(fair_planned=True)


def _gave_up(app: Celery, row: PlannedJob, exc: BaseException) -> None:
    """A planned job failed for good: log it, and end its result in FAILURE so that a
    caller waiting on its ``AsyncResult`` learns why instead of waiting for ever."""

    logger.error(
        "Planned job %s of %s (tenant %s) failed %s publishes and will not be promoted: %s",
        row.task_id, row.task_name, for_log(row.tenant), row.attempts, row.last_error,
    )  # fmt: skip
    task = app.tasks.get(row.task_name)
    backend = task.backend if task is not None else app.backend
    error = PublishFailedError(
        f"{row.task_name}: the planner could not publish the job ({row.attempts} attempts): "
        f"{row.last_error}"
    )
    try:
        backend.mark_as_failure(row.task_id, error)
    except NotImplementedError:
        pass  # no result backend: the row's failed_at and last_error are the record
    except Exception:
        logger.exception("Could not store the failure of planned job %s", row.task_id)


def planned_tasks(app: Celery | None = None) -> list[Task[Any, Any]]:
    """The app's tasks that have a ``fair_plan``."""
    from celery import current_app

    tasks = (app or current_app).tasks
    return [t for _, t in sorted(tasks.items()) if getattr(t, "fair_plan", None)]


def run_due(app: Celery | None = None) -> list[RunReport]:
    """Run every planner that is due (called by every worker process's planner thread)."""
    reports = []
    for task in planned_tasks(app):
        try:
            report = run(task, app)
        except Exception:
            logger.exception("Planner of %s failed; it runs again next interval", task.name)
            continue
        if report is not None:
            reports.append(report)
    return reports


_thread: threading.Thread | None = None


def start_thread(stop: threading.Event) -> None:
    """Start this process's planner thread (if the app has planned tasks and
    ``FAIR_JOBS_PLANNER_THREADS`` is on): it tries every due planner at a quarter of the
    shortest interval, between 0.2 s and the heartbeat interval; the planner lock lets one
    process in the cluster run each."""
    global _thread
    if not fair_settings.PLANNER_THREADS:
        return  # the planners run from the django_fair_jobs.plan task (Celery beat)
    tasks = planned_tasks()
    if not tasks or (_thread is not None and _thread.is_alive()):
        return
    shortest = min(parse_plan(t.fair_plan).enqueue_interval for t in tasks)  # type: ignore[attr-defined]
    period = min(max(shortest / 4, 0.2), fair_settings.HEARTBEAT_INTERVAL)

    def loop() -> None:
        from django.db import close_old_connections, connections

        try:
            while not stop.wait(period):
                close_old_connections()
                run_due()
        finally:
            connections.close_all()

    _thread = threading.Thread(target=loop, name="fair-jobs-planner", daemon=True)
    _thread.start()


def status(app: Celery | None = None, first: int | None = None) -> list[dict[str, Any]]:
    """Per planned task: its last run (when, promoted, latency, skipped for backpressure)
    and per tenant with planned jobs: jobs pending, age of the oldest (database clock),
    jobs failed for good (their publish failed :data:`PUBLISH_ATTEMPTS` times), promoted
    in all, and whether promotion is paused. With ``first``, only the ``first`` tenants
    waiting longest (then with the most pending) of each task, and ``tenants_total``
    counts them all."""
    from django.db.models import Count, F, Min, Q

    from django_fair_jobs.models import PlannedJob, PlannerRun, PlannerTenant

    now = db.database_now()
    out = []
    for task in planned_tasks(app):
        run_row = PlannerRun.objects.filter(task_name=task.name).first()
        waiting = Q(promoted_at__isnull=True, failed_at__isnull=True)
        failed = Q(failed_at__isnull=False)
        grouped = PlannedJob.objects.filter(task_name=task.name).values("tenant")
        rows = grouped.annotate(
            pending=Count("pk", filter=waiting),
            oldest=Min("enqueued_at", filter=waiting),
            in_flight=Count("pk", filter=Q(promoted_at__isnull=False)),
            failed=Count("pk", filter=failed),
        )
        if first is None:
            shown, total = list(rows.order_by("tenant")), None
        else:
            ranked = rows.order_by(F("oldest").asc(nulls_last=True), "-pending", "tenant")
            shown, total = list(ranked[:first]), grouped.order_by().distinct().count()
        standings = PlannerTenant.objects.filter(task_name=task.name)
        if total is not None:  # a page of them: read only their standing
            standings = standings.filter(tenant__in=[r["tenant"] for r in shown])
        standing = {t.tenant: t for t in standings}
        tenants = []
        for row in shown:
            known = standing.get(row["tenant"])
            oldest = row["oldest"]
            tenants.append(
                {
                    "tenant": row["tenant"],
                    "pending": row["pending"],
                    "promoted_not_started": row["in_flight"],
                    "failed": row["failed"],
                    "oldest_pending_seconds": None
                    if oldest is None
                    else round(max((now - oldest).total_seconds(), 0.0), 1),
                    "promoted_total": 0 if known is None else known.promoted_total,
                    "paused": bool(known and known.paused),
                }
            )
        out.append(
            {
                "task": task.name,
                "last_run_at": None
                if run_row is None or run_row.last_run_at is None
                else run_row.last_run_at.isoformat(),
                "last_promoted": None if run_row is None else run_row.last_promoted,
                "last_latency_seconds": None if run_row is None else run_row.last_latency,
                "last_skipped_for_backpressure": bool(run_row and run_row.last_skipped),
                "tenants": tenants,
                "tenants_total": len(tenants) if total is None else total,
            }
        )
    return out

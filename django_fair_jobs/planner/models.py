"""The planner's schema: a job held in its tenant's virtual queue, each tenant's virtual
time, and each planned task's run lock (layer 1, like the rest of the schema; exported by
:mod:`django_fair_jobs.models`)."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now

from django_fair_jobs.tenants import TENANT_MAX_LENGTH


class PlannedJob(models.Model):
    """A job held back by its task's fair planner: in its tenant's virtual queue until
    promoted (``promoted_at`` empty), then on the broker until it starts (the row is
    deleted when the job starts, so promoted rows measure the queue's latency).

    ``signature`` re-publishes the job unchanged: task id, arguments, queue, priority,
    headers, links. ``not_before`` holds a countdown or ETA: the job is not promoted
    before it.

    A publish that fails for the job itself (a serializer refuses its arguments, the
    broker refuses its size) counts in ``attempts`` and keeps its ``last_error``; after
    :data:`~django_fair_jobs.planner.PUBLISH_ATTEMPTS` of them the job is **failed**
    (``failed_at`` set): never promoted again, kept for the operator to read, put back in
    line (admin action) or delete."""

    task_name = models.CharField(max_length=255)
    tenant = models.CharField(max_length=TENANT_MAX_LENGTH)
    queue = models.CharField(max_length=255, help_text="Where the job goes when promoted.")
    task_id = models.CharField(max_length=255, unique=True)
    signature = models.TextField()
    not_before = models.DateTimeField(null=True, blank=True)
    enqueued_at = models.DateTimeField(db_default=Now())
    promoted_at = models.DateTimeField(null=True, blank=True)
    # Defaults in the database too: rows inserted by code that predates these columns (a
    # worker not yet upgraded during a rolling deploy, a bulk load in SQL) still insert.
    attempts = models.PositiveSmallIntegerField(
        default=0,
        db_default=0,
        help_text="Publishes that failed for this job (a broker outage is not counted).",
    )
    failed_at = models.DateTimeField(
        null=True, blank=True, help_text="Failed for good: promotion skips it."
    )
    last_error = models.TextField(blank=True, default="", db_default="")

    class Meta:
        db_table = "fair_jobs_plannedjob"
        verbose_name = "planned job"
        indexes = [
            # A tenant's virtual queue, FIFO: WHERE task_name, tenant, not promoted ORDER BY id.
            models.Index(
                fields=["task_name", "tenant", "id"],
                name="fair_jobs_planned_pending",
                condition=models.Q(promoted_at__isnull=True),
            ),
            # Latency: the oldest promoted, not yet started job of a queue.
            models.Index(
                fields=["queue", "promoted_at"],
                name="fair_jobs_planned_promoted",
                condition=models.Q(promoted_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}] for {self.tenant}"


class PlannerTenant(models.Model):
    """A tenant's standing in one task's planner: its virtual time (``pass_value``: the
    weighted count of its promotions, which is what gives the planner memory across runs)
    and whether an operator paused its promotion."""

    task_name = models.CharField(max_length=255)
    tenant = models.CharField(max_length=TENANT_MAX_LENGTH)
    pass_value = models.FloatField(default=0.0)
    paused = models.BooleanField(
        default=False, help_text="Paused tenants keep their jobs but are never promoted."
    )
    promoted_total = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "fair_jobs_plannertenant"
        verbose_name = "planner tenant"
        constraints = [
            models.UniqueConstraint(
                fields=["task_name", "tenant"], name="fair_jobs_planner_tenant_task"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} in {self.task_name}"


class PlannerRun(models.Model):
    """One task's planner: when it runs next, who holds its lock until when, the virtual
    time of its tenants, and what its last run did."""

    task_name = models.CharField(max_length=255, primary_key=True)
    next_run_at = models.DateTimeField(db_default=Now())
    locked_until = models.DateTimeField(null=True, blank=True)
    lock_token = models.UUIDField(null=True, blank=True)
    virtual_time = models.FloatField(default=0.0)
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_promoted = models.PositiveIntegerField(default=0)
    last_latency = models.FloatField(null=True, blank=True)
    last_skipped = models.BooleanField(
        default=False, help_text="The last run promoted nothing because of backpressure."
    )
    runs_total = models.PositiveBigIntegerField(db_default=0, help_text="Runs ever finished.")

    class Meta:
        db_table = "fair_jobs_plannerrun"
        verbose_name = "planner run"

    def __str__(self) -> str:
        return self.task_name

"""The rows of fair dispatch: each queue's capacity, each tenant's line, each job.

A job's state says where it is: ``SCHEDULED`` (a countdown or ETA not yet due, or a job
stored inside its caller's transaction and not yet in its line), ``WAITING`` (due, in its
tenant's line), ``DISPATCHED`` (published, not yet started), ``RUNNING``, ``FAILED`` (its
message could never be published). A job's row is deleted when it ends. A line's
``in_flight`` counts its jobs dispatched or running and ``waiting`` its jobs waiting; both
only change inside the statements of :mod:`django_fair_jobs.dispatch.store` (one
transaction each), and maintenance recounts them from the job rows. A queue's jobs in
flight are counted from the job rows: no step of a job writes its queue's row.
"""

from __future__ import annotations

from django.db import models
from django.db.models import F
from django.db.models.functions import Floor, Now

from django_fair_jobs.tenants import TENANT_MAX_LENGTH

#: A tenant's jobs in flight per weight, rounded down: the first key of the selection
#: rule. ``dispatch.sql`` and the test of the plan spell it ``floor(t.in_flight / t.weight)``
#: so that PostgreSQL matches the index.
LOAD = Floor(F("in_flight") / F("weight"))

SCHEDULED, WAITING, DISPATCHED, RUNNING, FAILED = 0, 1, 2, 3, 4
STATES = ((SCHEDULED, "scheduled"), (WAITING, "waiting"), (DISPATCHED, "dispatched"),
          (RUNNING, "running"), (FAILED, "failed"))  # fmt: skip

#: What the reap does with a running job whose process died: drop it (Celery acknowledged
#: it at start), put it back in line when its whole node is gone (``acks_late``: the broker
#: redelivers an unacknowledged message), or always (``acks_late`` with
#: ``reject_on_worker_lost``: Celery rejects a lost pool child's job back to the queue).
DROP_ON_LOSS, REQUEUE_IF_NODE_LOST, REQUEUE_ON_LOSS = 0, 1, 2

#: Why a job ended failed: its message could not be published (``PUBLISH_ATTEMPTS`` times,
#: by errors of its own), or the worker that received it had no task of its name.
FAILURES = (("", ""), ("publish", "its message could not be published"),
            ("unregistered", "its task was not registered on the worker"))  # fmt: skip


class DispatchQueue(models.Model):
    """One Celery queue's capacity: the live worker processes that consume it, their nodes
    and the slack. Written by maintenance only (a worker process starting or stopping, the
    maintenance pass); no step of a job writes or locks it."""

    queue = models.CharField(max_length=255, primary_key=True)
    capacity = models.PositiveIntegerField(
        default=0, help_text="Worker processes (or threads) that consume this queue, alive."
    )
    slack = models.PositiveIntegerField(
        default=0,
        help_text="Messages allowed beyond the capacity, so that a freed process finds its "
        "next job already delivered (FAIR_JOBS_DISPATCH_SLACK per live worker node).",
    )
    nodes = models.PositiveIntegerField(
        default=0, help_text="Live worker nodes that consume this queue (per-worker limits)."
    )
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "fair_jobs_dispatchqueue"
        verbose_name = "dispatch queue"

    def __str__(self) -> str:
        return self.queue


class DispatchTenant(models.Model):
    """One tenant's line on one queue: its jobs waiting and in flight, its weight, its
    virtual time, and the id of its oldest waiting job."""

    queue = models.CharField(max_length=255)
    tenant = models.CharField(max_length=TENANT_MAX_LENGTH)
    weight = models.FloatField(default=1.0)
    cap = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The fair_max_jobs of the task of the line's oldest waiting job; a tenant "
        "slot's max_jobs override wins. Empty: no tenant cap.",
    )
    blocked = models.BooleanField(
        default=False,
        help_text="At its cap, paused, or refused by the fence: out of the selection until "
        "its room comes back (an end of its jobs, a limit changed, the maintenance pass).",
    )
    waiting = models.PositiveIntegerField(default=0)
    in_flight = models.PositiveIntegerField(default=0)
    pass_value = models.FloatField(default=0.0)
    served_pass = models.FloatField(
        default=0.0, help_text="The pass at which the line was last served (stride floor)."
    )
    head_id = models.BigIntegerField(null=True, blank=True)
    dispatched_total = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "fair_jobs_dispatchtenant"
        verbose_name = "dispatch tenant"
        # Cancelling a tenant's backlog (admin action, django_fair_jobs.backlog) drops
        # jobs of every mechanism: a permission of its own, not any one table's delete.
        permissions = [("cancel_backlog", "Can cancel a tenant's waiting jobs")]
        constraints = [
            models.UniqueConstraint(fields=["queue", "tenant"], name="fair_jobs_dispatch_tenant"),
        ]
        indexes = [
            # The selection rule, in index order: fewest in flight per weight (LOAD),
            # lowest virtual time, oldest job; only tenants with jobs waiting (a head) and
            # not blocked, so that tenants that cannot be chosen are never read. The
            # condition names the head, not the count of jobs waiting: an enqueue behind
            # the head changes only that count, which no index names, so PostgreSQL
            # updates the line in place (HOT) and writes no index entry. An expression,
            # not a generated column: Django's check of a generated column asks the
            # database for its features, so a worker could not start while the database
            # is down.
            models.Index(
                F("queue"),
                LOAD,
                F("pass_value"),
                F("head_id"),
                name="fair_jobs_dispatch_next",
                condition=models.Q(head_id__isnull=False, blocked=False),
            ),
            # The queue's virtual time: the highest pass served (fair_jobs_dispatch_vt).
            models.Index(fields=["queue", "served_pass"], name="fair_jobs_dispatch_served"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} on {self.queue}"


class DispatchJob(models.Model):
    """A job of a task with ``fair_dispatch``, from ``delay()`` to its end.

    ``message`` is the job's Celery message, built at ``delay()`` (task id, arguments,
    headers, links, routing) and published as it is when the job is dispatched."""

    queue = models.CharField(max_length=255)
    tenant = models.CharField(max_length=TENANT_MAX_LENGTH)
    task_name = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255)
    message = models.TextField()
    state = models.SmallIntegerField(choices=STATES, default=WAITING)
    not_before = models.DateTimeField(null=True, blank=True)
    enqueued_at = models.DateTimeField(db_default=Now())
    dispatched_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    process_id = models.UUIDField(null=True, blank=True)
    dispatched_by = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="The job whose end made the room this one was dispatched into "
        "(negative: the number drawn by a dispatch or an enqueue; empty for a bulk "
        "enqueue's), so that the step, sent again after its reply was lost, publishes it.",
    )
    publish_failures = models.PositiveIntegerField(default=0)
    failure = models.CharField(
        max_length=16,
        blank=True,
        choices=FAILURES,
        db_default="",
        help_text="Why it ended failed: 'publish' (its message could not be published) or "
        "'unregistered' (the worker that received it had no task of its name).",
    )
    republished = models.PositiveIntegerField(
        default=0, help_text="Copies published by the lost-message repair (each doubles its wait)."
    )
    cap = models.PositiveIntegerField(
        null=True, blank=True, help_text="The task's fair_max_jobs at delay(). Empty: no cap."
    )
    weight = models.FloatField(
        null=True, blank=True, help_text="The tenant's weight asked at delay(), if asked."
    )
    on_loss = models.SmallIntegerField(
        default=DROP_ON_LOSS,
        help_text="What the reap does if the job's process dies: 0 drop, 1 back in line if "
        "its node is gone (acks_late), 2 back in line (acks_late, reject_on_worker_lost).",
    )

    class Meta:
        db_table = "fair_jobs_dispatchjob"
        verbose_name = "dispatch job"
        indexes = [
            # A tenant's line, FIFO.
            models.Index(
                fields=["queue", "tenant", "id"],
                name="fair_jobs_dispatch_line",
                condition=models.Q(state=WAITING),
            ),
            # Countdowns and ETAs that come due.
            models.Index(
                fields=["queue", "not_before"],
                name="fair_jobs_dispatch_due",
                condition=models.Q(state=SCHEDULED),
            ),
            # Jobs in flight (few: at most the capacity plus the slack per queue), counted
            # for a queue's room.
            models.Index(
                fields=["queue", "tenant", "state"],
                name="fair_jobs_dispatch_flight",
                condition=models.Q(state__in=[DISPATCHED, RUNNING]),
            ),
            models.Index(fields=["task_id"], name="fair_jobs_dispatch_task"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}] for {self.tenant}"


class DispatchReceipt(models.Model):
    """The number an enqueue drew, stored in the enqueue's own transaction and kept for
    ``RECEIPT_SECONDS``: the enqueue, sent again after its reply was lost, finds it
    whatever became of its job since (dispatched, run and ended, cancelled), and waits for
    its first try to end while that try has not committed (the key)."""

    drawn = models.BigIntegerField(primary_key=True)
    stored_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "fair_jobs_dispatchreceipt"
        verbose_name = "enqueue receipt"

    def __str__(self) -> str:
        return str(self.drawn)


#: How long an enqueue's receipt is kept: far longer than the pause before an enqueue is
#: sent again (0.25 s) and its lock timeout (2 s); the maintenance pass deletes older ones.
RECEIPT_SECONDS = 600

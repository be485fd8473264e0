"""The rows that are django-fair-jobs' only coordination state.

* :class:`TenantQueueSlot`: one row per (tenant, queue): the limit and the counters.
* :class:`SlotLease`: one row per job holding (or reserved) a slot; the fence for release.
* :class:`ParkedJob`: a job deferred because its tenant was at its limit.
* :class:`WorkerProcess`: one row per process that runs fair tasks, kept alive by heartbeats.
* :class:`TenantWindow`, :class:`WindowBucket`: enqueue counts for rerouting rules.
* :class:`RerouteCount`: how many jobs each rule rerouted, per tenant and task.
* :class:`QueueLimit`: one row per limited queue: its limits and counters.
* :class:`PlannedJob`, :class:`PlannerTenant`, :class:`PlannerRun`: the fair planner's
  virtual queues, tenants' standing and runs.
* :class:`DispatchQueue`, :class:`DispatchTenant`, :class:`DispatchJob`,
  :class:`DispatchReceipt`: fair dispatch's capacities, tenants' lines, jobs and enqueue
  receipts (defined in :mod:`django_fair_jobs.dispatch.models`).
* :class:`JobDecision`: what a rule did, or in shadow mode would have done, to one job.
* :class:`LimitChange`: the history of limit changes (who, what, when).
* :class:`WaitBucket`: the wait histogram's counts (enqueue to start), per queue and
  tenant class.
* :class:`Dashboard`: the admin's dashboard page (a proxy, for its permission).

This module is the schema only. The statements that change these rows live in each
mechanism's store (``slots/store.py``, ``queue_limits/store.py``, ``reroute/store.py``,
``planner/store.py``, ``dispatch/store.py``), in :mod:`django_fair_jobs.leases.store` for
what tenant slots and queue limits share, and in :mod:`django_fair_jobs.identity` for
worker processes.
"""

from __future__ import annotations

import uuid

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models.functions import Now

from django_fair_jobs.dispatch.models import (  # noqa: F401  (registered with the app)
    DispatchJob,
    DispatchQueue,
    DispatchReceipt,
    DispatchTenant,
)

# The planner's schema lives in its room; exported here with the rest.
from django_fair_jobs.planner.models import PlannedJob as PlannedJob
from django_fair_jobs.planner.models import PlannerRun as PlannerRun
from django_fair_jobs.planner.models import PlannerTenant as PlannerTenant
from django_fair_jobs.tenants import TENANT_MAX_LENGTH


class TenantQueueSlot(models.Model):
    """How many of one tenant's jobs may run at once on one queue, and how many do.

    ``current_jobs`` always equals the number of :class:`SlotLease` rows of the slot; it is
    only changed by the conditional UPDATEs in :mod:`django_fair_jobs.slots.store`.
    """

    tenant = models.CharField(max_length=TENANT_MAX_LENGTH)
    queue = models.CharField(max_length=255)
    max_jobs = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Override of the task's limit for this tenant. Empty: the task's "
        "fair_max_jobs (without one: FAIR_JOBS_DEFAULT_MAX_JOBS on tenant slots, no cap "
        "under fair dispatch). 0 pauses the tenant on this queue.",
    )
    default_max_jobs = models.PositiveIntegerField(
        default=1,
        editable=False,
        help_text="The limit the last acquiring job brought (a rerouting rule's max_jobs "
        "for a job it rerouted, else its task's fair_max_jobs, else the default setting); "
        "used when max_jobs is empty.",
    )
    current_jobs = models.PositiveIntegerField(default=0, editable=False)
    parked_jobs = models.PositiveIntegerField(
        default=0,
        editable=False,
        help_text="Jobs parked and not yet woken. Kept on this row so that a release sees "
        "a concurrent park under the row lock (no lost wake-up).",
    )
    deferred_total = models.PositiveBigIntegerField(
        default=0, editable=False, help_text="Jobs ever deferred because this slot was full."
    )
    boost_until = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="While set, max_jobs is a temporary boost; at this time a maintenance "
        "pass puts back the override it replaced (boost_restore).",
    )
    boost_restore = models.PositiveIntegerField(
        null=True,
        blank=True,
        editable=False,
        help_text="The max_jobs override to put back when the boost ends (empty: none).",
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "fair_jobs_tenantqueueslot"
        verbose_name = "tenant queue slot"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "queue"], name="fair_jobs_slot_tenant_queue"),
        ]
        indexes = [
            # The sweep looks for slots with parked jobs; most slots have none.
            models.Index(
                fields=["id"],
                name="fair_jobs_slot_parked",
                condition=models.Q(parked_jobs__gt=0),
            ),
            # Every maintenance pass looks for boosts that are due; few slots have one.
            models.Index(
                fields=["boost_until"],
                name="fair_jobs_slot_boost",
                condition=models.Q(boost_until__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} on {self.queue}"

    @property
    def effective_max_jobs(self) -> int:
        """The limit in force: the row's override, else the last task default seen."""
        return self.default_max_jobs if self.max_jobs is None else self.max_jobs


class WorkerProcess(models.Model):
    """A process that runs fair tasks (a prefork child, or a solo/threads worker).

    Its heartbeat thread refreshes ``last_heartbeat_at`` with the database clock; a row
    older than ``FAIR_JOBS_WORKER_TIMEOUT`` is presumed dead and its leases are reaped.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.CharField(max_length=255, help_text="Celery node name, e.g. celery@host.")
    node_id = models.UUIDField(
        default=uuid.uuid4,
        help_text="Identity of the worker node (one `celery worker` start): shared by the "
        "node's processes, new at every restart. Per-worker queue limits count by it.",
    )
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    queues = models.JSONField(
        default=list,
        blank=True,
        help_text="The queues the process consumes (fair dispatch's capacity).",
    )
    concurrency = models.PositiveIntegerField(
        default=1, help_text="Jobs the process runs at once (1 for a prefork child)."
    )
    started_at = models.DateTimeField(db_default=Now())
    last_heartbeat_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "fair_jobs_workerprocess"
        verbose_name = "worker process"
        verbose_name_plural = "worker processes"
        indexes = [models.Index(fields=["last_heartbeat_at"], name="fair_jobs_process_beat")]

    def __str__(self) -> str:
        return f"{self.node} pid {self.pid}"


class Maintenance(models.Model):
    """When a maintenance pass last ran cluster-wide: every process beats, but only the one
    whose conditional upsert claims the row runs the pass, once per interval."""

    name = models.CharField(max_length=64, primary_key=True)
    last_run_at = models.DateTimeField(db_default=Now())
    leases_reaped_total = models.PositiveBigIntegerField(
        db_default=0, help_text="Leases of dead workers released by passes of this name."
    )

    class Meta:
        db_table = "fair_jobs_maintenance"
        verbose_name = "maintenance run"

    def __str__(self) -> str:
        return f"{self.name} at {self.last_run_at}"


class QueueLimit(models.Model):
    """The limits of one queue and the jobs running from it, cluster-wide and per node.

    ``max_jobs`` caps the queue across every worker node, ``max_jobs_per_worker`` on each
    node; empty means no cap, 0 pauses the queue. Both are edited at runtime (admin,
    ``manage.py fair_jobs_limit``) and seeded from ``FAIR_JOBS_QUEUE_LIMITS`` and
    ``FAIR_JOBS_QUEUE_LIMITS_PER_WORKER`` only for queues that have no row. The counters are
    changed only by the statements of :mod:`django_fair_jobs.queue_limits.store`:
    ``current_jobs`` and ``running`` (jobs per node id) always match the leases that name
    this row.
    """

    queue = models.CharField(max_length=255, unique=True)
    max_jobs = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Jobs of this queue that may run at once across the cluster. "
        "Empty: no cluster-wide limit. 0 pauses the queue.",
    )
    max_jobs_per_worker = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Jobs of this queue that may run at once on one worker node (a `celery "
        "worker` instance, whatever its pool and concurrency). Empty: no per-worker limit.",
    )
    current_jobs = models.PositiveIntegerField(default=0, editable=False)
    running = models.JSONField(
        default=dict,
        editable=False,
        help_text="Jobs running per worker node id; kept on this row so that one row lock "
        "covers both limits.",
    )
    parked_jobs = models.PositiveIntegerField(
        default=0,
        editable=False,
        help_text="Jobs parked on this queue and not yet woken (kept on the row, so that a "
        "release sees a concurrent park under the row lock).",
    )
    deferred_total = models.PositiveBigIntegerField(
        default=0,
        editable=False,
        help_text="Jobs ever deferred (parked or postponed) because the queue was at a limit.",
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "fair_jobs_queuelimit"
        verbose_name = "queue limit"

    def __str__(self) -> str:
        return self.queue

    @property
    def limited(self) -> bool:
        """True if either limit is set (a row with both empty is stored as unlimited)."""
        return self.max_jobs is not None or self.max_jobs_per_worker is not None


class SlotLease(models.Model):
    """One job's hold on its slots: the holder's fence for release.

    A lease holds a tenant slot (``slot``), a place in a limited queue (``queue_limit``,
    counted on node ``node_id``), or both: a job takes both or neither, in one statement,
    and gives both back together. ``token`` changes every time the lease is (re)claimed,
    and release deletes the lease only with the holder's token, so a stale holder whose
    lease was reaped or taken over by a redelivery cannot release a second time. A lease
    with no ``process`` is a reservation made for a woken parked job that is on its way
    through the broker.
    """

    # PROTECT: deleting a slot that has holders or waiters would lose slots or jobs.
    slot = models.ForeignKey(
        TenantQueueSlot, on_delete=models.PROTECT, related_name="leases", null=True, blank=True
    )
    queue_limit = models.ForeignKey(
        QueueLimit, on_delete=models.PROTECT, related_name="leases", null=True, blank=True
    )
    node_id = models.UUIDField(
        null=True, blank=True, help_text="The node whose count in queue_limit.running this is."
    )
    task_id = models.CharField(max_length=255)
    token = models.UUIDField(default=uuid.uuid4)
    process = models.ForeignKey(
        WorkerProcess,
        null=True,
        blank=True,
        # Leases outlive their process row on purpose: only the reaper removes them, and
        # it gives their slots back in the same statement.
        on_delete=models.DO_NOTHING,
        related_name="leases",
        db_constraint=False,
    )
    acquired_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "fair_jobs_slotlease"
        verbose_name = "slot lease"
        constraints = [
            models.UniqueConstraint(fields=["slot", "task_id"], name="fair_jobs_lease_slot_task"),
            # A job without a tenant slot holds one place per queue, too.
            models.UniqueConstraint(
                fields=["queue_limit", "task_id"],
                name="fair_jobs_lease_queue_task",
                condition=models.Q(slot__isnull=True),
            ),
        ]
        # No secondary index: the table holds only running jobs, so the reaper's and the
        # revoke path's scans are short, and every index would be one more write on the
        # hot path of acquire.

    def __str__(self) -> str:
        return f"{self.task_id} on {self.slot_id or self.queue_limit_id}"


class ParkedJob(models.Model):
    """A job deferred because its tenant or its queue was at a limit, waiting for a slot.

    ``signature`` is the Celery signature that re-publishes the job unchanged (same task
    id, arguments, headers, links and retry count), serialized with kombu's JSON.
    ``woken_at`` is set when a release reserved a slot for the job and re-published it;
    the row is deleted when the job starts, so a late copy of a woken message finds no
    row (or a newer ``wake_count``) and is dropped instead of running twice.
    """

    slot = models.ForeignKey(
        TenantQueueSlot, on_delete=models.PROTECT, related_name="parked", null=True, blank=True
    )
    queue_limit = models.ForeignKey(
        QueueLimit,
        on_delete=models.PROTECT,
        related_name="parked",
        null=True,
        blank=True,
        help_text="Set when the job waits in its limited queue's line (for the queue, its "
        "node or its tenant); empty when it waits on its tenant slot alone.",
    )
    task_id = models.CharField(max_length=255, unique=True)
    task_name = models.CharField(max_length=255)
    signature = models.TextField()
    default_max_jobs = models.PositiveIntegerField()
    parked_at = models.DateTimeField(db_default=Now())
    woken_at = models.DateTimeField(null=True, blank=True)
    wake_count = models.PositiveIntegerField(
        default=0,
        help_text="How many times the job was woken; each re-published copy carries its "
        "number, and a copy that is not the latest (or whose row is gone) is dropped.",
    )

    class Meta:
        db_table = "fair_jobs_parkedjob"
        verbose_name = "parked job"
        indexes = [
            # Matches the wake query: WHERE slot_id = %s AND woken_at IS NULL ORDER BY id.
            models.Index(
                fields=["slot", "id"],
                name="fair_jobs_parked_waiting",
                condition=models.Q(woken_at__isnull=True),
            ),
            models.Index(
                fields=["queue_limit", "id"],
                name="fair_jobs_parked_queue",
                condition=models.Q(woken_at__isnull=True, queue_limit__isnull=False),
            ),
            models.Index(
                fields=["woken_at"],
                name="fair_jobs_parked_woken",
                condition=models.Q(woken_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"


class TenantWindow(models.Model):
    """How many jobs one tenant enqueued under one counting key, for rerouting rules.

    ``key`` is ``task:<task name>`` (the default), ``queue:<queue>`` or ``group:<name>``.
    ``total`` counts every enqueue ever recorded for the row; the buckets keep, per
    database-clock second, what ``total`` was after that second's last enqueue, so the
    count within any window is ``total`` minus the bucket just before the window: two
    index lookups however many jobs the window holds.
    """

    key = models.CharField(max_length=255)
    tenant = models.CharField(max_length=TENANT_MAX_LENGTH)
    total = models.PositiveBigIntegerField(default=0)
    last_second = models.BigIntegerField(
        help_text="Unix second (database clock) of the latest enqueue; never goes back."
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "fair_jobs_tenantwindow"
        verbose_name = "tenant window"
        constraints = [
            models.UniqueConstraint(fields=["key", "tenant"], name="fair_jobs_window_key_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} on {self.key}"


class WindowBucket(models.Model):
    """One second of a :class:`TenantWindow`: ``cum`` is the window's ``total`` after the
    last enqueue of that second. Buckets older than the maximum window are pruned, except
    the newest of them, which anchors the count of the longest window."""

    window = models.ForeignKey(TenantWindow, on_delete=models.CASCADE, related_name="buckets")
    second = models.BigIntegerField()
    cum = models.PositiveBigIntegerField()

    class Meta:
        db_table = "fair_jobs_windowbucket"
        verbose_name = "window bucket"
        constraints = [
            # Also the index of every lookup: newest bucket of a window before a second.
            models.UniqueConstraint(fields=["window", "second"], name="fair_jobs_bucket_second"),
        ]

    def __str__(self) -> str:
        return f"{self.window_id} @ {self.second}: {self.cum}"


class RerouteCount(models.Model):
    """How many of a tenant's jobs of one task a rule sent to a slower queue."""

    tenant = models.CharField(max_length=TENANT_MAX_LENGTH)
    task_name = models.CharField(max_length=255)
    queue = models.CharField(max_length=255)
    total = models.PositiveBigIntegerField(default=0)
    first_at = models.DateTimeField(db_default=Now())
    last_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "fair_jobs_reroutecount"
        verbose_name = "reroute count"
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "task_name", "queue"], name="fair_jobs_reroute_tenant_task"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} {self.task_name} -> {self.queue}"


class JobDecision(models.Model):
    """What a rule did to one job (a reroute), or in shadow mode (``FAIR_JOBS_ENFORCE =
    False``) would have done (defer, reroute, hold in a tenant's line or a virtual queue).
    Read by explain, the dashboard and the metrics; pruned after
    ``FAIR_JOBS_DECISION_RETENTION``. ``mechanism`` is ``slots``, ``queue_limit``,
    ``reroute``, ``planner`` or ``dispatch``."""

    at = models.DateTimeField(db_default=Now())
    task_id = models.CharField(max_length=255)
    task_name = models.CharField(max_length=255)
    tenant = models.CharField(max_length=TENANT_MAX_LENGTH, blank=True, help_text="Empty: none.")
    queue = models.CharField(max_length=255)
    mechanism = models.CharField(max_length=32)
    action = models.CharField(max_length=32, help_text="rerouted, defer, reroute or hold.")
    enforced = models.BooleanField(help_text="False: shadow mode, nothing was done.")
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "fair_jobs_jobdecision"
        verbose_name = "job decision"
        indexes = [
            models.Index(fields=["task_id"], name="fair_jobs_decision_task"),
            models.Index(fields=["at"], name="fair_jobs_decision_at"),
        ]

    def __str__(self) -> str:
        done = "" if self.enforced else " (shadow)"
        return f"{self.task_id}: {self.mechanism} {self.action}{done}"


class LimitChange(models.Model):
    """One change of a limit: a tenant slot's ``max_jobs`` (and boosts) or a queue's
    limits, with who made it, from where, and when."""

    at = models.DateTimeField(db_default=Now())
    user = models.CharField(max_length=150, blank=True, help_text="Empty: not a person.")
    source = models.CharField(
        max_length=32, help_text="admin, command, python or maintenance (a boost that ended)."
    )
    tenant = models.CharField(
        max_length=TENANT_MAX_LENGTH, blank=True, help_text="Empty: a queue's limit."
    )
    queue = models.CharField(max_length=255)
    field = models.CharField(max_length=64)
    old_value = models.CharField(max_length=64, blank=True)
    new_value = models.CharField(max_length=64, blank=True)
    note = models.CharField(max_length=255, blank=True)

    class Meta:
        db_table = "fair_jobs_limitchange"
        verbose_name = "limit change"
        ordering = ("-at", "-id")
        indexes = [models.Index(fields=["at"], name="fair_jobs_limitchange_at")]

    def __str__(self) -> str:
        who = f"{self.tenant} on {self.queue}" if self.tenant else self.queue
        return f"{who}: {self.field} {self.old_value or '-'} -> {self.new_value or '-'}"

    @classmethod
    def record(
        cls,
        *,
        queue: str,
        field: str,
        old: object,
        new: object,
        tenant: str = "",
        user: str = "",
        source: str = "python",
        note: str = "",
    ) -> LimitChange | None:
        """Add a line to the history if the value changed (None shows as empty)."""
        old_text, new_text = _shown(old), _shown(new)
        if old_text == new_text and not note:
            return None
        return cls.objects.create(
            queue=queue, field=field, old_value=old_text, new_value=new_text, tenant=tenant,
            user=user[:150], source=source, note=note[:255],
        )  # fmt: skip


def _shown(value: object) -> str:
    return "" if value is None else str(value)[:64]


class WaitBucket(models.Model):
    """One bucket of the enqueue-to-start wait histogram of a queue and tenant class:
    how many jobs started after waiting at most ``BUCKETS[bucket]`` seconds (and more
    than the bucket below), and their waits' sum. Written by
    :func:`django_fair_jobs.waits.flush`; read by the metrics exporter."""

    queue = models.CharField(max_length=255)
    tenant_class = models.CharField(max_length=100)
    bucket = models.PositiveSmallIntegerField(help_text="Index into waits.BUCKETS.")
    count = models.PositiveBigIntegerField(default=0)
    total_seconds = models.FloatField(default=0.0)

    class Meta:
        db_table = "fair_jobs_waitbucket"
        verbose_name = "wait histogram bucket"
        constraints = [
            models.UniqueConstraint(
                fields=["queue", "tenant_class", "bucket"], name="fair_jobs_waitbucket_key"
            )
        ]

    def __str__(self) -> str:
        return f"{self.queue} / {self.tenant_class} / {self.bucket}"


class Dashboard(TenantQueueSlot):
    """The admin dashboard (no table of its own): its ``view`` permission gates the page."""

    class Meta:
        proxy = True
        verbose_name = verbose_name_plural = "dashboard"

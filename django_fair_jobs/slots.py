"""Mechanism A, tenant concurrency slots: acquire, defer, release, wake.

The protocol, each step one statement on PostgreSQL (see ``sql/postgresql.sql``):

1. **acquire**: a conditional increment of the (tenant, queue) row plus a lease row.
2. If that fails, **defer**: ``park`` stores the job's signature in ``fair_jobs_parkedjob``
   (only if the slot is still full under the row lock, else acquire again), or ``retry``
   re-publishes it with a jittered countdown. The message is then acknowledged.
3. **release**: delete the holder's lease (fenced by its token) and decrement; if jobs are
   parked on the slot, **wake** the oldest: take the slot on its behalf, reserve a lease
   for it, and re-publish its signature at once.

Parked jobs keep their task id, arguments, headers, links and retry count. Deferral never
consumes ``max_retries``.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from typing import TYPE_CHECKING, Any

from celery import Task as CeleryTask
from django.db import DatabaseError, DataError
from kombu.exceptions import EncodeError
from kombu.utils.json import dumps

from django_fair_jobs import decisions, identity, messages
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.conf import MAX_LIMIT, fair_settings
from django_fair_jobs.db import after_commit
from django_fair_jobs.errors import (
    TenantLimitError as TenantLimitError,
)
from django_fair_jobs.managers import Acquisition, Grant, LimitedAcquisition
from django_fair_jobs.tenants import for_log

if TYPE_CHECKING:
    from datetime import datetime

    from celery import Celery, Task

    from django_fair_jobs.models import TenantQueueSlot

logger = logging.getLogger("django_fair_jobs.slots")

DEFERRALS_HEADER = fair_headers.DEFERRALS
"""The old name of :data:`django_fair_jobs.headers.DEFERRALS`."""

WAKE_HEADER = fair_headers.WAKE
"""The old name of :data:`django_fair_jobs.headers.WAKE`."""

_PARK_ATTEMPTS = 20
"""How often park may answer "room" (a slot freed meanwhile) before we park anyway and
leave the job to the sweep. Each "room" means the slot changed hands, so this is only
reached under extreme churn."""

_pending_releases: list[Grant] = []
_pending_lock = threading.Lock()

_uncertain: set[tuple[str, uuid.UUID]] = set()
"""(task id, process id) of acquires that failed with a database error in this process:
one may have committed with its reply lost (a failover, a pooler restart), leaving a lease
held by this live process under a token nobody has. It is given back at the next
heartbeat, or before the job's next copy starts here. Guarded by ``_pending_lock``."""

_running: set[str] = set()
"""Task ids of the jobs holding a grant in this process (``enter`` to ``release``): their
leases are never mistaken for those of a lost reply. Guarded by ``_pending_lock``."""


def request_queue(task: Task[Any, Any]) -> str:
    """The queue the current job of ``task`` was delivered from: the delivery's routing
    key (the queue's name with Celery's default direct exchanges), else the task's
    declared queue, else ``task_default_queue``."""
    info = task.request.delivery_info or {}
    queue = info.get("routing_key") or getattr(task, "queue", None)
    return str(queue or task.app.conf.task_default_queue)


def is_woken(task: Task[Any, Any]) -> bool:
    """True if the current job of ``task`` is a woken parked job's copy: such a copy runs
    only while its parked row exists, and consumes it. A redelivery (its holder died
    before acknowledging) is a fresh start instead: the parked row went when the job first
    started, so as a woken copy it would be dropped as stale and the job lost."""
    return fair_headers.is_woken(task.request)


def enter(
    task: Task[Any, Any],
    *,
    tenant: str | None,
    queue: str,
    limit: int,
    on_limit: str,
    retry_countdown: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Grant | None:
    """Take a slot for the current job of ``task``, or deal with the delivery.

    On a limited queue (:mod:`django_fair_jobs.limits`) the job takes its place in the
    queue and, with a ``tenant``, its tenant slot, both or neither; elsewhere its tenant
    slot alone (a job without a tenant on an unlimited queue gets an empty grant).

    Returns a :class:`Grant` when the job may run. None means the message must be
    acknowledged without running: the job was parked or rescheduled (its tenant or its
    queue is at its limit), postponed (a duplicate delivery, or the database is
    unreachable), or dropped (a stale copy of a woken job). No path loses the job.
    """
    request = task.request
    woken = is_woken(task)
    task_id = str(request.id)
    try:
        with _pending_lock:
            lost = [pid for (uncertain_id, pid) in _uncertain if uncertain_id == task_id]
        for process_id in lost:  # this job's own lease from a lost reply would refuse it
            _drop_uncertain([task_id], process_id)
        acquired = acquire(
            tenant=tenant, queue=queue, task_id=task_id, limit=limit,
            node=request.hostname, woken=woken,
        )  # fmt: skip
        if acquired.grant is not None:
            with _pending_lock:
                _running.add(task_id)
            return acquired.grant
        if acquired.status not in ("full", "queue_full"):
            refuse(task, acquired.status, args, kwargs, woken=woken)
            return None
        if not decisions.enforcing():
            return shadow_grant(task, acquired.status, tenant=tenant, queue=queue, limit=limit)
        return defer(
            task, tenant=tenant, queue=queue, limit=limit, on_limit=on_limit,
            retry_countdown=retry_countdown, args=args, kwargs=kwargs, woken=woken,
        )  # fmt: skip
    except DataError:
        # A value the database refuses is refused again at every attempt: postponing the
        # job would repeat forever, so it fails here, with the database's reason.
        logger.exception("%s[%s]: the database refused the job's slot", task.name, request.id)
        raise
    except DatabaseError as exc:
        # The acquire may have committed with its reply lost: give its lease back later.
        # A process that never registered cannot have taken one.
        holder = identity.registered_process_id()
        if holder is not None:
            with _pending_lock:
                _uncertain.add((task_id, holder))
        # Without the database no slot can be taken; failing the task would lose the job
        # (its message is acknowledged), so it goes back through the broker, which needs no
        # database. If it was parked before the error, the copy that starts first deletes
        # the parked row, so it still runs once.
        postpone(
            task, args, kwargs, countdown=retry_countdown,
            reason=f"database unavailable ({exc.__class__.__name__}: {exc})".strip(),
        )  # fmt: skip
        return None


def shadow_grant(
    task: Task[Any, Any], status: str, *, tenant: str | None, queue: str, limit: int
) -> Grant:
    """Shadow mode: record that the current job would have been deferred (its tenant or
    its queue is at its limit) and let it run without a slot: an empty grant, so that its
    release gives back nothing and the counters keep counting only jobs within limits."""
    mechanism = "queue_limit" if status == "queue_full" else "slots"
    decisions.record(
        task_id=str(task.request.id), task_name=task.name, tenant=tenant, queue=queue,
        mechanism=mechanism, action="defer", detail={"limit": limit},
    )  # fmt: skip
    return Grant(None, str(task.request.id), uuid.uuid4())


def acquire(
    *, tenant: str | None, queue: str, task_id: str, limit: int, node: str | None, woken: bool
) -> Acquisition | LimitedAcquisition:
    """Take the slots of ``task_id`` on ``queue``: its place in the queue if the queue is
    limited, and ``tenant``'s slot (``woken``: the message is a re-published parked job)."""
    from django_fair_jobs import limits
    from django_fair_jobs.models import ParkedJob, TenantQueueSlot

    if limits.is_limited(queue):
        acquired = limits.acquire(
            queue=queue, tenant=tenant, limit=limit, task_id=task_id, node=node, woken=woken
        )
        if acquired.status != "unlimited":
            return acquired
    if tenant is None:
        # No slot to take. A woken job (its queue's limit was cleared while it waited)
        # takes its parked row with it; a copy that finds none was started already.
        if woken and not ParkedJob.objects.filter(task_id=task_id).delete()[0]:
            return Acquisition("stale")
        return Acquisition("held", Grant(None, task_id, uuid.uuid4()))
    return TenantQueueSlot.objects.try_acquire(
        tenant=tenant,
        queue=queue,
        task_id=task_id,
        limit=limit,
        process_id=identity.current_process_id(node),
        timeout=fair_settings.WORKER_TIMEOUT,
        woken=woken,
    )


def postpone(
    task: Task[Any, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    countdown: float,
    reason: str,
) -> None:
    """Re-publish the current job unchanged (same task id, same ``retries``) to come back
    after ``countdown`` seconds. Needs only the broker, not the database."""
    request = task.request
    logger.warning(
        "%s[%s]: %s; re-published to run in %.1f s", task.name, request.id, reason, countdown
    )
    # A woken copy stays marked as one, so that it still cannot run after another copy. A
    # redelivery is a fresh start (see is_woken) and must come back as one: unmarked.
    headers = dict(request.headers or {})
    wake = headers.pop(fair_headers.WAKE, None) if is_woken(task) else None
    headers.pop(fair_headers.WAKE, None)
    sig = task.signature_from_request(request, args, kwargs, countdown=countdown, headers=headers)
    messages.send(sig, task, wake)


def refuse(
    task: Task[Any, Any],
    status: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    woken: bool,
) -> None:
    """Deal with a delivery that must not run now (acquire said ``duplicate`` or ``stale``).

    A copy of a woken job is dropped: the copy that started deleted the parked row, so
    this one has nothing left to do. A duplicate of a fresh job (the broker delivered it
    twice) is postponed by ``FAIR_JOBS_WORKER_TIMEOUT``: if the running copy's process dies
    meanwhile, its lease is reaped by then and this copy runs; if it lives, this copy runs
    after it, never beside it.
    """
    request = task.request
    if status == "stale" or woken:
        logger.info(
            "%s[%s]: %s copy of a woken job dropped (another copy started it)",
            task.name, request.id, status,
        )  # fmt: skip
        return
    postpone(
        task, args, kwargs, countdown=fair_settings.WORKER_TIMEOUT,
        reason="already running in a live worker",
    )  # fmt: skip


def defer(
    task: Task[Any, Any],
    *,
    tenant: str | None,
    queue: str,
    limit: int,
    on_limit: str,
    retry_countdown: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    woken: bool,
) -> Grant | None:
    """Defer the current job of ``task`` because its tenant or its queue is at a limit.

    Returns a :class:`Grant` if a slot freed while parking (run the job now), else None
    (the job is parked or rescheduled; acknowledge the message without running it).
    """
    from django_fair_jobs import limits
    from django_fair_jobs.models import QueueLimit, TenantQueueSlot

    request = task.request
    limited = limits.is_limited(queue)
    deferrals = int((request.headers or {}).get(fair_headers.DEFERRALS) or 0) + 1
    headers = {**(request.headers or {}), fair_headers.DEFERRALS: deferrals}
    headers.pop(fair_headers.WAKE, None)
    signature = None
    if on_limit != "retry":
        try:
            signature = dumps(
                dict(task.signature_from_request(request, args, kwargs, headers=headers))
            )
        except (TypeError, ValueError) as exc:
            # Only a job published by name with a serializer richer than JSON gets here
            # (FairTask.apply_async refuses such arguments): it cannot be stored, so it
            # waits through the broker instead, never lost.
            logger.warning(
                "%s[%s]: cannot park (%s: its arguments are not JSON); re-published to "
                "retry in %.1f s instead", task.name, request.id, exc, retry_countdown,
            )  # fmt: skip
    if signature is None:
        countdown = retry_countdown * random.uniform(0.5, 1.5)
        # Like Task.retry(), but keeping request.retries: deferral is not a failure.
        sig = task.signature_from_request(
            request, args, kwargs, countdown=countdown, headers=headers
        )
        if limited:
            QueueLimit.objects.count_deferral(queue)
        elif tenant is not None:
            TenantQueueSlot.objects.count_deferral(tenant=tenant, queue=queue)
        try:
            sig.apply_async()
        except EncodeError:
            # Arguments JSON cannot store (FairArgumentsError): straight to the broker in
            # the job's own serializer, which FairTask.apply_async refuses at a first publish.
            CeleryTask.apply_async(task, sig.args, sig.kwargs, **sig.options)
        logger.debug(
            "Deferred %s[%s]: tenant %s at its limit on %s; retrying in %.1f s",
            task.name, request.id, for_log(tenant), queue, countdown,
        )  # fmt: skip
        return None
    for _ in range(_PARK_ATTEMPTS):
        if limited or tenant is None:
            outcome = limits.park(
                queue=queue, tenant=tenant, limit=limit, task_id=str(request.id),
                task_name=task.name, signature=signature, woken=woken,
            )  # fmt: skip
        else:
            outcome = TenantQueueSlot.objects.try_park(
                tenant=tenant, queue=queue, task_id=str(request.id), task_name=task.name,
                limit=limit, signature=signature, woken=woken,
            )  # fmt: skip
        if outcome == "stale":
            refuse(task, outcome, args, kwargs, woken=woken)
            return None
        if outcome != "room":
            logger.debug(
                "Deferred %s[%s]: tenant %s at its limit on %s; %s",
                task.name, request.id, for_log(tenant), queue, outcome.replace("_", " "),
            )  # fmt: skip
            return None
        again = acquire(
            tenant=tenant, queue=queue, task_id=str(request.id), limit=limit,
            node=request.hostname, woken=woken,
        )  # fmt: skip
        if again.grant is not None:
            return again.grant
        if again.status not in ("full", "queue_full"):
            refuse(task, again.status, args, kwargs, woken=woken)
            return None
    postpone(
        task, args, kwargs, countdown=retry_countdown,
        reason=f"could not park or start after {_PARK_ATTEMPTS} tries",
    )  # fmt: skip
    return None


def release(grant: Grant, app: Celery | None = None) -> None:
    """Give back ``grant``'s slots and wake the parked jobs that can now run.

    Never raises: a job that succeeded stays a success. A failed release is kept and
    retried by this process's heartbeat (no slot is lost); a failed wake-up is left to the
    maintenance sweep.
    """
    from django_fair_jobs.limits import wake_line
    from django_fair_jobs.models import QueueLimit, TenantQueueSlot

    with _pending_lock:
        _running.discard(grant.task_id)
    if grant.slot_id is None and grant.queue_limit_id is None:
        return  # the job held nothing (no tenant, no queue limit)
    in_line: int | None = 0
    try:
        if grant.queue_limit_id is not None:
            released = QueueLimit.objects.release(grant)
            in_line, parked = released if released is not None else (None, None)
        else:
            parked = TenantQueueSlot.objects.release(grant)
    except Exception:
        logger.exception("Could not release the slots of %s; will retry", grant.task_id)
        with _pending_lock:
            _pending_releases.append(grant)
        return
    if in_line is None or (grant.queue_limit_id is None and parked is None):
        logger.info(
            "Lease of %s was gone at release (reaped or taken over); nothing released",
            grant.task_id,
        )
        return
    try:
        if in_line and grant.queue_limit_id is not None:
            wake_line(grant.queue_limit_id, limit=1, app=app)
        if parked and grant.slot_id is not None:
            wake(grant.slot_id, limit=1, app=app)
    except Exception:
        logger.exception("Could not wake a parked job after %s; the sweep will", grant.task_id)


def retry_pending_releases() -> int:
    """Retry releases that failed earlier in this process, and give back the leases of
    acquires whose reply may have been lost; returns how many releases succeeded."""
    with _pending_lock:
        pending = list(_pending_releases)
        _pending_releases.clear()
        uncertain = sorted(_uncertain)
    done = 0
    for grant in pending:
        before = len(_pending_releases)
        release(grant)
        done += len(_pending_releases) == before
    by_process: dict[uuid.UUID, list[str]] = {}
    for task_id, process_id in uncertain:
        by_process.setdefault(process_id, []).append(task_id)
    for process_id, task_ids in by_process.items():
        try:
            _drop_uncertain(task_ids, process_id)
        except DatabaseError:
            logger.warning("Could not check %s lease(s) of lost replies yet", len(task_ids))
    return done


def _drop_uncertain(task_ids: list[str], process_id: uuid.UUID) -> None:
    """Give back the leases ``process_id`` may hold for ``task_ids`` from acquires whose
    reply was lost (none where the acquire did not commit), except those of jobs running
    here now; then wake jobs on the slots freed. One transaction for all of them. Raises
    DatabaseError (the entries stay for the next try)."""
    from django_fair_jobs.limits import wake_line
    from django_fair_jobs.models import SlotLease

    with _pending_lock:
        # A copy that took its slot since holds its own lease; leave it alone.
        orphans = [task_id for task_id in task_ids if task_id not in _running]
    slots, queues = SlotLease.objects.drop_held_by(orphans, process_id) if orphans else ([], [])
    with _pending_lock:
        _uncertain.difference_update((task_id, process_id) for task_id in task_ids)
    if slots or queues:
        logger.warning(
            "Gave back %s slot(s) of acquires whose reply was lost; their jobs can start",
            len(slots) + len(queues),
        )
    for queue_limit_id in queues:
        wake_line(queue_limit_id, limit=1)
    for slot_id in slots:
        wake(slot_id, limit=1)


def wake(slot_id: int, limit: int | None = 1, app: Celery | None = None) -> int:
    """Wake up to ``limit`` parked jobs of ``slot_id`` (None: as many as have room).

    Returns how many were re-published. Inside the caller's ``atomic()`` (an admin save,
    ``ATOMIC_REQUESTS``) the wake-up waits for the commit and 0 is returned: a reservation
    and a message sent before it would reach a worker that cannot see them yet.
    """
    from django.db import router

    from django_fair_jobs.models import TenantQueueSlot

    if after_commit(lambda: wake(slot_id, limit, app), router.db_for_write(TenantQueueSlot)):
        return 0
    woken = 0
    while limit is None or woken < limit:
        job = TenantQueueSlot.objects.wake_one(slot_id)
        if job is None:
            break
        messages.publish_woken(job, app=app)
        woken += 1
    return woken


publish = messages.publish_woken
"""The old name of :func:`django_fair_jobs.messages.publish_woken` (one release)."""


def forget_task(task_id: str, *, terminated: bool, app: Celery | None = None) -> None:
    """Drop a revoked job's parked row and reservations, and its running leases too if it
    was ``terminated``; wake jobs on the slots freed.

    A revoke without terminate (or an expired duplicate copy) leaves a running copy's
    lease alone: that copy still runs and releases it.
    """
    from django_fair_jobs.limits import wake_line
    from django_fair_jobs.models import ParkedJob, SlotLease

    ParkedJob.objects.forget(task_id)
    slots, queues = SlotLease.objects.drop_for_task(task_id, running=terminated)
    for queue_limit_id in queues:
        wake_line(queue_limit_id, limit=1, app=app)
    for slot_id in slots:
        wake(slot_id, limit=1, app=app)


def _check_limit(value: Any, what: str) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT
    ):
        raise TenantLimitError(
            f"{what} must be a whole number from 0 (0 pauses the tenant) to {MAX_LIMIT},"
            f" or None; got {value!r}."
        )


def set_tenant_limit(
    tenant: str,
    queue: str,
    max_jobs: int | None,
    *,
    user: str = "",
    source: str = "python",
    app: Celery | None = None,
) -> TenantQueueSlot:
    """Set ``tenant``'s ``max_jobs`` override on ``queue`` (None: the task's default; 0:
    paused), ending any boost; records the change in the limit history and wakes the
    parked jobs the new limit lets start. Creates the slot row if the tenant has none."""
    from django.db import transaction

    from django_fair_jobs.models import LimitChange, TenantQueueSlot

    _check_limit(max_jobs, "max_jobs")
    with transaction.atomic():
        row, _ = TenantQueueSlot.objects.get_or_create(tenant=tenant, queue=queue)
        row = TenantQueueSlot.objects.select_for_update().get(pk=row.pk)
        old = row.max_jobs
        TenantQueueSlot.objects.filter(pk=row.pk).update(
            max_jobs=max_jobs, boost_until=None, boost_restore=None
        )
        LimitChange.record(
            tenant=tenant, queue=queue, field="max_jobs", old=old, new=max_jobs, user=user,
            source=source, note="boost ended early" if row.boost_until is not None else "",
        )  # fmt: skip
    row.max_jobs, row.boost_until, row.boost_restore = max_jobs, None, None
    wake(row.pk, limit=None, app=app)
    return row


def boost(
    tenant: str,
    queue: str,
    max_jobs: int,
    until: datetime,
    *,
    user: str = "",
    source: str = "python",
    app: Celery | None = None,
) -> TenantQueueSlot:
    """Raise ``tenant``'s limit on ``queue`` to ``max_jobs`` until ``until`` (an aware
    datetime); then the maintenance pass puts back the override it replaced, by itself.

    Boosting a boosted tenant changes the boost and keeps the override to put back.
    Records the change and wakes the parked jobs the boost lets start.
    """
    from django.db import transaction

    from django_fair_jobs.managers import database_now
    from django_fair_jobs.models import LimitChange, TenantQueueSlot

    _check_limit(max_jobs, "A boost's max_jobs")
    if until.tzinfo is None:
        raise TenantLimitError("A boost's end must be an aware datetime (with a time zone).")
    if until <= database_now():
        raise TenantLimitError(f"A boost must end in the future; {until.isoformat()} is past.")
    with transaction.atomic():
        row, _ = TenantQueueSlot.objects.get_or_create(tenant=tenant, queue=queue)
        row = TenantQueueSlot.objects.select_for_update().get(pk=row.pk)
        restore = row.boost_restore if row.boost_until is not None else row.max_jobs
        TenantQueueSlot.objects.filter(pk=row.pk).update(
            max_jobs=max_jobs, boost_until=until, boost_restore=restore
        )
        LimitChange.record(
            tenant=tenant, queue=queue, field="max_jobs", old=row.max_jobs, new=max_jobs,
            user=user, source=source, note=f"boost until {until.isoformat()}",
        )  # fmt: skip
    row.max_jobs, row.boost_until, row.boost_restore = max_jobs, until, restore
    wake(row.pk, limit=None, app=app)
    return row


def end_boosts(app: Celery | None = None) -> int:
    """Put back the override of every boost whose time is up (database clock); returns
    how many ended. Run by the maintenance pass; safe to run from several processes."""
    from django.db import transaction
    from django.db.models.functions import Now

    from django_fair_jobs.models import LimitChange, TenantQueueSlot

    ended = 0
    # The database's clock in the statement itself: no extra round trip on every pass.
    due = TenantQueueSlot.objects.filter(boost_until__lte=Now())
    for pk in due.values_list("pk", flat=True):
        with transaction.atomic():
            row = due.select_for_update().filter(pk=pk).first()
            if row is None:
                continue  # another pass ended it, or it was changed meanwhile
            TenantQueueSlot.objects.filter(pk=pk).update(
                max_jobs=row.boost_restore, boost_until=None, boost_restore=None
            )
            LimitChange.record(
                tenant=row.tenant, queue=row.queue, field="max_jobs", old=row.max_jobs,
                new=row.boost_restore, source="maintenance", note="boost ended",
            )  # fmt: skip
        ended += 1
        wake(pk, limit=None, app=app)  # a lower limit wakes nothing; a higher one may
    return ended

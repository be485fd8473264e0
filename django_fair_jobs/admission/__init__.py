"""What happens when a job starts and ends: the hold protocol, read top to bottom.

The only module besides ``publishing`` that combines the mechanism rooms. A job's start:

1. :func:`enter` takes what the job needs (:func:`acquire`): on a limited queue its place
   in the queue and, with a tenant, its tenant slot, in one statement, both or neither
   (:mod:`django_fair_jobs.queue_limits`); elsewhere its tenant slot alone
   (:mod:`django_fair_jobs.slots`).
2. If the tenant or the queue is full, :func:`defer` parks the job in the slot's or the
   queue's line (or re-publishes it with a jittered countdown, ``fair_on_limit="retry"``);
   a duplicate or stale copy is dealt with by :func:`refuse`; with the database down the
   delivery is postponed through the broker (:func:`postpone`). No path loses the job.
3. The job runs; :func:`release` frees its slot and place, and wakes the parked jobs
   that can run now.

A dispatched job (``fair_dispatch``) marks its row running (one round trip; a second copy
of the message is dropped), takes its tenant slot when its task or slot has a cap and its
queue place on a limited queue (the fence that keeps the limits whatever was dispatched),
runs, and ends its row in the round trip that dispatches the next job
(:func:`dispatched_run`). :func:`holding` runs it all around a ``FairTask`` job. Plain
tasks on a limited queue (``FAIR_JOBS_LIMIT_PLAIN_TASKS``) go through :func:`enter` too.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject
from django.db import DatabaseError, DataError, InterfaceError, close_old_connections

from django_fair_jobs import (
    db,
    decisions,
    dispatch,
    identity,
    messages,
    planner,
    publishing,
    queue_limits,
    reroute,
    routing,
    slots,
    tenants,
    validation,
    waits,
)
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.admission import deferral, ends, flusher, handoff
from django_fair_jobs.admission.ends import confirm_releases as confirm_releases
from django_fair_jobs.admission.ends import drop_task as drop_task
from django_fair_jobs.admission.ends import end as end
from django_fair_jobs.admission.ends import release as release
from django_fair_jobs.admission.ends import retry_pending_ends as retry_pending_ends
from django_fair_jobs.admission.ends import retry_pending_releases as retry_pending_releases
from django_fair_jobs.admission.flusher import confirm_dispatch as confirm_dispatch
from django_fair_jobs.admission.handoff import release_kept as release_kept
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.errors import TaskIdError
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.leases.types import Acquisition, Grant, LimitedAcquisition
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.slots import store as slot_store
from django_fair_jobs.tenants import for_log, warn_missing_tenant

if TYPE_CHECKING:
    from celery import Task

logger = logging.getLogger("django_fair_jobs.admission")


def _process_id() -> uuid.UUID:
    return identity.current_process_id()


def keep_grant(task: Task[Any, Any], grant: Grant) -> None:
    """Note the running job's grant on its request, for :func:`release_held`."""
    # Context holds any attribute; setattr, as its stub declares only Celery's own.
    setattr(task.request, "fair_grant", grant)  # noqa: B010


def release_held(
    task: Task[Any, Any], *, tenant: str | None = None, queue: str | None = None
) -> None:
    """Release the running job's grant now, once: at its end, or before its retry is
    published (a retry that starts at once elsewhere must find the slot free, not held
    by this run, which would make it a duplicate and delay it by the worker timeout).
    Given the ``tenant`` and ``queue`` of a job that ended well, its slot may instead be
    kept for the process's next job (:mod:`~django_fair_jobs.admission.handoff`)."""
    grant = getattr(task.request, "fair_grant", None)
    if grant is not None:
        setattr(task.request, "fair_grant", None)  # noqa: B010
        if queue is not None and handoff.keep(grant, tenant=tenant, queue=queue, app=task.app):
            return
        ends.release(grant, app=task.app)


@contextmanager
def holding(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """The hold protocol around one run of a ``FairTask`` job: the job runs inside the
    ``with`` block once it holds what it needs, and gives it back when the block ends.

    Raises ``Ignore`` (the message is acknowledged without a state change, and
    ``AsyncResult`` keeps waiting for the job's real end) when the job must not run now:
    it was parked, rescheduled, postponed or rerouted under the same task id, or was a
    stale or duplicate copy. Eager calls (``apply()``, ``task_always_eager``) run at
    once, outside every limit: there is no message to park and the caller waits for it.
    """
    request = task.request
    if request.is_eager or request.id is None:
        yield
        return
    problem = validation.task_id_problem(request.id)
    if problem is not None:
        # Sent by name (apply_async refuses it): no slot or line can hold the job, and
        # postponing it would repeat forever; it fails, saying why.
        raise TaskIdError(f"{task.name}: {problem}.")
    marks = request.headers or {}
    # The mark, not the task's options, says the job was dispatched: its row exists, and a
    # worker whose settings make the task's default differ must still start it from there.
    if marks.get(fair_headers.DISPATCH) is not None:
        # Without a tenant it waited in the line of jobs without one: its publish warned.
        tenant = tenants.request_tenant(task, args, kwargs)
        queue = routing.request_queue(task)
        with dispatched_run(task, int(marks[fair_headers.DISPATCH]), tenant, queue):
            yield
        return
    if task.fair_plan and marks.get(fair_headers.PLAN) not in (None, fair_headers.PLAN_SHADOW):
        planner.started(str(request.id))
    tenant = tenants.request_tenant(task, args, kwargs)
    if (
        tenant is not None
        and task.fair_rules()
        and reroute.count_delivered(task, tenant, args, kwargs)
    ):
        raise Ignore()  # rerouted: its copy on the rule's queue runs instead
    if tenant is None:
        warn_missing_tenant(task.name)
    elif not task.fair_slots and fair_headers.MAX_JOBS not in (request.headers or {}):
        tenant = None  # rerouting only: no tenant slot
    queue = routing.request_queue(task)
    if tenant is None and not queue_limits.is_limited(queue) and not fair_headers.is_woken(request):
        started_now(task, queue, tenant)
        yield
        return
    grant = enter(
        task, tenant=tenant, queue=queue, limit=task.fair_limit(),
        on_limit=task.fair_on_limit or fair_settings.ON_LIMIT,
        retry_countdown=fair_settings.RETRY_COUNTDOWN
        if task.fair_retry_countdown is None else float(task.fair_retry_countdown),
        args=args, kwargs=kwargs,
    )  # fmt: skip
    if grant is None:
        raise Ignore()  # parked, rescheduled or postponed under the same task id
    keep_grant(task, grant)
    started_now(task, queue, tenant)
    try:
        yield
    except BaseException:
        release_held(task)
        raise
    release_held(task, tenant=tenant, queue=queue)  # it ended well: its slot may be kept


def started_now(task: Task[Any, Any], queue: str, tenant: str | None) -> None:
    """Count the job's wait from enqueue to this start in the wait histogram (in memory;
    see :mod:`django_fair_jobs.waits`). A retry's run is not a new wait."""
    request = task.request
    if request.retries:
        return
    enqueued_at = (request.headers or {}).get(fair_headers.ENQUEUED_AT)
    waits.observe(queue, tenant, enqueued_at, request.eta)


@contextmanager
def dispatched_run(
    task: Task[Any, Any],
    job_id: int,
    tenant: str | None,
    queue: str,
) -> Iterator[None]:
    """Hold a dispatched job's run: start its row, take the fence (its tenant slot with its
    task's cap, its queue place on a limited queue), let the job run, then end the row and
    publish the jobs its room went to.

    Raises ``Ignore`` (the message is acknowledged, nothing runs) for a second copy of a
    job; when the database cannot mark the start (the row is published again later, or
    goes back to its line at the next heartbeat); when the fence refuses or fails (the job
    goes back, its line out of the selection until its room comes back). A
    ``Reject(requeue=True)`` puts the row back in its line for the redelivered copy."""
    process = _process_id()
    task_id = str(task.request.id)
    if ends.ended_here(job_id) or not ends.claim_running(task_id):
        # A second copy delivered while the first runs here (threads pool), or after it
        # ended here while its end waits for the flusher.
        logger.info("Job %s (%s) runs in this process: this copy is dropped", job_id, task.name)
        raise Ignore()
    try:
        started = _start_dispatched(task, job_id, process)
        _dispatch_fence(task, job_id, process, started, tenant, queue)
        started_now(task, queue, tenant)
        outcome: dispatch.Outcome = "end"
        try:
            yield
        except Reject as exc:
            if getattr(exc, "requeue", False):  # Celery sets it; its stub does not say so
                outcome = "back"  # the broker redelivers the message; its row waits for it
            raise
        finally:
            release_held(task)
            _store_deferred_retries(task)
            # An end goes to the flusher thread, off the job's path; one that puts the job
            # back in its line is done now, before its redelivered copy can start.
            if not (outcome == "end" and flusher.hand(task.app, job_id, process)):
                ends.end(task, job_id, process, outcome=outcome)
    finally:
        ends.unmark_running(task_id)


def _start_dispatched(task: Task[Any, Any], job_id: int, process: uuid.UUID) -> dispatch.Started:
    """Mark a dispatched job's row running under ``process``; the first try carries the ends
    of this process's jobs its flusher has not flushed yet and is the connection's health
    check. After a database error (a failover or a pooler restart cuts the reply, often
    after the start committed: the next try answers "again") the flusher ends them itself
    and the start is sent again, at once on a new connection, then after each delay of
    ``REPLY_RETRY_DELAYS``. Raises ``Ignore`` for a copy that must not run, or when the
    database does not answer."""
    carrying = flusher.take(process)
    db.skip_health_check(dispatch.alias())
    try:
        for delay in (0.0, *REPLY_RETRY_DELAYS, None):
            try:
                asynchronous, ended = dispatch.commits_async(), [item[0] for item in carrying]
                started = dispatch.start(job_id, process, ended=ended, async_commit=asynchronous)
                break
            except (DatabaseError, InterfaceError):  # a closed connection raises the latter
                flusher.hand_back(carrying)
                carrying = []
                if delay is None:
                    logger.exception("Could not start dispatched job %s; goes back later", job_id)
                    ends.end_later(job_id, process, outcome="back")
                    raise Ignore() from None
                close_old_connections()
                time.sleep(delay)
    except BaseException:  # a time limit, a bug: the ends it carried are not lost
        flusher.hand_back(carrying)
        raise
    if carrying:
        flusher.carried(carrying, started.ready, asynchronous)
    # "again": its own start whose reply was lost (a copy here was refused before it asked).
    if started.status not in ("started", "again"):
        logger.info("Job %s (%s) ran, runs or is back in line: copy dropped", job_id, task.name)
        raise Ignore()
    ends.forget_end(job_id)  # a start that committed with its reply lost: it runs now
    if asynchronous:
        with ends.LEDGER.lock:
            ends.LEDGER.unconfirmed_starts[job_id] = process
    return started


def _dispatch_fence(
    task: Task[Any, Any],
    job_id: int,
    process: uuid.UUID,
    started: dispatch.Started,
    tenant: str | None,
    queue: str,
) -> None:
    """Take a started dispatched job's tenant slot (with its own task's cap, or its slot's
    override) and, on a limited queue, its queue place: the limits hold whatever was
    dispatched. Refused, the job goes aside for ``FENCE_DELAY`` and its line out of the
    selection until its room comes back; a database error puts it back in its line (a
    lease its acquire may have taken is released later). Either raises ``Ignore``."""
    capped = started.cap is not None and tenant is not None
    if not capped and not queue_limits.is_limited(queue):
        return
    try:
        acquired = acquire(
            tenant=tenant if capped else None, queue=queue, task_id=str(task.request.id),
            limit=started.cap or 0, node=task.request.hostname, woken=False,
        )  # fmt: skip
    except DatabaseError:
        logger.exception("The fence of dispatched job %s failed; it goes back in line", job_id)
        _uncertain_acquire(task, woken=False)
        ends.end(task, job_id, process, outcome="back")
        raise Ignore() from None
    if acquired.grant is None:
        # Taken between dispatch and start (another task's job, a lowered limit): nothing
        # is dispatched into the room it leaves, so its line does not cycle.
        ends.end(task, job_id, process, outcome="later", delay=dispatch.FENCE_DELAY, block=True)
        raise Ignore()
    keep_grant(task, acquired.grant)


def _store_deferred_retries(task: Task[Any, Any]) -> None:
    """Store the retries a dispatched job asked for inside its own ``atomic()`` block
    (:func:`~django_fair_jobs.publishing.hold_for_dispatch` kept them), now that the block
    is over, whether it committed or not: Celery's retry is in the broker either way."""
    for job in publishing.take_deferred_retries():
        dispatch.publish(task.app, dispatch.enqueue(job))


_PARK_ATTEMPTS = 20
"""How often park may answer "room" (a slot freed meanwhile) before we park anyway and
leave the job to the sweep. Each "room" means the slot changed hands, so this is only
reached under extreme churn."""

REPLY_RETRY_DELAYS = (0.25, 1.0)
"""Seconds to wait before each try of a job's admission after the first retry (at once,
on a new connection) after a database error (a restart of the database or of PgBouncer
cuts the reply, often after the statement committed). While the database answers within
these, the rows say what happened; past them the job goes back through the broker."""


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
    """Take a slot for the current job of ``task``, or deal with the delivery. On a limited
    queue (:mod:`django_fair_jobs.queue_limits`) the job takes its place in the queue and,
    with a ``tenant``, its tenant slot, both or neither; elsewhere its tenant slot alone (a
    job without a tenant on an unlimited queue gets an empty grant).

    Returns a :class:`Grant` when the job may run. None means the message must be
    acknowledged without running: the job was parked or rescheduled (its tenant or its
    queue is at its limit), postponed (a duplicate delivery, or the database is
    unreachable), or dropped (a stale copy of a woken job). No path loses the job.
    """
    woken = fair_headers.is_woken(task.request)
    for delay in (0.0, *REPLY_RETRY_DELAYS, None):  # a cut connection: at once, a new one
        db.skip_health_check(slot_store.alias())  # the acquire is the health check
        try:
            # A lease this job took from an acquire whose reply was cut is released
            # first; a woken copy whose claim it was took its parked row with it, so it
            # comes back as a fresh start rather than be dropped as a stale copy.
            if _drop_own_lease(task):
                woken = False
            return _admit(
                task, woken=woken, tenant=tenant, queue=queue, limit=limit,
                on_limit=on_limit, retry_countdown=retry_countdown, args=args, kwargs=kwargs,
            )  # fmt: skip
        except DataError:
            # A value the database refuses is refused again at every attempt: postponing
            # the job would repeat forever, so it fails here, with the database's reason.
            logger.exception("%s[%s]: the database refused the job's slot", task.name,
                             task.request.id)  # fmt: skip
            raise
        except (DatabaseError, InterfaceError) as exc:  # a closed connection: the latter
            _uncertain_acquire(task, woken=woken)
            if delay is not None:
                close_old_connections()  # the cut connection; the next try opens another
                time.sleep(delay)
                continue
            # Without the database no slot can be taken; failing the task would lose the
            # job (its message is acknowledged), so it goes back through the broker, which
            # needs no database. If its park committed before the error, the parked row is
            # woken as well: should this copy start first it deletes the row and the job
            # runs once, but should the woken copy run first, this one runs it again.
            messages.postpone(
                task, args, kwargs, countdown=retry_countdown, fresh=not woken,
                reason=f"database unavailable ({exc.__class__.__name__}: {exc})".strip(),
            )  # fmt: skip
    return None


def _uncertain_acquire(task: Task[Any, Any], *, woken: bool) -> None:
    """Note that the current job's acquire may have committed with its reply lost: its
    lease is released later (:func:`_drop_own_lease`, or the heartbeat's
    :func:`~django_fair_jobs.admission.ends.retry_pending_releases`), and, for a ``woken``
    copy's claim, its next copy here starts afresh. A process that never registered
    cannot have taken a lease."""
    holder = identity.registered_process_id()
    if holder is not None:
        ends.note_uncertain(str(task.request.id), holder, woken=woken)


def _drop_own_lease(task: Task[Any, Any]) -> bool:
    """Release the leases this process may hold for the current job from acquires whose
    reply was lost (see :func:`_uncertain_acquire`). True if one was a woken copy's claim
    that had committed, here or by the heartbeat since: the job's parked row went with it,
    so the job goes on as a fresh start."""
    task_id = str(task.request.id)
    ends.drop_own_uncertain(task_id)
    return ends.take_reclaimed(task_id)


def _admit(
    task: Task[Any, Any],
    *,
    woken: bool,
    tenant: str | None,
    queue: str,
    limit: int,
    on_limit: str,
    retry_countdown: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Grant | None:
    """One try of :func:`enter`: acquire, then run, refuse, record (shadow mode) or defer
    the job. Raises ``DatabaseError``."""
    request = task.request
    task_id = str(request.id)
    acquired = acquire(
        tenant=tenant, queue=queue, task_id=task_id, limit=limit,
        node=request.hostname, woken=woken,
    )  # fmt: skip
    if acquired.grant is not None:
        ends.mark_running(task_id)
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


def shadow_grant(
    task: Task[Any, Any], status: str, *, tenant: str | None, queue: str, limit: int
) -> Grant:
    """Shadow mode: record that the current job would have been deferred (its tenant or
    its queue is at its limit) and let it run without a slot: an empty grant, so that its
    release frees nothing and the counters keep counting only jobs within limits."""
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
    from django_fair_jobs.models import ParkedJob

    limited = queue_limits.is_limited(queue)
    handed = handoff.take_over(
        tenant=tenant, queue=queue, task_id=task_id, limit=limit, node=node, woken=woken,
        limited=limited,
    )  # fmt: skip
    if handed is not None:
        return handed
    if limited:
        acquired = _acquire_limited(
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
    return slot_store.try_acquire(
        tenant=tenant,
        queue=queue,
        task_id=task_id,
        limit=limit,
        process_id=identity.current_process_id(node),
        timeout=fair_settings.WORKER_TIMEOUT,
        woken=woken,
    )


def _acquire_limited(
    *,
    queue: str,
    tenant: str | None,
    limit: int,
    task_id: str,
    node: str | None,
    woken: bool,
) -> LimitedAcquisition:
    """Take a place in ``queue`` and, with a ``tenant``, its slot, for ``task_id``."""

    process_id, node_id = identity.current_process_id(node), identity.current_node_id()
    for _ in range(2):
        acquired = queue_store.try_acquire(
            queue=queue, tenant=tenant, limit=limit, task_id=task_id,
            process_id=process_id, node_id=node_id, woken=woken,
        )  # fmt: skip
        if acquired.status != "reserved":
            return acquired
        # A tenant slot reserved for this job before its queue was limited: give it back
        # and take both together.
        for slot_id in lease_store.drop_for_task(task_id, running=False)[0]:
            slots.wake(slot_id, limit=1)
    return acquired


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
    messages.postpone(
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

    request = task.request
    limited = queue_limits.is_limited(queue)
    deferrals = int((request.headers or {}).get(fair_headers.DEFERRALS) or 0) + 1
    headers = {**(request.headers or {}), fair_headers.DEFERRALS: deferrals}
    headers.pop(fair_headers.WAKE, None)
    signature = None
    if on_limit != "retry":
        signature = deferral.stored_signature(task, args, kwargs, headers, retry_countdown)
    if signature is None:
        deferral.reschedule(task, tenant, queue, limited, retry_countdown, args, kwargs, headers)
        return None
    for _ in range(_PARK_ATTEMPTS):
        if limited or tenant is None:
            outcome = queue_limits.park(
                queue=queue, tenant=tenant, limit=limit, task_id=str(request.id),
                task_name=task.name, signature=signature, woken=woken,
            )  # fmt: skip
        else:
            outcome = slot_store.try_park(
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
    messages.postpone(
        task, args, kwargs, countdown=retry_countdown,
        reason=f"could not park or start after {_PARK_ATTEMPTS} tries",
    )  # fmt: skip
    return None

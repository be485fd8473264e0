"""What happens when a job starts and ends: the hold protocol, read top to bottom.

Today it holds fair dispatch's steps (the rest of the protocol moves here from
``task.py`` and ``slots.py`` with the layout in ARCHITECTURE.md): a dispatched job marks
its row running (one round trip; a second copy of the message is dropped), takes its
tenant slot only when its tenant has a cap (the fence that keeps the limit whatever was
dispatched), runs, and ends its row in the round trip that dispatches the next job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from celery.exceptions import Ignore
from django.db import DatabaseError

from django_fair_jobs import dispatch, identity, slots

if TYPE_CHECKING:
    import uuid

    from celery import Task

    from django_fair_jobs.managers import Grant

logger = logging.getLogger("django_fair_jobs.admission")

T = TypeVar("T")

_pending_ends: list[tuple[int, uuid.UUID]] = []
_pending_lock = threading.Lock()


def _process_id() -> uuid.UUID:
    return identity.current_process_id()


def keep_grant(task: Task[Any, Any], grant: Grant) -> None:
    """Note the running job's grant on its request, for :func:`release_held`."""
    # Context holds any attribute; setattr, as its stub declares only Celery's own.
    setattr(task.request, "fair_grant", grant)  # noqa: B010


def release_held(task: Task[Any, Any]) -> None:
    """Give back the running job's grant now, once: at its end, or before its retry is
    published (a retry that starts at once elsewhere must find the slot free, not held
    by this run, which would make it a duplicate and delay it by the worker timeout)."""
    grant = getattr(task.request, "fair_grant", None)
    if grant is not None:
        setattr(task.request, "fair_grant", None)  # noqa: B010
        slots.release(grant, app=task.app)


def run_dispatched(
    task: Task[Any, Any],
    job_id: int,
    tenant: str | None,
    queue: str,
    call: Callable[[], T],
) -> T:
    """Run a dispatched job: start its row, take its tenant slot if its tenant has a cap,
    call ``call()``, then end the row and publish the jobs its room went to.

    Raises ``Ignore`` (the message is acknowledged, nothing runs) for a second copy of a
    job, when the database cannot mark the start (the row stays dispatched and is
    published again after ``FAIR_JOBS_DISPATCH_LOST_AFTER``), and when the tenant slot is
    full (the job goes back to its line for :data:`~django_fair_jobs.dispatch.FENCE_DELAY`).
    """
    process = _process_id()
    try:
        started = dispatch.start(job_id, process)
    except DatabaseError:
        logger.exception("Could not start dispatched job %s; it is published again later", job_id)
        raise Ignore() from None
    if started.status != "started":
        logger.info("Job %s (%s) already ran or runs: this copy is dropped", job_id, task.name)
        raise Ignore()
    if started.cap is not None and tenant is not None:
        acquired = slots.acquire(
            tenant=tenant, queue=queue, task_id=str(task.request.id), limit=started.cap,
            node=task.request.hostname, woken=False,
        )  # fmt: skip
        if acquired.grant is None:
            # Taken between dispatch and start (another task's job, a lowered limit).
            dispatch.publish(task.app, dispatch.end(job_id, process, delay=dispatch.FENCE_DELAY))
            raise Ignore()
        keep_grant(task, acquired.grant)
    try:
        return call()
    finally:
        release_held(task)
        end(task, job_id, process)


def end(task: Task[Any, Any], job_id: int, process: uuid.UUID) -> None:
    """End a dispatched job's row and publish the jobs dispatched into its room. If the
    database cannot be reached, the end is kept and tried again at the next heartbeat
    (:func:`retry_pending_ends`), so the room is not lost while the process lives."""
    try:
        ready = dispatch.end(job_id, process)
    except DatabaseError:
        logger.exception("Could not end dispatched job %s; retrying at the next heartbeat", job_id)
        with _pending_lock:
            _pending_ends.append((job_id, process))
        return
    dispatch.publish(task.app, ready)


def retry_pending_ends(app: Any) -> int:
    """End the rows whose end failed earlier in this process; returns how many ended."""
    with _pending_lock:
        pending = list(_pending_ends)
        _pending_ends.clear()
    done = 0
    for position, (job_id, process) in enumerate(pending):
        try:
            ready = dispatch.end(job_id, process)
        except DatabaseError:
            with _pending_lock:
                _pending_ends.extend(pending[position:])
            break
        dispatch.publish(app, ready)
        done += 1
    return done

"""What happens when a job ends: release its tenant slot and queue place and wake the
parked jobs that can run now (:func:`release`), end a dispatched job's row in the round
trip that dispatches the next one (:func:`end`), and keep what failed to retry it at the
next heartbeat, so that nothing is lost while the process lives."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, InterfaceError, close_old_connections

from django_fair_jobs import dispatch, identity, queue_limits, slots
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.leases.types import Grant
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.slots import store as slot_store

if TYPE_CHECKING:
    from celery import Celery, Task

logger = logging.getLogger("django_fair_jobs.admission")


@dataclass(frozen=True)
class Kept:
    """A finished job's tenant slot that this process keeps for its next job (slot
    handoff, :mod:`django_fair_jobs.admission.handoff`)."""

    grant: Grant
    tenant: str
    queue: str
    until: float
    app: Celery | None


@dataclass
class Ledger:
    """What this process remembers between a job's statements, so that nothing is lost
    while it lives: one object, under one lock. Each step that failed, or whose reply may
    have been lost, is noted here and resolved from the rows by asking again (the
    heartbeat, the job's next copy, the shutdown)."""

    lock: threading.Condition = field(default_factory=lambda: threading.Condition(threading.Lock()))
    """The one lock; a condition, on which the handoff's keeper thread waits for the slot
    it keeps to come due."""
    pending_ends: dict[int, tuple[uuid.UUID, dispatch.Outcome]] = field(default_factory=dict)
    """Dispatched jobs whose end failed, or whose start may have committed with its reply
    lost (``"back"``): job id to (process, outcome), tried again at each heartbeat and at
    shutdown."""
    pending_releases: list[Grant] = field(default_factory=list)
    """Releases that failed, tried again at the next heartbeat."""
    unconfirmed: list[Grant] = field(default_factory=list)
    """Slot releases made without waiting for the disk (``FAIR_JOBS_ASYNC_RELEASE``),
    oldest first, until :func:`confirm_releases` confirms them."""
    uncertain: set[tuple[str, uuid.UUID]] = field(default_factory=set)
    """(task id, process id) of acquires that failed with a database error: one may have
    committed with its reply lost (a failover, a pooler restart), leaving a lease held by
    this live process under a token nobody has. It is released at the next heartbeat, or
    before the job's next copy starts here."""
    running: set[str] = field(default_factory=set)
    """Task ids of the jobs holding a grant in this process (``enter`` to ``release``), or
    running a dispatched row: their leases are never mistaken for those of a lost reply,
    and a second copy of a dispatched job delivered here is refused."""
    woken_claims: set[str] = field(default_factory=set)
    """Task ids among :attr:`uncertain` whose acquire was a woken copy's claim: one that
    committed took the job's parked row with it."""
    reclaimed: dict[str, float] = field(default_factory=dict)
    """Task ids of woken claims that committed with their reply lost and whose lease was
    released, with when: the job's parked row is gone, so its next copy here starts as a
    fresh job (:func:`take_reclaimed`) instead of being dropped as a stale copy."""
    kept: Kept | None = None
    """The tenant slot this process keeps for its next job (slot handoff), if any."""
    keeper: tuple[int, threading.Thread] | None = None
    """The handoff's keeper thread (by pid: a forked child starts its own)."""
    ending: list[tuple[int, uuid.UUID, Any]] = field(default_factory=list)
    """Ends handed to this process's flusher thread and not yet taken by it: (job id,
    process, Celery app) of dispatched jobs that ran to their end
    (:mod:`django_fair_jobs.admission.flusher`)."""
    handed_at: float = -math.inf
    """When (``time.monotonic()``) the last end was handed to the flusher."""
    carrying: bool = False
    """Whether the flusher keeps an end for the next start: the last start came within
    ``FAIR_JOBS_DISPATCH_CARRY_WAIT`` of the end before it (a process that waits longer
    for its next job would only hold its ends' room)."""
    publishing: list[tuple[Any, list[dispatch.Ready]]] = field(default_factory=list)
    """Jobs dispatched into the room of ends a start carried, for the flusher thread to
    publish: (Celery app, jobs)."""
    unflushed: set[int] = field(default_factory=set)
    """Row ids of dispatched jobs that ran to their end here and whose end is not committed
    yet (handed to the flusher, or kept after a failed flush): a copy of one delivered here
    is refused, as its row still says it runs here. By row id, not task id: a retry of the
    job is a new row under the same task id, and runs."""
    unconfirmed_starts: dict[int, uuid.UUID] = field(default_factory=dict)
    """Dispatched jobs whose start committed without waiting for the disk
    (``FAIR_JOBS_DISPATCH_ASYNC_COMMIT``): row id to process, until the heartbeat confirms
    them (:func:`~django_fair_jobs.admission.flusher.confirm`) or an end of the job that
    waited for the disk covers them (WAL is flushed in order)."""
    unconfirmed_ends: dict[int, uuid.UUID] = field(default_factory=dict)
    """Dispatched jobs that ended here while their start was unconfirmed, or whose flushed
    end committed without waiting for the disk: row id to process, until the heartbeat
    confirms them (a lost start is made again, then the end)."""
    confirming: threading.Lock = field(default_factory=threading.Lock)
    """Held by the confirmation from its copy of the lists to its commit, and by an end
    done in the job's thread or the heartbeat's retry: a job put back in its line by such
    an end is never started here again by a confirmation that copied it before."""
    flush_in_thread: bool = False
    """Whether jobs' ends go to the flusher thread (a worker process on PostgreSQL)."""
    flusher: tuple[int, threading.Thread] | None = None
    """The flusher thread (by pid: a forked child starts its own)."""
    flush_wanted: threading.Event = field(default_factory=threading.Event)
    """Set when :attr:`ending` has something for the flusher, or it is to stop (an event,
    not a lock: what it signals is read under :attr:`lock`)."""
    flusher_stopping: bool = False
    """The process is shutting down: the flusher flushes what it holds and ends."""
    keeper_deadline: float | None = None
    """When the keeper thread, waiting on :attr:`lock`, wakes next (``math.inf``: only
    when woken); None while it is not waiting. A slot kept is woken for only if it is due
    before then: in a busy worker each job's slot is due later than the one before, so
    the keeper sleeps through them instead of being woken at every job (two context
    switches and a contest for the GIL with the job's thread each time)."""


LEDGER = Ledger()
"""This process's :class:`Ledger`."""


def _new_ledger_in_child() -> None:
    # A forked child (a prefork pool's) owes nothing of its parent's and must not inherit
    # its lock, which another thread of the parent may have held at the fork.
    LEDGER.__init__()  # type: ignore[misc]


os.register_at_fork(after_in_child=_new_ledger_in_child)

RECLAIMED_KEPT = 86400.0
"""Seconds a :attr:`Ledger.reclaimed` entry waits for its job's copy to come back here; a copy
that went to another process never takes it."""


def mark_running(task_id: str) -> None:
    """Note that ``task_id`` holds a grant in this process: its lease is never mistaken for
    one of a lost reply."""
    with LEDGER.lock:
        LEDGER.running.add(task_id)


def claim_running(task_id: str) -> bool:
    """Note that a dispatched job ``task_id`` runs in this process now; False if it already
    does (a second copy delivered to it)."""
    with LEDGER.lock:
        if task_id in LEDGER.running:
            return False
        LEDGER.running.add(task_id)
        return True


def unmark_running(task_id: str) -> None:
    """Note that ``task_id`` holds no grant here any more (released, or its slot kept for
    the process's next job)."""
    with LEDGER.lock:
        LEDGER.running.discard(task_id)


def note_uncertain(
    task_id: str, holder: uuid.UUID, *, woken: bool = False, release: Grant | None = None
) -> None:
    """Note that a statement of ``task_id``'s that may have committed lost its reply: the
    lease ``holder`` may hold for it under a token nobody has is released later (the job's
    next copy here, or the heartbeat), as is ``release``, a grant the statement was to
    hand on. ``woken``: the statement was a woken copy's claim, so its next copy here
    starts afresh if the claim committed."""
    with LEDGER.lock:
        LEDGER.uncertain.add((task_id, holder))
        if woken:
            LEDGER.woken_claims.add(task_id)
    if release is not None:
        retry_release(release)


def retry_release(grant: Grant) -> None:
    """Release ``grant`` at this process's next heartbeat (its release failed, or may have)."""
    with LEDGER.lock:
        LEDGER.pending_releases.append(grant)


def drop_own_uncertain(task_id: str) -> None:
    """Release the leases this process may hold for ``task_id`` from statements whose reply
    was lost (:func:`note_uncertain`), before its copy here acquires again (its own lease
    would refuse it as a duplicate). Raises ``DatabaseError``."""
    with LEDGER.lock:
        lost = [pid for (uncertain_id, pid) in LEDGER.uncertain if uncertain_id == task_id]
    for process_id in lost:
        _drop_uncertain([task_id], process_id)


def take_reclaimed(task_id: str) -> bool:
    """True (once) if a woken claim of ``task_id`` committed and its lease was released:
    the job's next copy starts afresh (see :attr:`Ledger.reclaimed`)."""
    with LEDGER.lock:
        return LEDGER.reclaimed.pop(task_id, None) is not None


def release(grant: Grant, app: Celery | None = None) -> None:
    """Release ``grant``'s slots and wake the parked jobs that can now run.

    Never raises: a job that succeeded stays a success. A failed release is kept and
    retried by this process's heartbeat (no slot is lost); a failed wake-up is left to the
    maintenance sweep.
    """

    unmark_running(grant.task_id)
    if grant.slot_id is None and grant.queue_limit_id is None:
        return  # the job held nothing (no tenant, no queue limit)
    in_line: int | None = 0
    try:
        if grant.queue_limit_id is not None:
            freed = queue_store.release(grant)
            in_line, parked = freed if freed is not None else (None, None)
        else:
            parked = slot_store.release(grant)
    except Exception:
        logger.exception("Could not release the slots of %s; will retry", grant.task_id)
        if grant.queue_limit_id is None and slot_store.releases_async():
            # It may have committed without waiting for the disk: the retry, finding the
            # lease gone, would write nothing that makes it durable.
            with LEDGER.lock:
                LEDGER.unconfirmed.append(grant)
        retry_release(grant)
        return
    if grant.queue_limit_id is None and parked is not None and slot_store.releases_async():
        with LEDGER.lock:
            LEDGER.unconfirmed.append(grant)
    released(grant, parked, in_line=in_line, app=app)


def released(
    grant: Grant, parked: int | None, *, in_line: int | None = 0, app: Celery | None = None
) -> None:
    """Wake what ``grant``'s committed release freed: a job parked on its slot if the slot
    showed ``parked`` jobs, and one waiting in its limited queue's line if ``in_line``.
    ``in_line`` None, or ``parked`` None for a tenant slot alone: the lease was gone,
    nothing was released. Never raises: a failed wake-up is left to the maintenance
    sweep."""
    if in_line is None or (grant.queue_limit_id is None and parked is None):
        logger.info(
            "Lease of %s was gone at release (reaped or taken over); nothing released",
            grant.task_id,
        )
        return
    try:
        if in_line and grant.queue_limit_id is not None:
            queue_limits.wake_line(grant.queue_limit_id, limit=1, app=app)
        if parked and grant.slot_id is not None:
            slots.wake(grant.slot_id, limit=1, app=app)
    except Exception:
        logger.exception("Could not wake a parked job after %s; the sweep will", grant.task_id)


def confirm_releases(app: Celery | None = None) -> int:
    """Confirm this process's slot releases that did not wait for the disk
    (``FAIR_JOBS_ASYNC_RELEASE``), redoing any that a crash of the database server lost,
    and wake jobs parked on the slots released again; returns how many were redone.
    Called by the maintenance thread every ``FAIR_JOBS_HEARTBEAT_INTERVAL``: until then a
    lost release shows its slot held, so the tenant runs fewer jobs, never more. A
    database error leaves them unconfirmed for the next pass (and the rest of the pass
    goes on)."""
    with LEDGER.lock:
        grants = list(LEDGER.unconfirmed)
    process_id = identity.registered_process_id()
    if not grants or process_id is None:
        return 0
    try:
        confirmed, freed = slot_store.confirm_releases(grants, process_id=process_id)
    except DatabaseError:
        logger.warning("Could not confirm %s asynchronous release(s) yet", len(grants))
        return 0
    if confirmed:  # else reaped while alive: confirmed once the process is registered again
        with LEDGER.lock:
            del LEDGER.unconfirmed[: len(grants)]  # only appended to meanwhile
    if freed:
        logger.warning(
            "Released %s slot(s) again whose release the database lost (a crash of the server)",
            len(freed),
        )
    for slot_id, parked in freed:
        if parked:
            try:
                slots.wake(slot_id, limit=parked, app=app)
            except Exception:
                logger.exception("Could not wake a parked job of slot %s; the sweep will", slot_id)
    return len(freed)


def retry_pending_releases() -> int:
    """Retry releases that failed earlier in this process, and release the leases of
    acquires whose reply may have been lost; returns how many releases succeeded."""
    with LEDGER.lock:
        pending = list(LEDGER.pending_releases)
        LEDGER.pending_releases.clear()
        uncertain = sorted(LEDGER.uncertain)
    done = 0
    for grant in pending:
        before = len(LEDGER.pending_releases)
        release(grant)
        done += len(LEDGER.pending_releases) == before
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
    """Release the leases ``process_id`` may hold for ``task_ids`` from acquires whose
    reply was lost (none where the acquire did not commit), except those of jobs running
    here now; then wake jobs on the slots freed. One transaction for all of them. A woken
    claim's released lease is noted in :attr:`Ledger.reclaimed`. Raises DatabaseError (the
    entries stay for the next try)."""

    with LEDGER.lock:
        # A copy that took its slot since holds its own lease; leave it alone.
        orphans = [task_id for task_id in task_ids if task_id not in LEDGER.running]
    slot_ids, queue_ids, released = (
        lease_store.drop_held_by(orphans, process_id) if orphans else ([], [], [])
    )
    now = time.monotonic()
    with LEDGER.lock:
        LEDGER.uncertain.difference_update((task_id, process_id) for task_id in task_ids)
        # Before the wake-ups below, which may fail: the claim's parked row is gone either way.
        for stale in [t for t, at in LEDGER.reclaimed.items() if now - at > RECLAIMED_KEPT]:
            del LEDGER.reclaimed[stale]
        LEDGER.reclaimed.update((t, now) for t in released if t in LEDGER.woken_claims)
        LEDGER.woken_claims.difference_update(task_ids)
    if slot_ids or queue_ids:
        logger.warning(
            "Gave back %s slot(s) of acquires whose reply was lost; their jobs can start",
            len(slot_ids) + len(queue_ids),
        )
    for queue_limit_id in queue_ids:
        queue_limits.wake_line(queue_limit_id, limit=1)
    for slot_id in slot_ids:
        slots.wake(slot_id, limit=1)


def drop_task(task_id: str, *, terminated: bool, app: Celery | None = None) -> None:
    """Drop a revoked job's parked row and reservations, and its running leases too if it
    was ``terminated``; wake jobs on the slots freed.

    A revoke without terminate (or an expired duplicate copy) leaves a running copy's
    lease alone: that copy still runs and releases it.
    """

    lease_store.drop_parked(task_id)
    slot_ids, queue_ids = lease_store.drop_for_task(task_id, running=terminated)
    for queue_limit_id in queue_ids:
        queue_limits.wake_line(queue_limit_id, limit=1, app=app)
    for slot_id in slot_ids:
        slots.wake(slot_id, limit=1, app=app)


def end(
    task: Task[Any, Any],
    job_id: int,
    process: uuid.UUID,
    *,
    outcome: dispatch.Outcome = "end",
    delay: float = 0.0,
    block: bool = False,
) -> None:
    """End a dispatched job's row (or put it back, see :func:`django_fair_jobs.dispatch.end`)
    and publish the jobs dispatched into its room; a job the fence refused (``block``)
    dispatches nothing. If the database cannot be reached, the end is kept and tried again
    at the next heartbeat (:func:`retry_pending_ends`), so the room is not lost while the
    process lives."""
    try:
        with LEDGER.confirming:
            ready = dispatch.end(
                job_id, process, outcome=outcome, delay=delay, block=block,
                limit=0 if block else dispatch.BATCH,
            )  # fmt: skip
            settled([job_id], process, outcome)
    except (DatabaseError, InterfaceError):  # a closed connection raises the latter
        logger.exception("Could not end dispatched job %s; retrying at the next heartbeat", job_id)
        end_later(job_id, process, outcome="later" if block else outcome)
        return
    dispatch.publish(task.app, ready)


def settled(job_ids: list[int], process: uuid.UUID, outcome: dispatch.Outcome) -> None:
    """The ends of ``job_ids`` (``outcome``) committed, waiting for the disk. A job put
    back (``back``, ``later``, ``failed``) must never be started here again: its
    unconfirmed start is dropped (were it lost, its row shows dispatched and the
    lost-message repair publishes it, as it should). A job that ended whose start is
    unconfirmed is kept for the confirmation as an end too: were its start lost, the end
    matched no row and wrote nothing, so it covers nothing; the confirmation makes the
    start again, then the end."""
    with LEDGER.lock:
        for job_id in job_ids:
            if outcome != "end":
                LEDGER.unconfirmed_starts.pop(job_id, None)
            elif job_id in LEDGER.unconfirmed_starts:
                LEDGER.unconfirmed_ends[job_id] = process


def end_later(job_id: int, process: uuid.UUID, *, outcome: dispatch.Outcome) -> None:
    """Keep the end of ``job_id`` (fenced by ``process``) for the next heartbeat."""
    with LEDGER.lock:
        LEDGER.pending_ends[job_id] = (process, outcome)


def ended_here(job_id: int) -> bool:
    """Whether ``job_id`` ran to its end in this process and its end is not committed yet
    (see :attr:`Ledger.unflushed`)."""
    with LEDGER.lock:
        return job_id in LEDGER.unflushed


def forget_end(job_id: int) -> None:
    """Drop a kept end of ``job_id``: a start whose reply was lost did commit, and the job
    runs here now (its own end follows)."""
    with LEDGER.lock:
        LEDGER.pending_ends.pop(job_id, None)


def retry_pending_ends(app: Any) -> int:
    """End the rows whose end failed earlier in this process; returns how many ended.
    The jobs that ran to their end go in one round trip per process
    (``fair_jobs_dispatch_end_many``), the others (back, later, failed) one at a time."""
    with LEDGER.lock:
        pending = dict(LEDGER.pending_ends)
    batches: dict[uuid.UUID, list[int]] = {}
    singles: list[tuple[list[int], uuid.UUID, dispatch.Outcome]] = []
    for job_id, (process, outcome) in pending.items():
        if outcome == "end":
            batches.setdefault(process, []).append(job_id)
        else:
            singles.append(([job_id], process, outcome))
    done = 0
    for ids, process, outcome in [*((ids, p, "end") for p, ids in batches.items()), *singles]:
        try:
            with LEDGER.confirming:
                if outcome == "end":
                    ready = dispatch.end_many(ids, process, again=True)
                else:
                    ready = dispatch.end(ids[0], process, outcome=outcome, again=True)
                settled(ids, process, outcome)
        except (DatabaseError, InterfaceError):  # a closed connection raises the latter
            close_old_connections()  # the rest of this pass asks on a new connection
            break
        with LEDGER.lock:
            for job_id in ids:
                if LEDGER.pending_ends.get(job_id) == (process, outcome):
                    del LEDGER.pending_ends[job_id]
                LEDGER.unflushed.discard(job_id)
        dispatch.publish(app, ready)
        done += len(ids)
    return done


def own_thread(
    current: tuple[int, threading.Thread] | None, target: Callable[[], None], name: str
) -> tuple[int, threading.Thread]:
    """``current`` if it is a live thread of this process, else a new daemon thread
    running ``target``, started (a forked child inherits its parent's ledger entry but
    not the thread). Called holding the ledger's lock; raises ``RuntimeError`` when no
    thread can be started."""
    if current is not None and current[0] == os.getpid() and current[1].is_alive():
        return current
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return (os.getpid(), thread)

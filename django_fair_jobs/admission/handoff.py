"""Slot handoff (``FAIR_JOBS_SLOT_HANDOFF``, off by default): a process keeps the tenant slot
of a job that ended well for a moment, and hands it to the next job it starts of the same
tenant and queue in one statement (:func:`django_fair_jobs.slots.store.hand_over`) instead
of a release at the end and an acquire at the start. The next job of another tenant or
queue releases the kept slot and takes its own in one statement as well
(:func:`django_fair_jobs.slots.store.release_and_acquire`); a job that finds nothing kept
acquires as usual. A kept slot that no job takes within the setting's seconds is released
by this process's keeper thread, on a database connection of its own.

Only a slot that had room to spare when its job took it (below the tenant's limit, no job
parked) is kept, and one is not handed over while the slot row shows jobs parked on it
(it is released instead, which wakes the oldest): a tenant that starts its jobs at its
limit works as without handoff. The row is read, not locked, so a park that commits at the
same moment is served by the next release. What it changes, and why it is opt-in: for up
to that many seconds after a job has ended, its slot shows held, so a job of that tenant
that fills the limit meanwhile parks until the slot is released. PostgreSQL only (SQLite
serializes writers, and the keeper would write beside the job's thread).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from django.db import DatabaseError, close_old_connections, connections, router

from django_fair_jobs import db, identity
from django_fair_jobs.admission import ends
from django_fair_jobs.admission.ends import LEDGER, Kept
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.leases.types import Acquisition, Grant
from django_fair_jobs.slots import store as slot_store

if TYPE_CHECKING:
    from celery import Celery


def enabled() -> bool:
    """Whether finished jobs' slots are kept for the next job (a PostgreSQL database and
    ``FAIR_JOBS_SLOT_HANDOFF`` above 0)."""
    from django_fair_jobs.models import SlotLease

    return fair_settings.SLOT_HANDOFF > 0 and db.uses_sql(router.db_for_write(SlotLease))


def keep(grant: Grant, *, tenant: str | None, queue: str, app: Celery | None) -> bool:
    """Keep ``grant``'s tenant slot for this process's next job instead of releasing it;
    False when it cannot be kept (the caller releases it): handoff is off, the grant holds
    no tenant slot or holds a place in a limited queue, or the slot had no room to spare
    when the job took it (the tenant was at its limit, or jobs were parked on it)."""
    if tenant is None or grant.slot_id is None or grant.queue_limit_id is not None:
        return False
    if not grant.spare:  # the tenant was at its limit, or jobs were parked: they go first
        return False
    if not enabled():
        return False
    ends.unmark_running(grant.task_id)
    kept = Kept(grant, tenant, queue, time.monotonic() + fair_settings.SLOT_HANDOFF, app)
    with LEDGER.lock:
        try:
            LEDGER.keeper = ends.own_thread(LEDGER.keeper, _keep, "fair-jobs-handoff")
        except RuntimeError:  # no thread to be had: nothing would release it in time
            return False
        earlier, LEDGER.kept = LEDGER.kept, kept
        if LEDGER.keeper_deadline is not None and kept.until < LEDGER.keeper_deadline:
            LEDGER.lock.notify_all()
    if earlier is not None:  # two jobs ended at once (a threads pool): one slot is kept
        ends.release(earlier.grant, app=earlier.app)
    return True


def take() -> Kept | None:
    """Take the slot this process keeps, if any (its keeper no longer releases it): the
    caller hands it over or releases it."""
    with LEDGER.lock:
        kept, LEDGER.kept = LEDGER.kept, None
    return kept


def take_over(
    *,
    tenant: str | None,
    queue: str,
    task_id: str,
    limit: int,
    node: str | None,
    woken: bool,
    limited: bool,
) -> Acquisition | None:
    """Take ``task_id``'s tenant slot using the slot this process keeps, if it keeps one,
    and return the acquisition; None when it keeps none, or released it alone (the job
    then acquires as usual).

    * Same ``tenant`` and ``queue``, a fresh start: the slot is handed over
      (:func:`~django_fair_jobs.slots.store.hand_over`, the counter untouched).
    * Another tenant or queue: the kept slot is released and the job's taken in one
      statement (:func:`~django_fair_jobs.slots.store.release_and_acquire`); its answer is
      acquire's (held, full, duplicate or stale).
    * Otherwise (no tenant, a ``limited`` queue, a slot that cannot be handed over, or a
      ``woken`` copy of the same tenant) the kept slot is released alone, which wakes a job
      parked on it.
    """
    if LEDGER.kept is None:
        return None
    kept = take()
    if kept is None:
        return None
    if tenant is not None and not limited:
        if kept.tenant != tenant or kept.queue != queue:
            return _trade(kept, tenant=tenant, queue=queue, task_id=task_id, limit=limit,
                          node=node, woken=woken)  # fmt: skip
        if not woken:
            with _uncertain_if_cut(kept, task_id):
                handed = slot_store.hand_over(held=kept.grant, task_id=task_id, limit=limit)
            if handed is not None:
                return Acquisition("held", handed)
    ends.release(kept.grant, app=kept.app)
    return None


def _trade(
    kept: Kept, *, tenant: str, queue: str, task_id: str, limit: int, node: str | None,
    woken: bool,
) -> Acquisition:  # fmt: skip
    """Release ``kept`` and acquire ``task_id``'s slot of ``tenant`` on ``queue``, in one
    statement; wake a job parked on the released slot."""
    with _uncertain_if_cut(kept, task_id, woken=woken):
        traded = slot_store.try_release_and_acquire(
            held=kept.grant, tenant=tenant, queue=queue, task_id=task_id, limit=limit,
            process_id=identity.current_process_id(node),
            timeout=fair_settings.WORKER_TIMEOUT, woken=woken,
        )  # fmt: skip
    if traded is None:
        # A copy of the job took a lease meanwhile: the statement rolled back whole.
        ends.release(kept.grant, app=kept.app)
        return Acquisition("duplicate")
    acquired, parked = traded
    ends.released(kept.grant, parked, app=kept.app)
    return acquired


@contextmanager
def _uncertain_if_cut(kept: Kept, task_id: str, *, woken: bool = False) -> Iterator[None]:
    """Around a statement that releases or hands on ``kept`` for ``task_id``: whatever cuts
    it (a lost reply, an interface error, a soft time limit), it may have committed, so the
    heartbeat releases the kept lease (fenced by its old token, that frees nothing if it
    was released or handed over) and drops a lease the new job may hold under a token
    nobody has."""
    try:
        yield
    except BaseException as exc:
        if _refused(exc):
            # The server refused the statement, so nothing of it happened: the kept slot
            # is released now (waking a job parked on it), not at the next heartbeat.
            ends.release(kept.grant, app=kept.app)
            raise
        holder = identity.registered_process_id()
        if holder is not None:
            ends.note_uncertain(task_id, holder, woken=woken, release=kept.grant)
        else:
            ends.retry_release(kept.grant)
        raise


REFUSED_CLASSES = frozenset({"22", "23", "40"})
"""SQLSTATE classes of errors that undo the whole statement and leave the connection
usable: data exceptions, integrity violations, transaction rollbacks (a deadlock)."""


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's refusal of a statement run in autocommit (so it
    changed nothing), not a lost reply that may follow a commit."""
    from django_fair_jobs.models import SlotLease

    if not isinstance(exc, DatabaseError):
        return False
    cause = exc.__cause__
    state = str(getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None) or "")
    connection = connections[router.db_for_write(SlotLease)]
    return state[:2] in REFUSED_CLASSES and not connection.in_atomic_block


def release_kept() -> None:
    """Release the slot this process keeps, if any, now (the process stops)."""
    kept = take()
    if kept is not None:
        ends.release(kept.grant, app=kept.app)


def _keep() -> None:
    """The keeper thread: release each kept slot that no job took in time."""
    while True:
        with LEDGER.lock:
            while LEDGER.kept is None or LEDGER.kept.until > time.monotonic():
                kept = LEDGER.kept
                LEDGER.keeper_deadline = math.inf if kept is None else kept.until
                LEDGER.lock.wait(None if kept is None else kept.until - time.monotonic())
            LEDGER.keeper_deadline = None
            expired, LEDGER.kept = LEDGER.kept, None
        # As Django around a request: a connection past CONN_MAX_AGE (or broken) is closed
        # before and after, so with CONN_MAX_AGE = 0 the thread holds none between releases.
        close_old_connections()
        ends.release(expired.grant, app=expired.app)  # never raises: retried if it fails
        close_old_connections()

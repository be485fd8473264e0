"""A worker process's threads: the heartbeat, the maintenance loop and the poll for
countdowns come due.

Every process that runs fair tasks registers one :class:`~django_fair_jobs.models.WorkerProcess`
row the first time it needs a slot (:mod:`django_fair_jobs.identity`), and starts a
daemon thread that refreshes the row's heartbeat every ``FAIR_JOBS_HEARTBEAT_INTERVAL``
seconds. The thread keeps beating while tasks run (CPU-bound Python code releases the GIL
between bytecodes), so a slow job never loses its lease, and it does nothing else. A second
thread runs maintenance (:mod:`django_fair_jobs.maintenance.passes`) at the same pace.
Maintenance publishes to the broker; on its own thread, a broker that stops answering (or a
long pass) cannot stop the beats.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from django.db import close_old_connections, connections

from django_fair_jobs import admission, dispatch, identity, planner, waits
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.maintenance import passes

logger = logging.getLogger("django_fair_jobs.maintenance")

_BEAT_JOIN_SECONDS = 5.0
"""How long a shutdown waits for a beat under way (a database that does not answer must not
hold the process's exit for longer)."""


REGISTER_RETRY_FIRST = 1.0
"""Seconds before the first new try of a registration that failed at process start; each
further try waits twice as long, up to :data:`REGISTER_RETRY_MAX`."""

REGISTER_RETRY_MAX = 30.0


def start_process() -> None:
    """Register this pool process and start its heartbeat now, not at its first fair job:
    every process of a node then reaps dead workers on every queue, whatever it runs, and
    its queues count it in their capacity (a queue served by fair dispatch alone gets no
    job before). Called when a prefork child starts, or when a solo or threads worker is
    ready. If the database does not answer (workers started before it), a thread tries
    again with a growing delay until it does."""
    if not _register():
        threading.Thread(
            target=_register_until_done, name="fair-jobs-register", daemon=True
        ).start()


def _register() -> bool:
    """One try at :func:`start_process`'s registration; True if it is done."""
    try:
        identity.current_process_id()
        passes.dispatch_into_new_capacity()
        return True
    except Exception:
        logger.exception("Could not register this worker process; trying again")
        return False
    finally:
        # The heartbeat thread has its own connection; this thread's is not needed again.
        connections.close_all()


def _register_until_done() -> None:
    pid, delay = os.getpid(), REGISTER_RETRY_FIRST
    while True:
        time.sleep(delay)
        if os.getpid() != pid or identity.registered_process_id() is not None:
            return  # a forked copy, or a job registered the process meanwhile
        if _register():
            return
        delay = min(delay * 2, REGISTER_RETRY_MAX)


def _start_threads(ident: identity.Identity) -> None:
    """Start a newly registered process's threads: heartbeat, maintenance, the due poll
    (one process per node) and the planner's."""

    ident.thread = threading.Thread(
        target=_heartbeat_loop, args=(ident,), name="fair-jobs-heartbeat", daemon=True
    )
    ident.thread.start()
    threading.Thread(
        target=_maintenance_loop, args=(ident,), name="fair-jobs-maintenance", daemon=True
    ).start()
    if _polls_due():
        threading.Thread(target=_due_loop, args=(ident,), name="fair-jobs-due", daemon=True).start()
    planner.start_thread(ident.stop)


identity.on_register(_start_threads)


def _heartbeat_loop(ident: identity.Identity) -> None:
    """Beat, and nothing else: a beat never waits on the broker or on a long maintenance
    pass, which would let another process reap this one while its jobs run."""

    try:
        while not ident.stop.wait(fair_settings.HEARTBEAT_INTERVAL):
            if ident.pid != os.getpid():
                return  # a forked copy of this thread's owner; the child registers itself
            try:
                close_old_connections()
                if not identity.keep_registered(ident):
                    return  # retired by this process's shutdown, not reaped
            except Exception:
                # A database outage must not kill the heartbeat: drop the connection and
                # try again next interval.
                logger.exception(
                    "Heartbeat failed; retrying in %s s", fair_settings.HEARTBEAT_INTERVAL
                )
                connections.close_all()
    finally:
        connections.close_all()


def _maintenance_loop(ident: identity.Identity) -> None:
    """Once per interval: confirm this process's asynchronous releases, retry its failed
    releases, ends and planned starts, and take part in the cluster's maintenance pass.
    Each of them may publish (wake-ups, dispatches), so a broker that stops answering
    blocks this thread, never the heartbeat."""
    from celery import current_app

    try:
        while not ident.stop.wait(fair_settings.HEARTBEAT_INTERVAL):
            if ident.pid != os.getpid():
                return  # a forked copy of this thread's owner
            try:
                close_old_connections()
                admission.confirm_releases()
                admission.confirm_dispatch(current_app)
                admission.retry_pending_releases()
                passes.retry_pending_ends()
                planner.retry_pending_starts()
                passes.maybe_run_maintenance()
                waits.flush()
            except Exception:
                # A database outage must not end the loop: try again next interval.
                logger.exception(
                    "Maintenance failed; retrying in %s s", fair_settings.HEARTBEAT_INTERVAL
                )
                connections.close_all()
    finally:
        connections.close_all()


def _polls_due() -> bool:
    """Whether this process looks for countdowns come due: one per worker node (a prefork
    pool's first child, billiard's index 0, which a replacement child inherits; a solo or
    threads worker itself), and only in a worker (it consumes queues)."""
    from billiard.process import current_process

    interval = fair_settings.DISPATCH_POLL_INTERVAL
    return (
        interval > 0
        and getattr(current_process(), "index", 0) == 0
        and bool(identity.consumed_queues())
    )


def _due_loop(ident: identity.Identity) -> None:
    try:
        while not ident.stop.wait(fair_settings.DISPATCH_POLL_INTERVAL):
            if ident.pid != os.getpid():
                return  # a forked copy of this thread's owner
            try:
                close_old_connections()
                dispatch_due()
            except Exception:
                # A database outage must not end the loop: maintenance covers meanwhile.
                logger.exception("Looking for due countdowns failed; trying again")
                connections.close_all()
    finally:
        connections.close_all()


def dispatch_due() -> int:
    """Dispatch the queues this worker consumes that are due a dispatch (countdowns or ETAs
    come due, or jobs waiting while the queue has room: :func:`dispatch.due_queues`);
    returns how many jobs were published."""
    from celery import current_app

    published = 0
    for queue in dispatch.due_queues(identity.consumed_queues()):
        published += dispatch.publish(current_app, dispatch.dispatch(queue))
    return published


def shutdown() -> None:
    """Stop this process's heartbeat, end what it kept to end, and retire its row, so that
    any slot it still holds is released by the next reap instead of after the timeout."""
    from celery import current_app

    ident = identity.current()
    if ident is None:
        return
    ident.stop.set()
    if ident.thread is not None and ident.thread is not threading.current_thread():
        # A beat under way ends first: one that ran after the retire would find no row
        # and, were it not stopped, register the process again.
        ident.thread.join(_BEAT_JOIN_SECONDS)
    try:
        waits.flush()
    except Exception:
        logger.exception("Could not store this process's wait counts")
    try:
        # Ends and releases that failed are done now, or the reap would later run an
        # acks_late job that completed a second time.
        admission.retry_pending_ends(current_app)
        admission.retry_pending_releases()
        admission.confirm_dispatch(current_app)  # before the retire takes the row
    except Exception:
        logger.exception("Could not end this process's pending jobs; the reap will")
    try:
        identity.retire_process(ident.process_id)
        passes.refresh_capacity()
        # Ungated: this process's own leases are what must come back now.
        passes.run_maintenance()
    except Exception:
        logger.exception("Could not retire worker process %s", ident.process_id)
    identity.forget()

"""Worker processes: heartbeat thread, and maintenance (reap and sweep).

Every process that runs fair tasks registers one :class:`~django_fair_jobs.models.WorkerProcess`
row the first time it needs a slot (:mod:`django_fair_jobs.identity`), and starts a
daemon thread that refreshes the row's heartbeat every ``FAIR_JOBS_HEARTBEAT_INTERVAL``
seconds. The thread keeps beating while tasks run (CPU-bound Python code releases the GIL
between bytecodes), so a slow job never loses its lease, and it does nothing else. A second
thread runs maintenance at the same pace: leases of processes silent for
``FAIR_JOBS_WORKER_TIMEOUT`` are reaped and missed wake-ups are swept. Maintenance publishes
to the broker; on its own thread, a broker that stops answering (or a long pass) cannot
stop the beats. No beat schedule is needed, and the pass runs at most once per interval
across the cluster, whoever claims
it; ``manage.py fair_jobs_reap`` runs the same maintenance by hand, at once.

The process and node identities moved to :mod:`django_fair_jobs.identity`; their old names
here (``current_process_id``, ``current_node_id``, ``registered_process_id``,
``when_gone``, ``start_node``, ``set_concurrency``, ``consumed_queues``) keep working for
one release.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, close_old_connections, connections, router, transaction
from django.db.models import F
from django.db.models.functions import Now

from django_fair_jobs import db, identity
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.slots import store as slot_store

logger = logging.getLogger("django_fair_jobs.workers")

_BEAT_JOIN_SECONDS = 5.0
"""How long a shutdown waits for a beat under way (a database that does not answer must not
hold the process's exit for longer)."""

# The old import paths of the identity's functions (one release; see the changelog).
consumed_queues = identity.consumed_queues
current_node_id = identity.current_node_id
current_process_id = identity.current_process_id
registered_process_id = identity.registered_process_id
set_concurrency = identity.set_concurrency
start_node = identity.start_node
when_gone = identity.when_gone


def start_process() -> None:
    """Register this pool process and start its heartbeat now, not at its first fair job:
    every process of a node then reaps dead workers on every queue, whatever it runs.
    Called when a prefork child starts, or when a solo or threads worker is ready; a
    database error is logged and registration is left to the first job."""
    try:
        identity.current_process_id()
        dispatch_into_new_capacity()
    except Exception:
        logger.exception("Could not register this worker process; will retry at the first job")
    finally:
        # The heartbeat thread has its own connection; this thread's is not needed again.
        connections.close_all()


def _start_threads(ident: identity.Identity) -> None:
    """Start a newly registered process's threads: heartbeat, maintenance, the due poll
    (one process per node) and the planner's."""
    from django_fair_jobs.planner import start_thread

    ident.thread = threading.Thread(
        target=_heartbeat_loop, args=(ident,), name="fair-jobs-heartbeat", daemon=True
    )
    ident.thread.start()
    threading.Thread(
        target=_maintenance_loop, args=(ident,), name="fair-jobs-maintenance", daemon=True
    ).start()
    if _polls_due():
        threading.Thread(target=_due_loop, args=(ident,), name="fair-jobs-due", daemon=True).start()
    start_thread(ident.stop)


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
                if not identity.beat(ident.process_id):
                    if ident.stop.is_set():
                        return  # retired by this process's shutdown, not reaped
                    # We were presumed dead (a stall longer than the timeout) and reaped:
                    # our old leases are gone and our late releases are fenced; come back.
                    logger.warning(
                        "Worker process %s was reaped while alive; re-registering", ident.process_id
                    )
                    identity.register_row(ident)
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
    """Once per interval: retry this process's failed releases, ends and planned starts,
    and take part in the cluster's maintenance pass. Each of them may publish (wake-ups,
    dispatches), so a broker that stops answering blocks this thread, never the heartbeat."""
    from django_fair_jobs.admission import retry_pending_releases
    from django_fair_jobs.planner import retry_pending_starts

    try:
        while not ident.stop.wait(fair_settings.HEARTBEAT_INTERVAL):
            if ident.pid != os.getpid():
                return  # a forked copy of this thread's owner
            try:
                close_old_connections()
                retry_pending_releases()
                _retry_pending_ends()
                retry_pending_starts()
                maybe_run_maintenance()
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
    """Dispatch the queues this worker consumes that hold countdowns or ETAs come due;
    returns how many jobs were published."""
    from celery import current_app

    from django_fair_jobs import dispatch

    published = 0
    for queue in dispatch.due_queues(identity.consumed_queues()):
        published += dispatch.publish(current_app, dispatch.dispatch(queue))
    return published


def shutdown() -> None:
    """Stop this process's heartbeat and retire its row, so that any slot it still holds
    is released by the next reap instead of after the timeout."""

    ident = identity.current()
    if ident is None:
        return
    ident.stop.set()
    if ident.thread is not None and ident.thread is not threading.current_thread():
        # A beat under way ends first: one that ran after the retire would find no row
        # and, were it not stopped, register the process again.
        ident.thread.join(_BEAT_JOIN_SECONDS)
    try:
        identity.retire_process(ident.process_id)
        _refresh_capacity()
        # Ungated: this process's own leases are what must come back now.
        run_maintenance()
    except Exception:
        logger.exception("Could not retire worker process %s", ident.process_id)
    identity.forget()


_WINDOW_PRUNE_INTERVAL = 60.0
"""Seconds between two prunes of idle rerouting windows, cluster-wide."""


@dataclass(frozen=True)
class MaintenanceReport:
    """What one maintenance pass did."""

    leases_reaped: int
    slots_reaped: int
    queues_reaped: int
    lost_rewoken: int
    jobs_woken: int
    counters_fixed: int
    windows_pruned: int = 0
    boosts_ended: int = 0
    decisions_pruned: int = 0
    dispatch_requeued: int = 0
    dispatch_dropped: int = 0
    dispatch_republished: int = 0
    dispatch_dispatched: int = 0


def maybe_run_maintenance() -> MaintenanceReport | None:
    """Run a maintenance pass if no process in the cluster ran one within the last
    ``FAIR_JOBS_HEARTBEAT_INTERVAL``; called by every heartbeat. Returns None if skipped.

    Pacing it cluster-wide keeps the write load of maintenance constant however many
    processes beat, so heartbeats are never starved by it (on SQLite, every write contends
    for one lock)."""

    # A little under the interval, so that beats arriving on time are not skipped by
    # rounding, while two passes still cannot run within one interval.
    if not claim_maintenance("maintenance", interval=fair_settings.HEARTBEAT_INTERVAL * 0.9):
        return None
    return run_maintenance()


def run_maintenance(timeout: float | None = None) -> MaintenanceReport:
    """Reap dead holders on every queue, return lost wake-ups to line, and wake jobs that
    have room (on tenant slots and in limited queues' lines).

    ``timeout`` defaults to ``FAIR_JOBS_WORKER_TIMEOUT``. Safe to run from several
    processes at once.
    """
    from django_fair_jobs import decisions
    from django_fair_jobs.queue_limits import wake_waiting
    from django_fair_jobs.reroute import prune as prune_windows
    from django_fair_jobs.slots import end_boosts, wake

    if timeout is None:
        timeout = fair_settings.WORKER_TIMEOUT
    reaped = lease_store.reap(timeout=timeout)
    if reaped.leases:
        count_reaped(reaped.leases)
    boosts_ended = end_boosts()
    lost = lease_store.requeue_lost_wakes(timeout=timeout)
    fixed = (
        slot_store.reconcile_parked()
        + queue_store.reconcile_parked()
        + queue_store.reconcile_running()
    )
    woken = wake_waiting()
    for slot_id in slot_store.with_waiting_room():
        woken += wake(slot_id, limit=None)
    pruned = 0
    # Idle windows age by the day, not by the beat: a scan a minute is plenty.
    if claim_maintenance("windows", interval=_WINDOW_PRUNE_INTERVAL):
        pruned = prune_windows()
        decisions_pruned = decisions.prune()
    else:
        decisions_pruned = 0
    repaired = _repair_dispatch()
    report = MaintenanceReport(
        leases_reaped=reaped.leases,
        slots_reaped=len(reaped.slots),
        queues_reaped=len(reaped.queues),
        lost_rewoken=lost,
        jobs_woken=woken,
        counters_fixed=fixed,
        windows_pruned=pruned,
        boosts_ended=boosts_ended,
        decisions_pruned=decisions_pruned,
        dispatch_requeued=repaired.requeued,
        dispatch_dropped=repaired.dropped,
        dispatch_republished=repaired.republished,
        dispatch_dispatched=repaired.dispatched,
    )
    _log_maintenance(report)
    return report


def _log_maintenance(report: MaintenanceReport) -> None:
    """Log what a maintenance pass did, if it did anything."""
    if report.dispatch_requeued or report.dispatch_dropped or report.dispatch_republished:
        logger.info(
            "Maintenance: fair dispatch put %s jobs of dead workers back in line, dropped %s "
            "(not acks_late), published %s again (not started in time), dispatched %s",
            report.dispatch_requeued, report.dispatch_dropped, report.dispatch_republished,
            report.dispatch_dispatched,
        )  # fmt: skip
    if (
        report.leases_reaped or report.jobs_woken or report.lost_rewoken or report.counters_fixed
        or report.windows_pruned or report.boosts_ended or report.decisions_pruned
    ):  # fmt: skip
        logger.info(
            "Maintenance: reaped %s leases on %s tenant slots and %s queues, re-queued %s "
            "lost wake-ups, woke %s parked jobs, fixed %s counters, pruned %s idle windows "
            "and %s old decisions, ended %s boosts",
            report.leases_reaped, report.slots_reaped, report.queues_reaped,
            report.lost_rewoken, report.jobs_woken, report.counters_fixed,
            report.windows_pruned, report.decisions_pruned, report.boosts_ended,
        )  # fmt: skip


def _refresh_capacity() -> dict[str, int]:
    from django_fair_jobs import dispatch

    return dispatch.refresh_capacity(fair_settings.DISPATCH_SLACK, fair_settings.WORKER_TIMEOUT)


def dispatch_into_new_capacity() -> int:
    """After this process registered: recount every queue's capacity and dispatch into
    the queues whose room grew. Returns how many jobs were published."""
    from celery import current_app

    from django_fair_jobs import dispatch

    published = 0
    for queue in _refresh_capacity():
        published += dispatch.publish(current_app, dispatch.dispatch(queue))
    return published


def _retry_pending_ends() -> int:
    from celery import current_app

    from django_fair_jobs import admission

    return admission.retry_pending_ends(current_app)


def _repair_dispatch() -> Any:
    from celery import current_app

    from django_fair_jobs import dispatch

    try:
        return dispatch.repair(
            current_app,
            timeout=fair_settings.WORKER_TIMEOUT,
            lost_after=fair_settings.DISPATCH_LOST_AFTER,
            slack_per_node=fair_settings.DISPATCH_SLACK,
        )
    except Exception:
        logger.exception("Fair dispatch maintenance failed; it runs again next pass")
        return dispatch.Repaired()


# Cluster-wide pacing of maintenance passes.


def claim_maintenance(name: str, *, interval: float) -> bool:
    """True if this caller may run ``name`` now: nobody ran it for ``interval`` seconds.

    One conditional upsert on PostgreSQL; two callers at once cannot both win.
    """
    from django_fair_jobs.models import Maintenance

    alias = router.db_for_write(Maintenance)
    if db.uses_sql(alias):
        return bool(db.run(alias, "claim_maintenance", {"name": name, "interval": interval}))
    with transaction.atomic(using=alias):
        if Maintenance.objects.filter(name=name, last_run_at__lt=db.ago(interval)).update(
            last_run_at=Now()
        ):
            return True
        if Maintenance.objects.filter(name=name).exists():
            return False
        Maintenance.objects.create(name=name)
    return True


def count_reaped(leases: int) -> None:
    """Add ``leases`` reaped leases to the cluster-wide total (for the metrics)."""
    from django_fair_jobs.models import Maintenance

    if not Maintenance.objects.filter(name="reaped").update(
        leases_reaped_total=F("leases_reaped_total") + leases
    ):
        try:
            with transaction.atomic(using=router.db_for_write(Maintenance)):
                Maintenance.objects.create(name="reaped", leases_reaped_total=leases)
        except IntegrityError:
            Maintenance.objects.filter(name="reaped").update(
                leases_reaped_total=F("leases_reaped_total") + leases
            )

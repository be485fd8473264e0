"""One maintenance pass: reap dead holders on every queue, requeue lost wake-ups, wake
jobs that have room, end boosts, prune idle windows and old decisions, and repair fair
dispatch. It runs at most once per ``FAIR_JOBS_HEARTBEAT_INTERVAL`` across the cluster,
whoever claims it, with no beat schedule; ``manage.py fair_jobs_reap`` runs the same pass
by hand, at once."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django_fair_jobs import admission, decisions, dispatch, queue_limits, reroute, slots
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.maintenance.store import claim_maintenance, count_reaped
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.slots import store as slot_store

logger = logging.getLogger("django_fair_jobs.maintenance")


_WINDOW_PRUNE_INTERVAL = 60.0
"""Seconds between two prunes of idle rerouting windows, old decisions and enqueue
receipts, cluster-wide."""


@dataclass(frozen=True)
class MaintenanceReport:
    """What one maintenance pass did."""

    leases_reaped: int
    slots_reaped: int
    queues_reaped: int
    wakes_requeued: int
    jobs_woken: int
    counters_fixed: int
    windows_pruned: int = 0
    boosts_ended: int = 0
    decisions_pruned: int = 0
    dispatch_requeued: int = 0
    dispatch_dropped: int = 0
    dispatch_republished: int = 0
    dispatch_dispatched: int = 0

    @property
    def did_anything(self) -> bool:
        """Whether the pass mended or pruned anything: only such a pass is logged (jobs
        dispatched into free room alone are routine, a pass a heartbeat interval)."""
        return any(
            getattr(self, name)
            for name in self.__dataclass_fields__
            if name not in ("slots_reaped", "queues_reaped", "dispatch_dispatched")
        )

    def summary(self) -> str:
        """What the pass did, in the words the log, ``fair_jobs_reap`` and the admin share."""
        return (
            f"Reaped {self.leases_reaped} lease(s) on {self.slots_reaped} tenant slot(s) "
            f"and {self.queues_reaped} queue(s); woke {self.jobs_woken} parked job(s); "
            f"requeued {self.wakes_requeued} lost wake-up(s); fixed {self.counters_fixed} "
            f"counter(s); pruned {self.windows_pruned} idle rerouting window(s) and "
            f"{self.decisions_pruned} old decision(s); ended {self.boosts_ended} boost(s); "
            f"fair dispatch: put {self.dispatch_requeued} job(s) of dead workers back in "
            f"line, dropped {self.dispatch_dropped} (not acks_late), published "
            f"{self.dispatch_republished} again (not started in time), dispatched "
            f"{self.dispatch_dispatched}"
        )


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

    if timeout is None:
        timeout = fair_settings.WORKER_TIMEOUT
    # Fair dispatch first: its reap reads a dead process's row for its node (was the whole
    # node lost, or one pool child?), and the lease reap deletes the dead rows it has done
    # with (one with a running dispatched job stays for it).
    repaired = _repair_dispatch(timeout)
    reaped = lease_store.reap(timeout=timeout)
    if reaped.leases:
        count_reaped(reaped.leases)
    boosts_ended = slots.end_boosts()
    lost = lease_store.requeue_lost_wakes(timeout=timeout)
    fixed = (
        slot_store.reconcile_parked()
        + queue_store.reconcile_parked()
        + queue_store.reconcile_running()
    )
    woken = queue_limits.wake_waiting()
    for slot_id in slot_store.with_waiting_room():
        woken += slots.wake(slot_id, limit=None)
    pruned = 0
    # Idle windows age by the day, not by the beat: a scan a minute is plenty.
    if claim_maintenance("windows", interval=_WINDOW_PRUNE_INTERVAL):
        pruned = reroute.prune()
        decisions_pruned = decisions.prune()
        dispatch.prune_receipts()
    else:
        decisions_pruned = 0
    report = MaintenanceReport(
        leases_reaped=reaped.leases,
        slots_reaped=len(reaped.slots),
        queues_reaped=len(reaped.queues),
        wakes_requeued=lost,
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
    if report.did_anything:
        logger.info("Maintenance: %s", report.summary())


def refresh_capacity() -> dict[str, int]:
    """Recount every dispatched queue's capacity from the live worker processes; returns
    the queues whose room grew, with their capacity."""

    return dispatch.refresh_capacity(fair_settings.DISPATCH_SLACK, fair_settings.WORKER_TIMEOUT)


def dispatch_into_new_capacity() -> int:
    """After this process registered: recount every queue's capacity and dispatch into
    the queues whose room grew. Returns how many jobs were published."""
    from celery import current_app

    published = 0
    for queue in refresh_capacity():
        published += dispatch.publish(current_app, dispatch.dispatch(queue))
    return published


def retry_pending_ends() -> int:
    """Retry the ends of dispatched jobs this process could not record earlier; returns
    how many were recorded."""
    from celery import current_app

    return admission.retry_pending_ends(current_app)


def _repair_dispatch(timeout: float) -> Any:
    from celery import current_app

    try:
        return dispatch.repair(
            current_app,
            timeout=timeout,
            lost_after=fair_settings.DISPATCH_LOST_AFTER,
            slack_per_node=fair_settings.DISPATCH_SLACK,
        )
    except Exception:
        logger.exception("Fair dispatch maintenance failed; it runs again next pass")
        return dispatch.Repaired()

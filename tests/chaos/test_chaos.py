"""Faults injected into real worker nodes, a real PostgreSQL server and RabbitMQ, with a
mixed workload (tenant slots, rerouting, the planner, a limited queue); after each, the
invariants of :mod:`tests.chaos.harness` are checked and the figures saved for the
Reliability page (``bash scripts/chaos.sh`` runs them all and regenerates its table).

Tests marked ``chaos`` only are the fast subset, run by every ``bash scripts/test.sh``;
``chaos_full`` ones run with ``--chaos-full``.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.chaos.harness import (
    HEARTBEAT_INTERVAL,
    WORKER_TIMEOUT,
    Cluster,
    check,
    skewed,
    workload,
)
from tests.conftest import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.workers]
full = pytest.mark.chaos_full

REAP_BOUND = WORKER_TIMEOUT + HEARTBEAT_INTERVAL + 10
"""How long a dead holder's leases may last: the reaping timeout, one beat, and slack for
a loaded machine."""


def test_sigkill_pool_process__job_runs_again__slots_reaped(cluster: Cluster) -> None:
    cluster.start("a", "b")
    with cluster.sampling():
        cluster.publish(workload())
        pid = cluster.kill_child(cluster.node("a"))
        dead = cluster.processes_of([pid])
        recovery = cluster.wait_reaped(dead, cluster.killed[pid], REAP_BOUND)
        cluster.wait_settled()
    outcome = cluster.outcome("SIGKILL of a pool process", recovery)
    check(outcome, exactly_once=False)
    # The killed job went back to the broker (task_reject_on_worker_lost) and ran again.
    assert outcome.duplicated >= 1


def test_hard_time_limit__child_killed__job_failed_once__slot_back(cluster: Cluster) -> None:
    cluster.start("a", "b")
    with cluster.sampling():
        cluster.publish(workload(overrun=2))
        started = cluster.wait_overrun_started()
        dead = cluster.processes_of([started.pid])
        cut = cluster.wait_overrun_cut(started)
        recovery = cluster.wait_reaped(dead, cut, REAP_BOUND)
        cluster.wait_settled()
    outcome = cluster.outcome("Hard time limit kills a pool process", recovery)
    # Celery fails a job that timed out (no retry): each ran once and was cut off.
    check(outcome, exactly_once=True)
    assert outcome.failed_by_design == 2


def test_sigstop_past_worker_timeout__late_release_frees_nothing(cluster: Cluster) -> None:
    cluster.start("a", "b")
    a = cluster.node("a")
    with cluster.sampling():
        # A second dispatched tenant with longer jobs, so that one runs on a at the freeze.
        longer = {"task": "chaos_dispatched", "tenant": "d1", "duration": 0.8, "count": 8}
        cluster.publish([*workload(), longer])
        cluster.freeze_running(a, count=2, task="chaos_dispatched")
        frozen_processes = cluster.processes_of(cluster._frozen_pids)
        recovery = cluster.wait_reaped(frozen_processes, cluster._frozen_at, REAP_BOUND)
        time.sleep(1)  # the other node takes the reaped slots while a is still frozen
        cluster.thaw(a)
        cluster.wait_settled()
    outcome = cluster.outcome("SIGSTOP past the worker timeout, then SIGCONT", recovery)
    check(outcome, exactly_once=True)
    assert outcome.stale_runs >= 1  # the frozen jobs outlived their leases, and are reported
    # The flusher's window: only a job whose end a frozen process had not yet flushed may
    # run again: at most one per process, as a flush (a round trip) is shorter than any of
    # the workload's jobs, so a process's flusher holds at most the end of its last job.
    assert outcome.reran_unflushed <= len(frozen_processes)
    # A dispatched job running at the freeze went back to its line when its process was
    # reaped (acks_late with reject_on_worker_lost, as Celery redelivers a dead worker's
    # job) and ran again on b; the frozen run ended after the thaw, its end fenced: the
    # counters are checked back at zero above. No other dispatched job ran twice.
    assert 1 <= outcome.reran_reaped <= outcome.frozen_dispatched


def test_connections_terminated__workers_recover_without_restart(cluster: Cluster) -> None:
    cluster.start("a", "b")
    with cluster.sampling():
        cluster.publish(workload())
        cluster.wait_running(count=2)
        for _ in range(3):
            assert cluster.terminate_backends() > 0
            time.sleep(1)
        at = cluster.now()
        recovery = cluster.first_finish_after(at)
        cluster.wait_settled()
    check(
        cluster.outcome("pg_terminate_backend of every connection, 3 times", recovery),
        exactly_once=False,
    )


def test_duplicate_deliveries__never_at_once__limits_hold(cluster: Cluster) -> None:
    cluster.start("a", "b")
    with cluster.sampling():
        jobs = cluster.publish(workload())
        copies = [j for j in jobs if j.task in ("chaos_slot", "chaos_plain")][::4]
        cluster.duplicate(copies)
        cluster.wait_settled()
        # A copy delivered while its first copy ran is postponed by the worker timeout; it
        # may still be due when the first copies have all finished.
        cluster.wait_quiet(WORKER_TIMEOUT + 2)
    outcome = cluster.outcome(f"Duplicate delivery of {len(copies)} task ids", None)
    check(outcome, exactly_once=False)
    # A duplicate runs after its first copy, never beside it (check() asserts no two runs of
    # one task id were open at once), at most once more; some did run a second time, so
    # that check had copies to compare.
    assert 1 <= outcome.duplicated <= len(copies)


def test_two_planners_and_two_reapers__each_job_once(cluster: Cluster) -> None:
    with cluster.sampling():
        # No node runs yet: the planned jobs wait in their virtual queues, and two planners
        # promote them at once (see planners_at_once), each claiming with SKIP LOCKED.
        jobs = cluster.publish(workload())
        planned = {j.id for j in jobs if j.task == "chaos_planned"}
        first, second = cluster.planners_at_once(2)
        ours, theirs = ({i for claim in c for i in claim["ids"]} for c in (first, second))
        assert not ours & theirs, f"promoted by both planners: {sorted(ours & theirs)}"
        assert ours | theirs == planned
        # Both claimed some of one tenant's rows at the same time: one skipped the rows the
        # other held while it published them.
        assert any(
            a["tenant"] == b["tenant"] and a["start"] < b["end"] and b["start"] < a["end"]
            for a in first
            if a["ids"]
            for b in second
            if b["ids"]
        ), (first, second)
        # Two reapers reap a dead process's leases at once; a live process's lease on the
        # same rows is kept, and the counters count it alone.
        reapers = cluster.reapers(2, seconds=30)
        ghost = cluster.dead_process_for_reapers(reapers)
        # The reap and the count of what it reaped are two statements: wait for both.
        wait_for(
            lambda: (
                (state := cluster.ghost_state(ghost))["leases"] == ["ghost-live"]
                and state["leases reaped"] >= 2
            ),
            REAP_BOUND,
            "the dead process's leases to be reaped and counted",
        )
        state = cluster.ghost_state(ghost)
        assert state == {
            "slot current_jobs": 1,
            "queue current_jobs": 1,
            "queue running": {str(ghost.live_node): 1},
            "leases": ["ghost-live"],
            "leases reaped": 2,
        }, state
        # The live process dies too: its lease goes the usual way, and nothing is left over.
        cluster.sql(
            "UPDATE fair_jobs_workerprocess SET last_heartbeat_at = now() - interval '1 hour'"
            " WHERE id = %s",
            (ghost.live,),
        )
        cluster.start("a", "b")  # each node's main process runs a planner too
        cluster.wait_settled()
        for reaper in reapers:
            out, err = reaper.communicate(timeout=60)
            assert reaper.returncode == 0, out + err
    check(cluster.outcome("Two planners and two reapers at once", None), exactly_once=True)


def test_clock_skew__ten_minutes_either_way__changes_nothing(cluster: Cluster) -> None:
    cluster.start("ahead", env=skewed(600))
    cluster.start("behind", env=skewed(-600))
    with cluster.sampling():
        cluster.publish(workload())
        cluster.wait_settled()
    outcome = cluster.outcome("Worker clocks 10 minutes ahead and behind", None)
    check(outcome, exactly_once=True)
    # Nobody looked dead or expired: no lease was reaped.
    assert (
        cluster.sql("SELECT coalesce(sum(leases_reaped_total), 0) FROM fair_jobs_maintenance")[0][0]
        == 0
    )


@full
def test_sigkill_main_process__pool_dies_with_it__jobs_redelivered(cluster: Cluster) -> None:
    cluster.start("a", "b")
    a = cluster.node("a")
    with cluster.sampling():
        cluster.publish(workload(scale=2))
        children = a.child_pids()
        pid = cluster.kill_main(a)
        dead = cluster.processes_of([pid, *children])
        recovery = cluster.wait_reaped(dead, cluster.killed[pid], REAP_BOUND + 10)
        cluster.wait_settled(180)
    outcome = cluster.outcome("SIGKILL of a node's main process", recovery)
    check(outcome, exactly_once=False)
    assert outcome.duplicated >= 1  # the jobs it ran were redelivered and ran again


@full
def test_postgres_restart__workers_recover__no_slot_leaks(cluster: Cluster) -> None:
    cluster.start("a", "b")
    with cluster.sampling():
        cluster.publish(workload(scale=2))
        cluster.wait_running(count=3)
        cluster.pg.restart()
        at = cluster.now()
        recovery = cluster.first_finish_after(at)
        cluster.wait_settled(180)
    check(cluster.outcome("PostgreSQL restarted mid-run", recovery), exactly_once=False)


@full
def test_broker_restart__durable_queues__every_job_runs(cluster: Cluster) -> None:
    cluster.start("a", "b")
    with cluster.sampling():
        cluster.publish(workload(scale=2))
        cluster.wait_running(count=3)
        subprocess.run(["rabbitmqctl", "stop_app"], check=True, capture_output=True)
        try:
            time.sleep(2)
        finally:
            subprocess.run(["rabbitmqctl", "start_app"], check=True, capture_output=True)
        at = cluster.now()
        recovery = cluster.first_finish_after(at)
        cluster.wait_settled(180)
    check(cluster.outcome("RabbitMQ restarted mid-run", recovery), exactly_once=False)


@full
def test_combined_faults(cluster: Cluster) -> None:
    # No skewed clock here: Celery's own countdowns (a postponed duplicate) are set by the
    # publishing worker's clock, so a skewed node would delay such a job by its skew; the
    # clock skew test covers what the library does with time.
    cluster.start("a", "b", "c")
    a, b, c = (cluster.node(n) for n in "abc")
    with cluster.sampling():
        reapers = cluster.reapers(2, seconds=20)
        jobs = cluster.publish(workload(scale=3, overrun=1))
        cluster.duplicate([j for j in jobs if j.task == "chaos_slot"][::6])
        cluster.kill_child(a)
        cluster.terminate_backends()
        cluster.pg.restart()
        cluster.kill_main(c)
        dead = cluster.processes_of(c.pids() + list(cluster.killed))
        recovery = cluster.wait_reaped(dead, cluster.killed[c.proc.pid], REAP_BOUND)
        cluster.freeze(b)
        time.sleep(WORKER_TIMEOUT + 2)
        cluster.thaw(b)
        cluster.wait_settled(240)
        for reaper in reapers:
            reaper.communicate(timeout=60)
    check(cluster.outcome("All of the above at once", recovery), exactly_once=False)

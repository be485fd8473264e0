"""The chaos suite's harness: a cluster of real worker nodes on a throwaway PostgreSQL server
and RabbitMQ, a mixed workload, and the invariants checked after every fault.

The checks read the workload's own records (``testapp_jobrun``: each job writes its start
and end with the database clock) and the library's rows, over a plain psycopg connection:

- no limit was exceeded: the largest number of runs open at once, per tenant slot, per
  rerouted tenant on the slow queue and per limited queue, is at most the limit;
- every accepted job completed (a job killed by its hard time limit is failed by Celery
  and is expected to have run once, unfinished);
- no two runs of one task id were open at once: a duplicate delivery or a redelivery runs
  after its first copy, never beside it (the limits, 2 at once, would not show two copies
  of one job running together);
- nothing is left over: no lease, parked job or planned job, and every counter is zero;
- at every moment sampled during the run, ``current_jobs`` of every slot and queue row
  equals the number of its leases.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from tests.chaos.pgserver import ThrowawayPostgres
from tests.conftest import Worker, wait_for
from tests.test_workers import max_overlap
from tests.testapp.chaos_tasks import (
    DISPATCH_LIMIT,
    HARD_TIME_LIMIT,
    OVERRUN_LIMIT,
    QUEUE_LIMIT,
    SLOT_LIMIT,
    SLOW_LIMIT,
)

ROOT = Path(__file__).resolve().parents[2]
BROKER = os.environ.get("FAIR_JOBS_CHAOS_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
QUEUES = ("chaos", "chaos_slow", "chaos_limited")

FROZEN_STATEMENTS_DONE = 0.5
"""Seconds after a freeze by which the statements its processes had sent are done: they
take a millisecond or so, unless one waits for a lock."""
WORKER_TIMEOUT = 3.0

UNGUARDED = frozenset({"chaos_planned"})
"""Tasks whose job holds nothing while it runs (a planned job without a tenant slot): two
copies of one of them may run at once where delivery is at least once."""
HEARTBEAT_INTERVAL = 0.5
SKEW_DIR = Path(__file__).resolve().parent / "skew"
LEFTOVERS_SQL = """
SELECT (SELECT count(*) FROM fair_jobs_slotlease),
       (SELECT count(*) FROM fair_jobs_parkedjob),
       (SELECT count(*) FROM fair_jobs_plannedjob),
       (SELECT coalesce(sum(current_jobs), 0) FROM fair_jobs_tenantqueueslot),
       (SELECT coalesce(sum(parked_jobs), 0) FROM fair_jobs_tenantqueueslot),
       (SELECT coalesce(sum(current_jobs), 0) FROM fair_jobs_queuelimit),
       (SELECT coalesce(sum(parked_jobs), 0) FROM fair_jobs_queuelimit),
       (SELECT count(*) FROM fair_jobs_queuelimit WHERE running <> '{}'::jsonb),
       (SELECT count(*) FROM fair_jobs_dispatchjob),
       (SELECT coalesce(sum(in_flight), 0) FROM fair_jobs_dispatchtenant)
"""
LEFTOVER_NAMES = (
    "leases",
    "parked rows",
    "planned rows",
    "slot current_jobs",
    "slot parked_jobs",
    "queue current_jobs",
    "queue parked_jobs",
    "queue running entries",
    "dispatched rows",
    "dispatch in_flight",
)
# One statement, so one snapshot: every row's counter against its leases at that instant.
COUNTERS_SQL = """
SELECT 'slot ' || s.tenant || ' ' || s.queue, s.current_jobs,
       (SELECT count(*) FROM fair_jobs_slotlease AS l WHERE l.slot_id = s.id)
  FROM fair_jobs_tenantqueueslot AS s
UNION ALL
SELECT 'queue ' || q.queue, q.current_jobs,
       (SELECT count(*) FROM fair_jobs_slotlease AS l WHERE l.queue_limit_id = q.id)
  FROM fair_jobs_queuelimit AS q
"""


@dataclass
class Job:
    """A job the broker or the planner accepted: ``apply_async`` returned."""

    id: str
    task: str
    tenant: str


@dataclass
class Run:
    """One execution of a job, from the workload's own table."""

    task_id: str
    tenant: str
    queue: str
    pid: int
    started: datetime
    finished: datetime | None
    interrupted: bool


def workload(scale: int = 1, overrun: int = 0) -> list[dict[str, Any]]:
    """The mixed workload: tenant slots, a greedy tenant rerouted, planned jobs, a
    limited queue and fair dispatch with a cap; ``scale`` multiplies the tenants,
    ``overrun`` adds jobs of one tenant that each run past their hard time limit."""
    spec: list[dict[str, Any]] = []
    for n in range(3 * scale):
        spec.append({"task": "chaos_slot", "tenant": f"s{n}", "duration": 0.8, "count": 5})
    for n in range(scale):
        spec.append({"task": "chaos_reroute", "tenant": f"r{n}", "duration": 0.3, "count": 8})
        spec.append({"task": "chaos_planned", "tenant": f"p{n}a", "duration": 0.1, "count": 6})
        spec.append({"task": "chaos_planned", "tenant": f"p{n}b", "duration": 0.1, "count": 4})
        spec.append({"task": "chaos_plain", "tenant": f"q{n}", "duration": 0.4, "count": 6})
        spec.append({"task": "chaos_dispatched", "tenant": f"d{n}", "duration": 0.4, "count": 6})
    if overrun:
        spec.append(
            {
                "task": "chaos_overrun",
                "tenant": "h0",
                "duration": 6 * HARD_TIME_LIMIT,
                "count": overrun,
            }
        )
    return spec


@dataclass
class Node(Worker):
    """A ``celery worker`` node (with its prefork children) started by the harness."""

    def pids(self) -> list[int]:
        """The main process's pid and its children's."""
        return [self.proc.pid, *self.child_pids()]

    def signal_all(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the node's whole process group (started in its own session)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 20) -> None:
        """Warm shutdown (a frozen node is continued first), then SIGKILL to the whole
        group: no process of a test outlives it."""
        self.signal_all(signal.SIGCONT)
        super().stop(timeout)
        self.signal_all(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@dataclass
class Outcome:
    """What one fault did: the figures the Reliability table reports."""

    fault: str
    accepted: int
    completed: int
    duplicated: int
    failed_by_design: int
    lost: list[str]
    concurrency: dict[str, tuple[int, int]]
    recovery: float | None
    counter_samples: int
    counter_mismatches: list[str]
    leftovers: dict[str, int]
    stale_runs: int = 0
    self_overlap: int = 0
    """The most runs of one task id open at once (1: copies ran one after the other)."""
    self_overlapping: list[str] = field(default_factory=list)
    """The task ids of which two runs were open at once."""
    notes: list[str] = field(default_factory=list)
    ran_twice: list[str] = field(default_factory=list)
    """The tasks of the jobs that ran more than once (one entry per job)."""
    reran_unflushed: int = 0
    """Jobs that ended on the frozen node just before the freeze, their end handed to its
    flusher and not yet committed, and ran again after its processes were reaped: the
    flusher's at-least-once window. Not in :attr:`duplicated`."""
    reran_reaped: int = 0
    """Dispatched jobs that were running on the frozen node at the freeze and ran again
    after its processes were reaped: the reap presumes a stalled process dead and puts its
    ``acks_late`` jobs back in their lines, as Celery redelivers a dead worker's job. Not in
    :attr:`duplicated`."""
    frozen_dispatched: int = 0
    """Dispatched jobs running on the frozen node at the freeze (the bound of
    :attr:`reran_reaped`)."""

    def row(self) -> dict[str, Any]:
        """A JSON-able record for the report."""
        return asdict(self)


@dataclass
class Ghost:
    """A dead and a live worker process of no node, with leases (see
    :meth:`Cluster.dead_process_for_reapers`)."""

    dead: uuid.UUID = field(default_factory=uuid.uuid4)
    dead_node: uuid.UUID = field(default_factory=uuid.uuid4)
    live: uuid.UUID = field(default_factory=uuid.uuid4)
    live_node: uuid.UUID = field(default_factory=uuid.uuid4)
    slot: int = 0
    queue: int = 0


def skewed(seconds: float) -> dict[str, str]:
    """Environment for a worker whose wall clock is ``seconds`` off (see skew/)."""
    return {"PYTHONPATH": f"{SKEW_DIR}{os.pathsep}{ROOT}", "FAIR_JOBS_CHAOS_SKEW": str(seconds)}


class Cluster:
    """Worker nodes, the chaos database and the broker, for one test."""

    def __init__(self, pg: ThrowawayPostgres, dbname: str, tmp: Path) -> None:
        self.pg = pg
        self.dbname = dbname
        self.tmp = tmp
        self.nodes: list[Node] = []
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(ROOT),
            "DATABASE_URL": pg.url(dbname),
            "CELERY_BROKER_URL": BROKER,
            # Results are not read: the workload's own table is the record.
            "CELERY_RESULT_BACKEND": "cache+memory://",
            "CELERY_TASK_REJECT_ON_WORKER_LOST": "true",
            "FAIR_JOBS_WORKER_TIMEOUT": str(WORKER_TIMEOUT),
            "FAIR_JOBS_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL),
            "FAIR_JOBS_LIMIT_PLAIN_TASKS": "true",
            "FAIR_JOBS_QUEUE_LIMITS": json.dumps({"chaos_limited": QUEUE_LIMIT}),
        }
        self.jobs: list[Job] = []
        self.killed: dict[int, datetime] = {}
        self.frozen: tuple[list[int], datetime, datetime] | None = None
        self._frozen_pids: list[int] = []
        self._frozen_at = datetime.min
        self._frozen_tasks: set[str] = set()
        self.samples = 0
        self.mismatches: list[str] = []
        self._conn: psycopg.Connection[Any] | None = None

    # -- the database, over psycopg ------------------------------------------------------

    def sql(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run ``query`` on the chaos database, reconnecting through an outage."""
        deadline = time.monotonic() + 60
        while True:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.pg.url(self.dbname), autocommit=True)
                cursor = self._conn.execute(query, params)
                return cursor.fetchall() if cursor.description else []
            except psycopg.OperationalError:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def now(self) -> datetime:
        """The database's clock, the one every record uses."""
        value: datetime = self.sql("SELECT clock_timestamp()")[0][0]
        return value

    def reset(self) -> None:
        """Empty every table of the library and the workload, and the chaos queues."""
        tables = [
            row[0]
            for row in self.sql(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                " AND (tablename LIKE 'fair\\_jobs\\_%%' OR tablename = 'testapp_jobrun')"
            )
        ]
        self.sql(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
        self.purge_queues()

    def purge_queues(self) -> None:
        """Drop the chaos queues' messages (a previous test's leftovers)."""
        from kombu import Connection

        with Connection(BROKER) as conn:
            channel = conn.channel()
            for queue in QUEUES:
                with contextlib.suppress(Exception):
                    channel.queue_purge(queue)  # type: ignore[attr-defined]

    # -- processes -----------------------------------------------------------------------

    def start(self, *names: str, concurrency: int = 3, env: dict[str, str] | None = None) -> None:
        """Start worker nodes ``names`` at once, and wait until all are ready."""
        started = []
        for name in names:
            log = self.tmp / f"{name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [
                        *(sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker"),
                        *("-P", "prefork", "-c", str(concurrency), "-Q", ",".join(QUEUES)),
                        *("-n", f"{name}@%h", "--without-gossip", "--without-mingle"),
                        *("--without-heartbeat", "-l", "INFO"),
                    ],
                    cwd=ROOT,
                    env={**self.env, **(env or {})},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            node = Node(name, proc, log)
            self.nodes.append(node)
            started.append(node)
        for node in started:
            wait_for(
                lambda n=node: " ready." in n.output() or n.proc.poll() is not None,  # type: ignore[misc]
                90,
                f"worker {node.name} to start",
            )
            assert node.proc.poll() is None, node.output()

    def node(self, name: str) -> Node:
        """The node called ``name``."""
        return next(n for n in self.nodes if n.name == name)

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()
        if self._conn is not None:
            self._conn.close()

    def driver(self, *args: str, stdin: str = "", timeout: float = 120) -> Any:
        """Run ``python -m tests.chaos.driver ARGS`` against the chaos database and broker."""
        result = subprocess.run(
            [sys.executable, "-m", "tests.chaos.driver", *args],
            input=stdin,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    def publish(self, spec: list[dict[str, Any]]) -> list[Job]:
        """Publish ``spec`` (see :func:`workload`) and remember the accepted jobs."""
        jobs = [Job(**item) for item in self.driver("publish", stdin=json.dumps(spec))]
        self.jobs += jobs
        return jobs

    def duplicate(self, jobs: list[Job], duration: float = 0.3) -> None:
        """Publish a second message with each job's task id: a duplicate delivery."""
        spec = [
            {"task": j.task, "tenant": j.tenant, "duration": duration, "task_id": j.id}
            for j in jobs
        ]
        self.driver("publish", stdin=json.dumps(spec))

    def _drivers(self, name: str, count: int, *args: str) -> list[subprocess.Popen[str]]:
        """Start ``count`` driver processes ``args``; their connections are named
        ``fair-jobs-NAME-N`` (see :meth:`waiting`)."""
        url = self.pg.url(self.dbname)
        return [
            subprocess.Popen(
                [sys.executable, "-m", "tests.chaos.driver", *args],
                cwd=ROOT,
                env={**self.env, "DATABASE_URL": f"{url}?application_name=fair-jobs-{name}-{n}"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for n in range(count)
        ]

    def reapers(self, count: int, seconds: float) -> list[subprocess.Popen[str]]:
        """Start ``count`` processes that run ``fair_jobs_reap`` back to back."""
        return self._drivers("reaper", count, "reap", str(seconds))

    def waiting(self, name: str, statement: str = "") -> int:
        """How many of the driver processes ``name`` wait for a lock (in ``statement``, if
        given: how it begins)."""
        rows = self.sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
            " AND application_name LIKE %s AND wait_event_type = 'Lock' AND query LIKE %s",
            (self.dbname, f"fair-jobs-{name}-%", f"{statement}%"),
        )
        return int(rows[0][0])

    def planners_at_once(self, count: int) -> list[list[dict[str, Any]]]:
        """Run the planner's promotion in ``count`` processes at once (driver ``promote``),
        and return each one's claims.

        The barrier: this holds a lock on the planned jobs' table that every claim (``FOR
        UPDATE SKIP LOCKED``) waits for, until all of them wait; they then claim together,
        and each skips the rows another holds while it publishes them.
        """
        barrier = psycopg.connect(self.pg.url(self.dbname))
        try:
            barrier.execute("LOCK TABLE fair_jobs_plannedjob IN EXCLUSIVE MODE")
            planners = self._drivers("planner", count, "promote")
            wait_for(
                lambda: (
                    self.waiting("planner") == count or any(p.poll() is not None for p in planners)
                ),
                60,
                f"{count} planners to wait to claim",
            )
            barrier.commit()
        finally:
            barrier.close()
        claims = []
        for planner in planners:
            out, err = planner.communicate(timeout=120)
            assert planner.returncode == 0, out + err
            claims.append(json.loads(out.strip().splitlines()[-1]))
        return claims

    def dead_process_for_reapers(self, reapers: list[subprocess.Popen[str]]) -> Ghost:
        """Give a dead worker process leases while ``reapers`` (see :meth:`reapers`) wait to
        reap them, so that all of them try to reap the same leases at once; returns what it
        made.

        In one transaction: a process that stopped beating an hour ago holds two leases,
        and a live one (its heartbeat an hour ahead) one, each on the tenant slot
        ``ghost`` of ``chaos`` and on the queue ``chaos_ghost``, whose counters count the
        three. The transaction holds the lease table in SHARE mode (every statement that
        writes a lease waits for it) until every reaper's reap statement waits, then
        commits: the reaps start together, and each sees the two dead leases.
        """
        ghost = Ghost()
        barrier = psycopg.connect(self.pg.url(self.dbname))
        try:
            barrier.execute(
                "INSERT INTO fair_jobs_workerprocess"
                " (id, node, node_id, hostname, pid, queues, concurrency, started_at,"
                "  last_heartbeat_at)"
                " VALUES (%s, 'dead@ghost', %s, 'ghost', 1, '[]', 1, now(),"
                "         now() - interval '1 hour'),"
                "        (%s, 'live@ghost', %s, 'ghost', 2, '[]', 1, now(),"
                "         now() + interval '1 hour')",
                (ghost.dead, ghost.dead_node, ghost.live, ghost.live_node),
            )
            slot = barrier.execute(
                "INSERT INTO fair_jobs_tenantqueueslot"
                " (tenant, queue, default_max_jobs, current_jobs, parked_jobs, deferred_total)"
                " VALUES ('ghost', 'chaos', 3, 3, 0, 0) RETURNING id"
            ).fetchone()
            queue = barrier.execute(
                "INSERT INTO fair_jobs_queuelimit"
                " (queue, max_jobs, current_jobs, running, parked_jobs, deferred_total)"
                " VALUES ('chaos_ghost', 3, 3, %s, 0, 0) RETURNING id",
                (json.dumps({str(ghost.dead_node): 2, str(ghost.live_node): 1}),),
            ).fetchone()
            assert slot is not None and queue is not None
            ghost.slot, ghost.queue = slot[0], queue[0]
            barrier.execute("LOCK TABLE fair_jobs_slotlease IN SHARE MODE")
            for task_id, process, node in (
                ("ghost-dead-1", ghost.dead, ghost.dead_node),
                ("ghost-dead-2", ghost.dead, ghost.dead_node),
                ("ghost-live", ghost.live, ghost.live_node),
            ):
                barrier.execute(
                    "INSERT INTO fair_jobs_slotlease"
                    " (slot_id, queue_limit_id, node_id, task_id, token, process_id,"
                    "  acquired_at)"
                    " VALUES (%s, %s, %s, %s, gen_random_uuid(), %s, now() - interval '1 hour')",
                    (ghost.slot, ghost.queue, node, task_id, process),
                )
            wait_for(
                lambda: (
                    self.waiting("reaper", "WITH dead AS") == len(reapers)
                    or any(r.poll() is not None for r in reapers)
                ),
                60,
                f"{len(reapers)} reapers to wait to reap",
            )
            assert all(r.poll() is None for r in reapers), [r.communicate() for r in reapers]
            barrier.commit()
        finally:
            barrier.close()
        return ghost

    def ghost_state(self, ghost: Ghost) -> dict[str, Any]:
        """The counters and leases of the rows :meth:`dead_process_for_reapers` made."""
        (slot_jobs, queue_jobs, running, leases, reaped) = self.sql(
            "SELECT (SELECT current_jobs FROM fair_jobs_tenantqueueslot WHERE id = %(slot)s),"
            "       (SELECT current_jobs FROM fair_jobs_queuelimit WHERE id = %(queue)s),"
            "       (SELECT running FROM fair_jobs_queuelimit WHERE id = %(queue)s),"
            "       (SELECT array_agg(task_id ORDER BY task_id) FROM fair_jobs_slotlease"
            "         WHERE slot_id = %(slot)s OR queue_limit_id = %(queue)s),"
            "       (SELECT coalesce(sum(leases_reaped_total), 0) FROM fair_jobs_maintenance)",
            {"slot": ghost.slot, "queue": ghost.queue},
        )[0]
        return {
            "slot current_jobs": slot_jobs,
            "queue current_jobs": queue_jobs,
            "queue running": running,
            "leases": leases or [],
            "leases reaped": reaped,
        }

    # -- faults --------------------------------------------------------------------------

    def _ids_of(self, task: str) -> list[str]:
        """The task ids of the run's jobs of ``task``; of all its jobs if ``task`` is empty."""
        return [j.id for j in self.jobs if j.task == task or not task]

    def wait_running(
        self, node: Node | None = None, count: int = 1, timeout: float = 60, task: str = ""
    ) -> None:
        """Wait until ``count`` jobs are running (on ``node``'s processes if given), one of
        them a job of ``task`` if given."""
        pids = node.pids() if node else None
        of_task = set(self._ids_of(task))

        def running() -> bool:
            rows = self.sql("SELECT pid, task_id FROM testapp_jobrun WHERE finished_at IS NULL")
            here = [task_id for pid, task_id in rows if pids is None or pid in pids]
            return len(here) >= count and (not task or any(i in of_task for i in here))

        wait_for(running, timeout, f"{count} running jobs")

    def wait_overrun_started(self, timeout: float = 60) -> Run:
        """The first run of a ``chaos_overrun`` job, once it has started."""
        ids = [j.id for j in self.jobs if j.task == "chaos_overrun"]

        def started() -> Run | None:
            rows = self.sql(
                "SELECT task_id, tenant, queue, pid, started_at, finished_at, interrupted"
                " FROM testapp_jobrun"
                " WHERE task_id = ANY(%s) ORDER BY started_at LIMIT 1",
                (ids,),
            )
            return Run(*rows[0]) if rows else None

        run: Run = wait_for(started, timeout, "a job past its time limit to start")
        return run

    def wait_overrun_cut(self, run: Run, timeout: float = 30) -> datetime:
        """When ``run`` (past its hard time limit) was cut off: its interrupted record, or
        the moment its process is seen gone if it was killed before it could write one."""

        def cut() -> datetime | None:
            rows = self.sql(
                "SELECT finished_at FROM testapp_jobrun WHERE task_id = %s AND pid = %s",
                (run.task_id, run.pid),
            )
            if rows and rows[0][0] is not None:
                return rows[0][0]  # type: ignore[no-any-return]
            return None if Path(f"/proc/{run.pid}").exists() else self.now()

        moment: datetime = wait_for(cut, timeout, "the job past its time limit to be cut off")
        return moment

    def kill_child(self, node: Node) -> int:
        """SIGKILL one pool process of ``node`` that is running a job with time left;
        returns its pid.

        The job is a tenant slot job (0.8 s) that started at most 0.3 s ago: a job picked
        merely for running could end between the read and the kill (a planned job lasts
        0.1 s), and then no job would be cut off and redelivered.
        """
        children = set(node.child_pids())

        def fresh_slot_job() -> int | None:
            rows = self.sql(
                "SELECT pid FROM testapp_jobrun WHERE finished_at IS NULL AND tenant LIKE %s "
                "AND started_at > clock_timestamp() - interval '300 milliseconds' "
                "ORDER BY started_at DESC",
                ["s%"],
            )
            return next((pid for (pid,) in rows if pid in children), None)

        pid: int = wait_for(fresh_slot_job, 60, "a tenant slot job to start on the node")
        os.kill(pid, signal.SIGKILL)
        self.killed[pid] = self.now()
        return pid

    def kill_main(self, node: Node, *, busy: bool = True) -> int:
        """SIGKILL ``node``'s main process only (once it runs a job, if ``busy``): its
        connection to the broker drops, so the broker redelivers its unacknowledged jobs,
        and its pool processes die with it (billiard's parent-death signal)."""
        if busy:
            self.wait_running(node)
        pids = node.pids()
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(10)
        at = self.now()
        for pid in pids:
            self.killed[pid] = at
        return node.proc.pid

    def freeze(self, node: Node) -> None:
        """SIGSTOP the whole node: its jobs and its heartbeat thread stop where they are.
        The jobs its processes were admitted for (their leases, or their dispatched rows
        running) are noted: one frozen after its admission and before its body began runs
        after the thaw with its reaped lease, as one frozen mid-run ends with it."""
        self._frozen_pids = node.pids()
        node.signal_all(signal.SIGSTOP)
        self._frozen_at = self.now()
        processes = self.processes_of(self._frozen_pids)
        # A statement a process had sent when it was stopped still runs and commits on the
        # server (an acquire whose reply it will read after the thaw): read again once
        # such statements are done, and keep both reads.
        self._frozen_tasks = set()
        for pause in (0.0, FROZEN_STATEMENTS_DONE):
            time.sleep(pause)
            self._frozen_tasks |= {
                row[0]
                for row in self.sql(
                    "SELECT task_id FROM fair_jobs_slotlease WHERE process_id = ANY(%s)"
                    " UNION SELECT task_id FROM fair_jobs_dispatchjob WHERE process_id = ANY(%s)",
                    (processes, processes),
                )
            }

    def freeze_running(self, node: Node, count: int = 2, tries: int = 20, task: str = "") -> None:
        """Freeze ``node`` while at least one of its jobs (of ``task``, if given) is open:
        wait until ``count`` of its jobs run, freeze it, and check that such a run was
        still open at the freeze (a frozen process writes nothing, so it is read after). A
        job can end between the read and the SIGSTOP on a loaded machine; then thaw at once
        and try again."""
        of_task = self._ids_of(task)
        for _ in range(tries):
            self.wait_running(node, count=count, task=task)
            self.freeze(node)
            (open_runs,) = self.sql(
                "SELECT count(*) FROM testapp_jobrun WHERE finished_at IS NULL"
                " AND pid = ANY(%s) AND started_at < %s AND task_id = ANY(%s)",
                (self._frozen_pids, self._frozen_at, of_task),
            )[0]
            if open_runs:
                return
            node.signal_all(signal.SIGCONT)
        raise AssertionError(f"no job of {node} was running at any of {tries} freezes")

    def thaw(self, node: Node) -> None:
        """SIGCONT the node frozen by :meth:`freeze`: its jobs go on with stale leases."""
        self.frozen = (self._frozen_pids, self._frozen_at, self.now())
        node.signal_all(signal.SIGCONT)

    def terminate_backends(self) -> int:
        """``pg_terminate_backend`` every other connection to the chaos database."""
        rows = self.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (self.dbname,),
        )
        return len(rows)

    def processes_of(self, pids: list[int]) -> list[Any]:
        """The library's process ids registered by ``pids``."""
        return [
            row[0]
            for row in self.sql(
                "SELECT id FROM fair_jobs_workerprocess WHERE pid = ANY(%s)", (pids,)
            )
        ]

    def wait_reaped(self, processes: list[Any], since: datetime, timeout: float) -> float:
        """Wait until no lease belongs to ``processes``; the seconds since ``since``."""
        wait_for(
            lambda: (
                not self.sql(
                    "SELECT 1 FROM fair_jobs_slotlease WHERE process_id = ANY(%s)", (processes,)
                )
            ),
            timeout,
            "the dead processes' leases to be reaped",
        )
        return (self.now() - since).total_seconds()

    def first_finish_after(self, moment: datetime, timeout: float = 90) -> float:
        """Seconds from ``moment`` to the first job that finishes after it."""
        first: datetime = wait_for(
            lambda: self.sql(
                "SELECT min(finished_at) FROM testapp_jobrun WHERE finished_at > %s", (moment,)
            )[0][0],
            timeout,
            "a job to finish after the fault",
        )
        return (first - moment).total_seconds()

    # -- invariants ----------------------------------------------------------------------

    @contextlib.contextmanager
    def sampling(self, every: float = 0.2) -> Iterator[None]:
        """Compare every row's ``current_jobs`` with its leases, in one snapshot, throughout."""
        stop = threading.Event()

        def loop() -> None:
            conn: psycopg.Connection[Any] | None = None
            while not stop.wait(every):
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.pg.url(self.dbname), autocommit=True)
                    rows = conn.execute(COUNTERS_SQL).fetchall()
                except psycopg.Error:
                    conn = None  # the server restarts or cut us off: sample when it is back
                    continue
                self.samples += 1
                self.mismatches += [
                    f"{name}: current_jobs {cur} but {leases} leases"
                    for name, cur, leases in rows
                    if cur != leases
                ]
            if conn is not None:
                conn.close()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(10)

    def runs(self) -> list[Run]:
        """Every recorded run of the accepted jobs."""
        ids = [j.id for j in self.jobs]
        return [
            Run(*row)
            for row in self.sql(
                "SELECT task_id, tenant, queue, pid, started_at, finished_at, interrupted"
                " FROM testapp_jobrun WHERE task_id = ANY(%s)",
                (ids,),
            )
        ]

    def leftovers(self) -> dict[str, int]:
        """What is still held, parked or counted."""
        return dict(zip(LEFTOVER_NAMES, self.sql(LEFTOVERS_SQL)[0], strict=True))

    def wait_settled(self, timeout: float = 120) -> None:
        """Wait until every accepted job that should complete has, and nothing is held."""
        expected = {j.id for j in self.jobs if j.task != "chaos_overrun"}

        def settled() -> bool:
            done = {r.task_id for r in self.runs() if r.finished is not None and not r.interrupted}
            return expected <= done and not any(self.leftovers().values())

        # On a timeout the outcome reports what is missing or left over.
        with contextlib.suppress(AssertionError):
            wait_for(settled, timeout, "every job to complete and every slot to come back")

    def wait_quiet(self, seconds: float, timeout: float = 120) -> None:
        """Wait until no run has started or finished for ``seconds`` and none is open.

        :meth:`wait_settled` returns once every accepted job has run once; a second copy
        of a job (a duplicate delivery) may still be in the broker then, or postponed by a
        countdown. Once the nodes have been idle for longer than that countdown, every
        copy that was going to run has run."""
        last: list[tuple[str, datetime, datetime | None]] | None = None
        since = time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            now = sorted((r.task_id, r.started, r.finished) for r in self.runs())
            if now != last:
                last, since = now, time.monotonic()
            elif all(f is not None for _, _, f in now) and time.monotonic() - since >= seconds:
                return
            time.sleep(0.5)

    def outcome(self, fault: str, recovery: float | None) -> Outcome:
        """Check the invariants' figures from the records: see the module's docstring."""
        runs = self.runs()
        by_id: dict[str, list[Run]] = defaultdict(list)
        for run in runs:
            by_id[run.task_id].append(run)
        overruns = {j.id for j in self.jobs if j.task == "chaos_overrun"}
        completed = {r.task_id for r in runs if r.finished is not None and not r.interrupted}
        lost = sorted(j.id for j in self.jobs if j.id not in completed and j.id not in overruns)
        lost += sorted(i for i in overruns if not by_id.get(i))
        stale = self._stale(runs)
        tasks = {j.id: j.task for j in self.jobs}
        groups: dict[tuple[str, int], list[tuple[datetime, datetime]]] = defaultdict(list)
        with_stale: dict[tuple[str, int], list[tuple[datetime, datetime]]] = defaultdict(list)
        for run in runs:
            key = self._limit_of(run, tasks[run.task_id])
            if key is not None:
                interval = (run.started, self._end(run, tasks[run.task_id]))
                with_stale[key].append(interval)
                if id(run) not in stale:
                    groups[key].append(interval)
        limits = {name: (max_overlap(spans), limit) for (name, limit), spans in groups.items()}
        notes = []
        if stale:
            worst = max(
                (max_overlap(spans), name, limit) for (name, limit), spans in with_stale.items()
            )
            notes.append(
                f"{len(stale)} run(s) of the frozen node outlived their reaped lease;"
                f" with them, {worst[1]} had {worst[0]} at once (limit {worst[2]})"
            )
        # Runs of the frozen node overlap their successors by design (see _stale).
        overlaps = {
            task_id: max_overlap((r.started, self._end(r, tasks[r.task_id])) for r in rs)
            for task_id, rs in by_id.items()
            if not any(id(r) in stale for r in rs)
        }
        # A planned job without a tenant slot may run twice at once when a connection drops
        # between its publish and its run's commit (how-it-works: "At least once, and two
        # runs at once"): noted, not held against the invariant.
        copies_at_once = {i: n for i, n in overlaps.items() if tasks[i] not in UNGUARDED}
        for task_id, n in sorted(overlaps.items()):
            if n > 1 and tasks[task_id] in UNGUARDED:
                notes.append(f"{tasks[task_id]} {task_id}: {n} copies at once (at least once)")
        self_overlap = max(copies_at_once.values(), default=0)
        unflushed = self._reran_unflushed(by_id)
        if unflushed:
            notes.append(
                f"{len(unflushed)} job(s) ended on the frozen node just before the freeze, "
                "their end not yet flushed, and ran again after the reap (the flusher's window)"
            )
        frozen_dispatched, reaped = self._reran_reaped(by_id, stale, tasks, unflushed)
        if reaped:
            notes.append(
                f"{len(reaped)} dispatched job(s) running on the frozen node ran again after"
                " the reap put them back in their lines (acks_late: as for a dead worker)"
            )
        twice = {i for i, rs in by_id.items() if len(rs) > 1} - unflushed - reaped
        return Outcome(
            fault=fault,
            accepted=len(self.jobs),
            completed=len(completed),
            duplicated=len(twice),
            failed_by_design=len(overruns),
            lost=lost,
            concurrency=limits,
            recovery=recovery,
            counter_samples=self.samples,
            counter_mismatches=sorted(set(self.mismatches)),
            leftovers=self.leftovers(),
            stale_runs=len(stale),
            self_overlap=self_overlap,
            self_overlapping=sorted(i for i, n in copies_at_once.items() if n > 1),
            notes=notes,
            ran_twice=sorted(tasks[i] for i in twice),
            reran_unflushed=len(unflushed),
            reran_reaped=len(reaped),
            frozen_dispatched=len(frozen_dispatched),
        )

    @staticmethod
    def _limit_of(run: Run, task: str) -> tuple[str, int] | None:
        """The limit a run counts against, by its task: (what is limited, the limit)."""
        if task == "chaos_slot":
            return (f"tenant slot {run.tenant}", SLOT_LIMIT)
        if task == "chaos_reroute" and run.queue == "chaos_slow":
            return (f"rerouted {run.tenant} on chaos_slow", SLOW_LIMIT)
        if task == "chaos_plain":
            return ("queue chaos_limited", QUEUE_LIMIT)
        if task == "chaos_overrun":
            return (f"tenant slot {run.tenant} (hard time limit)", OVERRUN_LIMIT)
        if task == "chaos_dispatched":
            return (f"dispatched tenant {run.tenant}", DISPATCH_LIMIT)
        return None

    def _end(self, run: Run, task: str) -> datetime:
        """When a run stopped: its record, else when its process was killed (by the test,
        or by the pool at the hard time limit)."""
        if run.finished is not None:
            return run.finished
        if task == "chaos_overrun":
            # Killed without unwinding: the pool's timer fires within a second of the limit.
            return run.started + timedelta(seconds=HARD_TIME_LIMIT + 1)
        if run.pid in self.killed:
            return self.killed[run.pid]
        return datetime.max.replace(tzinfo=run.started.tzinfo)  # still running: counts

    def _reran_unflushed(self, by_id: dict[str, list[Run]]) -> set[str]:
        """Task ids that ran again after a run of the frozen node that had finished before
        the freeze while its row still ran there (its end handed to the flusher, not yet
        committed): see :attr:`Outcome.reran_unflushed`."""
        if self.frozen is None:
            return set()
        pids, start, _ = self.frozen
        return {
            task_id
            for task_id, rs in by_id.items()
            if len(rs) > 1
            and task_id in self._frozen_tasks
            and any(r.pid in pids and r.finished is not None and r.finished <= start for r in rs)
        }

    @staticmethod
    def _reran_reaped(
        by_id: dict[str, list[Run]], stale: set[int], tasks: dict[str, str], unflushed: set[str]
    ) -> tuple[set[str], set[str]]:
        """The dispatched jobs with a stale run (running on the frozen node at the freeze),
        and those of them that ran again (not in the flusher's window): see
        :attr:`Outcome.reran_reaped`."""
        frozen = {
            i
            for i, rs in by_id.items()
            if tasks[i] == "chaos_dispatched" and any(id(r) in stale for r in rs)
        }
        return frozen, {i for i in frozen if len(by_id[i]) > 1} - unflushed

    def _stale(self, runs: list[Run]) -> set[int]:
        """Runs of the frozen node admitted before the freeze that ended after it: their
        leases were reaped meanwhile, so they overlap their successors by design. That is
        a run open at the freeze, or one whose job was admitted (its lease taken) and
        frozen before its body began, which begins only after the thaw."""
        if self.frozen is None:
            return set()
        pids, start, _ = self.frozen
        return {
            id(r)
            for r in runs
            # A frozen process writes nothing: a run open at the freeze ended after the thaw.
            if r.pid in pids
            and (r.started < start or r.task_id in self._frozen_tasks)
            and (r.finished is None or r.finished > start)
        }


def check(outcome: Outcome, *, exactly_once: bool) -> None:
    """Assert the invariants on ``outcome`` (and save it for the Reliability table first)."""
    save(outcome)
    assert not outcome.lost, f"jobs lost: {outcome.lost}"
    assert outcome.self_overlap <= 1, (
        f"{outcome.self_overlap} runs of one task id at once:"
        f" {outcome.self_overlapping} ran beside a copy of itself"
    )
    for name, (seen, limit) in outcome.concurrency.items():
        assert seen <= limit, f"{name}: {seen} at once, limit {limit}"
    assert outcome.concurrency, "no limited run was recorded"
    assert not any(outcome.leftovers.values()), outcome.leftovers
    assert outcome.counter_samples > 0
    assert not outcome.counter_mismatches, outcome.counter_mismatches
    if exactly_once:
        assert outcome.duplicated == 0, f"{outcome.duplicated} jobs ran twice: {outcome.ran_twice}"


def save(outcome: Outcome) -> None:
    """Append ``outcome`` to ``$FAIR_JOBS_CHAOS_REPORT`` (JSON lines) when it is set."""
    path = os.environ.get("FAIR_JOBS_CHAOS_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(outcome.row(), default=str) + "\n")

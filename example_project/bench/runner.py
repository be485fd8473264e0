"""Run a scenario in each mode through real Celery worker processes and collect the records.

For each mode: clear the library's tables, start fresh worker nodes
(separate ``celery worker`` processes), publish the scenario's jobs on schedule (one
publisher thread per tenant, as separate clients would), wait for every job's record, stop
the workers, and read back the records and statement counts. Each mode of each run has a
queue of its own, deleted at the end; workers are stopped and the library's rows and the
run's records are deleted whatever happens.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from django.core.management import call_command
from django.db import OperationalError, connection, connections
from django.test import override_settings

import bench.tasks  # noqa: F401  (registers the benchmark's tasks in the publisher)
from bench import statements
from bench.metrics import Record
from bench.models import JobRecord, StatementCount
from bench.modes import Mode, slow_queue_limit
from bench.scenario import Job, Scenario
from django_fair_jobs import dispatch
from django_fair_jobs.dispatch.models import DispatchJob, DispatchQueue, DispatchTenant
from django_fair_jobs.models import (
    JobDecision,
    LimitChange,
    Maintenance,
    ParkedJob,
    PlannedJob,
    PlannerRun,
    PlannerTenant,
    QueueLimit,
    RerouteCount,
    SlotLease,
    TenantQueueSlot,
    TenantWindow,
    WindowBucket,
    WorkerProcess,
)
from django_fair_jobs.queue_limits import set_limits
from example.celery import app

PROJECT_DIR = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    """The benchmark cannot run or did not finish; the message says why and what to do."""


@dataclass
class ModeResult:
    """What one mode left behind: its records and counts, read after its workers stopped."""

    mode: Mode
    origin: float
    records: list[Record]
    statements: int | None
    publisher_statements: int
    leftover: dict[str, int]
    timed_out: bool
    notes: list[str] = field(default_factory=list)
    on_path: int | None = None
    """Statements the worker processes sent from the thread that runs the jobs."""
    commits: int | None = None
    """The library's durable commits in the worker processes and the publisher."""


def describe_database() -> str:
    """The database in use, for messages and the report (no password)."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"SQLite ({s['NAME']})"
    return f"{connection.vendor} ({s.get('HOST') or 'socket'}:{s.get('PORT') or ''}/{s['NAME']})"


@contextlib.contextmanager
def database_latency(delay_ms: float) -> Iterator[None]:
    """For the block, every new connection to the database (this process's publisher and
    the worker nodes started in it) goes through a proxy that delays each chunk by
    ``delay_ms`` each way (:mod:`bench.latency`); nothing changes with 0."""
    if not delay_ms:
        yield
        return
    if connection.vendor != "postgresql":
        raise BenchError("--db-latency-ms needs PostgreSQL (DATABASE_URL=postgres://...).")
    from urllib.parse import quote

    from bench.latency import Proxy

    settings_dict = connection.settings_dict  # the dict every new connection reads
    host, port = settings_dict.get("HOST") or "127.0.0.1", settings_dict.get("PORT") or 5432
    if str(host).startswith("/"):
        raise BenchError("--db-latency-ms needs PostgreSQL over TCP, not a Unix socket.")
    proxy = Proxy(host, int(port), delay_ms)
    url = os.environ.get("DATABASE_URL")
    user = quote(settings_dict.get("USER") or "postgres", safe="")
    password = quote(settings_dict.get("PASSWORD") or "", safe="")
    name = quote(settings_dict["NAME"], safe="")
    connections.close_all()
    settings_dict["HOST"], settings_dict["PORT"] = "127.0.0.1", proxy.port
    login = f"{user}:{password}" if password else user
    os.environ["DATABASE_URL"] = f"postgres://{login}@127.0.0.1:{proxy.port}/{name}"
    try:
        yield
    finally:
        connections.close_all()
        settings_dict["HOST"], settings_dict["PORT"] = host, port
        if url is None:
            os.environ.pop("DATABASE_URL", None)
        else:
            os.environ["DATABASE_URL"] = url
        proxy.stop()


def describe_broker() -> str:
    """The broker in use, for messages and the report (no password)."""
    with app.connection_for_write() as conn:
        return str(conn.as_uri())


def check_services() -> None:
    """Refuse with a clear message if the database or the broker is unreachable.

    A PostgreSQL database that does not exist yet is created (the server must be up).
    """
    try:
        connection.ensure_connection()
    except OperationalError as exc:
        if connection.vendor == "postgresql" and "does not exist" in str(exc):
            _create_database()
        else:
            raise BenchError(
                f"The database {describe_database()} is not reachable ({_reason(exc)}). Start "
                "it (see docs/contributing.md, Running the tests) or point DATABASE_URL at one."
            ) from exc
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=5)
    except Exception as exc:
        raise BenchError(
            f"The broker {describe_broker()} is not reachable ({_reason(exc)}). Start it (see "
            "docs/contributing.md, Running the tests) or point CELERY_BROKER_URL at one."
        ) from exc


def _reason(exc: BaseException) -> str:
    return str(exc).strip().rstrip(".") or type(exc).__name__


def _create_database() -> None:
    # Imported here: only a PostgreSQL run gets this far, and psycopg is then installed
    # as Django's driver; the demo (SQLite, the `demo` extra) must import without it.
    import psycopg

    s = connection.settings_dict
    params = connection.get_connection_params()
    params["dbname"] = "postgres"
    try:
        with psycopg.connect(**params, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{s["NAME"]}"')
    except psycopg.Error as exc:
        raise BenchError(
            f"PostgreSQL has no database {s['NAME']!r} and it could not be created: {exc}"
        ) from exc
    connection.ensure_connection()


def prepare_database() -> None:
    """Apply migrations (quietly)."""
    call_command("migrate", verbosity=0)


def clear_library_state() -> None:
    """Delete every row of the library's tables, so each mode starts from nothing."""
    SlotLease.objects.all().delete()
    ParkedJob.objects.all().delete()
    QueueLimit.objects.all().delete()
    TenantQueueSlot.objects.all().delete()
    WorkerProcess.objects.all().delete()
    Maintenance.objects.all().delete()
    WindowBucket.objects.all().delete()
    TenantWindow.objects.all().delete()
    RerouteCount.objects.all().delete()
    PlannedJob.objects.all().delete()
    PlannerTenant.objects.all().delete()
    PlannerRun.objects.all().delete()
    JobDecision.objects.all().delete()
    LimitChange.objects.all().delete()
    DispatchJob.objects.all().delete()
    DispatchTenant.objects.all().delete()
    DispatchQueue.objects.all().delete()


def vacuum_library_tables() -> None:
    """On PostgreSQL, vacuum and analyze the library's tables and the job records, so that
    every mode starts from the same physical state: the dead rows an earlier mode, run or
    command left (bench_operations deletes 300,000 rows) would otherwise slow the modes
    that come after it, until autovacuum gets to them."""
    if connection.vendor != "postgresql":
        return
    from django.apps import apps

    tables = [m._meta.db_table for m in apps.get_app_config("fair_jobs").get_models()]
    tables += [JobRecord._meta.db_table, StatementCount._meta.db_table]
    with connection.cursor() as cursor:
        # Names from the models, quoted: VACUUM takes no parameters.
        cursor.execute("VACUUM (ANALYZE) " + ", ".join(f'"{t}"' for t in tables))


def library_leftover() -> dict[str, int]:
    """What a finished mode left in the library's tables (all must be 0)."""
    return {
        "leases": SlotLease.objects.count(),
        "parked": ParkedJob.objects.filter(woken_at__isnull=True).count(),
        "parked_rows": ParkedJob.objects.count(),
        "slot_jobs": sum(TenantQueueSlot.objects.values_list("current_jobs", flat=True)),
        "queue_jobs": sum(QueueLimit.objects.values_list("current_jobs", flat=True)),
        "planned": PlannedJob.objects.count(),
        "dispatch_rows": DispatchJob.objects.count(),
        "dispatch_in_flight": sum(dispatch.in_flight().values()),
    }


def delete_queue(queue: str) -> None:
    """Delete ``queue`` and whatever it still holds (it was the run's own)."""
    # A queue that was never declared has nothing to delete.
    with app.connection_for_write() as conn, contextlib.suppress(Exception):
        conn.default_channel.queue_delete(queue)  # type: ignore[attr-defined]
        conn.default_channel.exchange_delete(queue)  # type: ignore[attr-defined]


class WorkerNode:
    """One ``celery worker`` process (a node), with its pool children."""

    def __init__(
        self, name: str, queue: str, pool: str, concurrency: int, log: Path, env: dict[str, str]
    ) -> None:
        self.name = name
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(PROJECT_DIR), **env}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "celery", "-A", "example", "worker",
                    "-P", pool, "-c", str(concurrency), "-Q", queue,
                    "-n", f"{name}@%h", "-l", "INFO",
                    "--without-gossip", "--without-mingle", "--without-heartbeat",
                ],
                cwd=PROJECT_DIR, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # its own process group, so no child outlives it
            )  # fmt: skip

    def wait_ready(self, timeout: float = 60) -> None:
        """Wait until the worker consumes; raise BenchError if it dies or hangs."""
        deadline = time.monotonic() + timeout
        while " ready." not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise BenchError(f"Worker {self.name} did not start; see {self.log}")
            time.sleep(0.1)

    def stop(self, timeout: float = 60) -> None:
        """Warm shutdown (running jobs finish); SIGKILL the group if it takes too long."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        # Pool children that outlived their parent, if any.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """Stop the node and its children now."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def publish(
    mode: Mode,
    queue: str,
    run: str,
    jobs: tuple[Job, ...],
    origin: float,
    on_error: list[BaseException],
) -> None:
    """Publish ``jobs`` at ``origin + offset``, one thread per tenant, and wait for all."""
    task = app.tasks[mode.task]
    if mode.reroutes:
        # Only publishers read the rules; each run has queues of its own, so they are set
        # here rather than in the task's declaration. The run's queue is the declared one.
        setattr(task, "fair_reroute", mode.rules(run))  # noqa: B010
        setattr(task, "queue", queue)  # noqa: B010
    by_tenant: dict[str, list[Job]] = {}
    for job in jobs:
        by_tenant.setdefault(job.tenant, []).append(job)

    def publisher(tenant_jobs: list[Job]) -> None:
        try:
            # A client (a web process) keeps its database connection open between
            # requests (CONN_MAX_AGE); so does this thread, from before its first job, so
            # that no job's wait includes opening a connection.
            connection.ensure_connection()
            for job in tenant_jobs:
                delay = origin + job.offset - time.time()
                if delay > 0:
                    time.sleep(delay)
                task.apply_async(
                    kwargs={
                        "run": run,
                        "mode": mode.name,
                        "job": job.id,
                        "tenant": job.tenant,
                        "enqueued_at": time.time(),
                        "seconds": job.seconds,
                        "kind": job.work,
                    },
                    queue=queue,
                )
        except BaseException as exc:  # reported by the caller, not lost in a thread
            on_error.append(exc)
        finally:
            # A planned or rerouting task's publish uses this thread's database
            # connections; they must not outlive it (one run starts hundreds of threads).
            from django.db import connections

            connections.close_all()

    threads = [
        threading.Thread(target=publisher, args=(js,), daemon=True) for js in by_tenant.values()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_mode(
    mode: Mode,
    scenario: Scenario,
    *,
    run: str,
    nodes: int,
    concurrency: int,
    pool: str,
    tenant_limit: int,
    timeout: float,
    log_dir: Path,
    progress: Callable[[Mode, int, int, float], None],
) -> ModeResult:
    """Run ``scenario`` in ``mode`` and return its records (see the module docstring)."""
    clear_library_state()
    vacuum_library_tables()
    queue = mode.queue(run)
    consumed = ",".join(mode.queues(run))
    env = {
        "BENCH_RUN": run,
        "BENCH_MODE": mode.name,
        "BENCH_QUEUE": queue,
        "BENCH_RULES": json.dumps(mode.rules(run)),
        "FAIR_JOBS_DEFAULT_MAX_JOBS": str(tenant_limit),
        "FAIR_JOBS_ENFORCE": "false" if mode.shadow else "true",
        "FAIR_JOBS_SLOT_HANDOFF": str(mode.handoff),
        "FAIR_JOBS_ASYNC_RELEASE": "true" if mode.async_release else "false",
        "BENCH_WEIGHTS": json.dumps(scenario.weights),
        # As in production: with DEBUG on (the example project's default) Django keeps and
        # formats every statement, a cost per statement no deployment pays.
        "DEBUG": "false",
    }
    # The publisher asks the weights too (at enqueue), in this process.
    os.environ["BENCH_WEIGHTS"] = env["BENCH_WEIGHTS"]
    if mode.caps_slow_queue:
        set_limits(mode.slow_queue(run), max_jobs=slow_queue_limit(nodes * concurrency))
    workers: list[WorkerNode] = []
    errors: list[BaseException] = []
    # The publisher's settings as the workers': the mode's enforcement, DEBUG off.
    as_workers = override_settings(FAIR_JOBS_ENFORCE=not mode.shadow, DEBUG=False)
    timed_out = False
    total = len(scenario.jobs)
    try:
        for i in range(nodes):
            workers.append(
                WorkerNode(f"bench{i + 1}-{mode.name}-{run}", consumed, pool, concurrency,
                           log_dir / f"{mode.name}-node{i + 1}.log", env)
            )  # fmt: skip
            if i == 0:
                # The first node declares the run's queues before the others start: kombu's
                # SQLAlchemy transport (the demo's broker) inserts a queue's row on its first
                # declaration, and two nodes declaring it at once fail on the unique name.
                workers[0].wait_ready()
        for w in workers:
            w.wait_ready()
        before, commits_before = statements.count(), statements.commits()
        origin = time.time()
        publisher = threading.Thread(
            target=publish, args=(mode, queue, run, scenario.jobs, origin, errors), daemon=True
        )
        # The publisher evaluates rules too (rerouting, the planner): in a shadow mode it
        # records instead of acting, like the workers.
        as_workers.enable()
        publisher.start()
        deadline = time.monotonic() + timeout
        done = 0
        while True:
            done = (
                JobRecord.objects.filter(run=run, mode=mode.name).values("job").distinct().count()
            )
            progress(mode, done, total, time.time() - origin)
            if done >= total or errors:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(w.proc.poll() is not None for w in workers):
                logs = ", ".join(str(w.log) for w in workers)
                raise BenchError(f"A {mode.name} worker exited early; see {logs}")
            time.sleep(0.2)
        publisher.join()
        publisher_statements = statements.count() - before
        publisher_commits = statements.commits() - commits_before
        if errors:
            raise BenchError(f"Publishing failed in mode {mode.name}: {errors[0]!r}") from errors[0]
        # A redelivered or duplicated job would show up shortly after the last one.
        time.sleep(0.5)
    finally:
        if getattr(as_workers, "wrapped", None) is not None:
            as_workers.disable()
        for w in workers:
            w.stop()
        for name in mode.queues(run):
            delete_queue(name)
    counts = StatementCount.objects.filter(run=run, mode=mode.name)
    pids_counted = set(counts.values_list("pid", flat=True))
    rows = list(
        JobRecord.objects.filter(run=run, mode=mode.name).values_list(
            "job", "tenant", "enqueued_at", "started_at", "finished_at", "pid"
        )
    )
    notes = []
    missing = {pid for *_, pid in rows} - pids_counted
    if missing:
        notes.append(f"{len(missing)} worker process(es) did not report statement counts")
    result = ModeResult(
        mode=mode,
        origin=origin,
        records=[Record(j, t, q, s, e, pid) for j, t, q, s, e, pid in rows],
        statements=None
        if missing
        else sum(counts.values_list("statements", flat=True)) + publisher_statements,
        publisher_statements=publisher_statements,
        on_path=None if missing else sum(counts.values_list("on_path", flat=True)),
        commits=None
        if missing
        else sum(counts.values_list("commits", flat=True)) + publisher_commits,
        leftover=library_leftover(),
        timed_out=timed_out,
        notes=notes,
    )
    if timed_out:
        result.notes.append(f"gave up after {timeout:.0f} s with {done}/{total} jobs done")
    return result


def cleanup(run: str) -> None:
    """Delete the run's records and the library's rows."""
    JobRecord.objects.filter(run=run).delete()
    StatementCount.objects.filter(run=run).delete()
    clear_library_state()


def new_run_id() -> str:
    """A short id that tags one invocation's rows."""
    return uuid.uuid4().hex[:12]

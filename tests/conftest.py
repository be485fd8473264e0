"""Fixtures: real Celery worker processes sharing the test database and a real broker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, connections

from django_fair_jobs import db, identity

ROOT = Path(__file__).resolve().parent.parent


def is_postgres() -> bool:
    """True when the suite runs against PostgreSQL."""
    return connection.vendor == "postgresql"


def runs_sql() -> bool:
    """True when the stores run their named statements (PostgreSQL, the ``sql`` engine);
    False on the ORM path (SQLite, or the ``orm`` engine on PostgreSQL)."""
    return db.uses_sql("default")


ENGINES = ("sql", "orm")
"""The stores' two paths: PostgreSQL's named statements, and the ORM path every other
database takes."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run a test that uses ``engine`` once per path the test database can take: both on
    PostgreSQL (the ORM path runs there too), the ORM path alone elsewhere."""
    if "engine" in metafunc.fixturenames:
        postgres = settings.DATABASES["default"]["ENGINE"].endswith("postgresql")
        metafunc.parametrize("engine", ENGINES if postgres else ("orm",), indirect=True)


@pytest.fixture
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The stores' contract: the same test against each path (see :data:`ENGINES`), so
    PostgreSQL's statements and the ORM path answer alike. A module opts in with
    ``pytest.mark.usefixtures("engine")``."""
    name: str = request.param
    if name == "orm":
        monkeypatch.setattr(db, "uses_sql", lambda alias: False)
    return name


def database_url() -> str:
    """A DATABASE_URL that points worker processes at the test database."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    user = db.get("USER") or "postgres"
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{user}@{host}:{port}/{db['NAME']}"


@dataclass
class Worker:
    """A running ``celery worker`` process started by a test."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    children: list[int] = field(default_factory=list)
    stopping: bool = False

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def child_pids(self) -> list[int]:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return [int(p) for p in out.split()]

    def begin_stop(self) -> None:
        """Ask for a warm shutdown (SIGTERM) without waiting for it. Sent once: a second
        signal during the shutdown would not be the same request."""
        if self.proc.poll() is None and not self.stopping:
            self.proc.send_signal(signal.SIGTERM)
            self.stopping = True

    def stop(self, timeout: float = 30) -> None:
        """Warm shutdown (SIGTERM), waiting for running jobs to finish."""
        if self.proc.poll() is None:
            self.begin_stop()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL the worker and its pool processes: nothing runs its ``finally``."""
        pids = self.children = self.child_pids()
        for pid in [self.proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def wait_for(predicate: Callable[[], Any], timeout: float, message: str) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``message``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s: {message}")
        time.sleep(0.05)


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--chaos-full``: run the whole chaos suite, not only its fast subset."""
    parser.addoption(
        "--chaos-full",
        action="store_true",
        help="run the whole chaos suite (tests marked chaos_full); see scripts/chaos.sh",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the slow chaos runs out unless ``--chaos-full`` is given: they are reported as
    deselected, and ``bash scripts/chaos.sh`` runs them."""
    if config.getoption("--chaos-full"):
        return
    kept = [item for item in items if "chaos_full" not in item.keywords]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if "chaos_full" in i.keywords])
        items[:] = kept


@pytest.fixture(autouse=True, scope="session")
def _configured_celery_app() -> None:
    """Configure the publishing side: importing the app makes it current, with the test
    broker and result backend, before any test publishes or reads a result."""
    import tests.celery_app  # noqa: F401


@pytest.fixture
def broker_env() -> dict[str, str]:
    """Environment for worker processes; empties the test broker before each test."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url(),
        "PYTHONPATH": str(ROOT),
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "CELERY_RESULT_BACKEND": settings.CELERY_RESULT_BACKEND,
    }
    if settings.CELERY_BROKER_URL.startswith("redis://"):
        import redis

        # The test broker database is the suite's own: flushing it also drops unacknowledged
        # messages of killed workers, which a queue purge would leave to be redelivered.
        redis.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()
    else:
        from tests.celery_app import app

        with app.connection_for_write() as conn:
            for queue in ("fair", "default", "other"):
                # A queue that does not exist yet has nothing to purge.
                with contextlib.suppress(Exception):
                    conn.default_channel.queue_purge(queue)  # type: ignore[attr-defined]
    return env


@pytest.fixture
def start_worker(broker_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start real ``celery worker`` processes; all are stopped at the end of the test."""
    workers: list[Worker] = []

    def start(
        name: str = "w1",
        pool: str = "prefork",
        concurrency: int = 2,
        queues: str = "fair",
        extra_env: dict[str, str] | None = None,
    ) -> Worker:
        log = tmp_path / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.celery_app",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-Q",
            queues,
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "INFO",
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**broker_env, **(extra_env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name, proc, log)
        workers.append(worker)
        wait_for(
            lambda: " ready." in worker.output() or proc.poll() is not None,
            60,
            f"worker {name} to start",
        )
        assert proc.poll() is None, worker.output()
        return worker

    yield start
    # Every node shuts down at once: a warm shutdown takes seconds (billiard's pool
    # processes alone sleep one before they exit), and nodes stopped in turn add them up.
    for worker in workers:
        worker.begin_stop()
    for worker in workers:
        worker.stop()


@pytest.fixture
def celery_app() -> Any:
    """The test suite's Celery app (publishing side)."""
    from tests.celery_app import app

    return app


@pytest.fixture
def process() -> Any:
    """A registered worker process (its row only: no heartbeat thread), to hold leases."""
    import uuid

    pid = uuid.uuid4()
    identity.register_process(process_id=pid, node="n@h", hostname="h", pid=1)
    return pid


@pytest.fixture
def fresh_ledger() -> Iterator[None]:
    """Each test starts with a ledger of its own, as a new worker process does, and its
    flusher thread is stopped after it. The ledger keeps its lock: the handoff's keeper
    thread, started once per process, waits on it (a new lock would fail its wait)."""
    from django_fair_jobs.admission import flusher
    from django_fair_jobs.admission.ends import LEDGER

    def fresh() -> None:
        with LEDGER.lock:
            lock = LEDGER.lock
            LEDGER.__init__()  # type: ignore[misc]
            LEDGER.lock = lock

    fresh()
    yield
    flusher.stop()
    fresh()


@pytest.fixture
def in_process_worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A registered worker process that in-process job runs (:func:`run_as_worker`) use
    as theirs: without it the first run would start a heartbeat and a planner thread in
    the test process."""
    import uuid

    pid = uuid.uuid4()
    identity.register_process(process_id=pid, node="bad@host", hostname="host", pid=7)
    monkeypatch.setattr(identity, "current_process_id", lambda node=None: pid)
    monkeypatch.setattr(identity, "registered_process_id", lambda: pid)
    return pid


@pytest.fixture
def health_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``CONN_HEALTH_CHECKS`` on, re-armed as after the prerun's ``close_old_connections``
    on a connection kept between jobs; returns the health checks made (``is_usable``)."""
    wrapper = connections["default"]  # the connection itself, not its thread's proxy
    wrapper.ensure_connection()
    monkeypatch.setitem(wrapper.settings_dict, "CONN_HEALTH_CHECKS", True)
    monkeypatch.setattr(wrapper, "health_check_enabled", True)
    monkeypatch.setattr(wrapper, "health_check_done", False)
    checks: list[int] = []
    real = wrapper.is_usable

    def counted() -> bool:
        checks.append(1)
        return real()

    monkeypatch.setattr(wrapper, "is_usable", counted)
    return checks


def cut_kept_connection() -> int:
    """Terminate the server process of this thread's connection, as a database restart
    does to a connection kept between jobs, and re-arm its health check as the prerun
    does; returns that process's id (the next statement must come from another)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()
    connection.health_check_done = False  # type: ignore[attr-defined]
    return int(pid)


def run_as_worker(
    task: Any,
    args: tuple[Any, ...],
    *,
    task_id: str,
    headers: dict[str, Any],
    redelivered: bool = False,
) -> Any:
    """Run ``task`` as a worker runs a delivered message: ``FairTask.__call__`` with the
    request of a delivery from the ``fair`` queue (slots, parking and all); ``redelivered``
    as the broker marks a message it gives again."""
    task.push_request(
        id=task_id,
        headers=headers,
        delivery_info={"routing_key": "fair", "redelivered": redelivered},
        hostname="bad@host",
        is_eager=False,
        called_directly=False,
        args=args,
        kwargs={},
    )
    try:
        return task(*args)
    finally:
        task.pop_request()

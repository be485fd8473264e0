"""Fixtures of the chaos suite: a throwaway PostgreSQL server (migrated once per session)
and a cluster of worker nodes per test, on RabbitMQ."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Connection

from tests.chaos.harness import BROKER, ROOT, Cluster
from tests.chaos.pgserver import ThrowawayPostgres

DBNAME = "chaos"


@pytest.fixture(scope="session")
def chaos_pg() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL server of the suite's own, with the library's tables, on a free port."""
    try:
        with Connection(BROKER, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        pytest.fail(
            f"RabbitMQ is not reachable at {BROKER} ({exc}): the chaos suite needs it;"
            " start it with `rabbitmq-server -detached` or set FAIR_JOBS_CHAOS_BROKER"
        )
    server = ThrowawayPostgres()
    try:
        server.init()
        server.start()
        subprocess.run(
            ["psql", server.url(), "-qc", f"CREATE DATABASE {DBNAME}"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "-v", "0"],
            cwd=ROOT,
            env={
                **os.environ,
                "DJANGO_SETTINGS_MODULE": "tests.settings",
                "PYTHONPATH": str(ROOT),
                "DATABASE_URL": server.url(DBNAME),
            },
            check=True,
        )
        yield server
    finally:
        server.destroy()


@pytest.fixture
def cluster(chaos_pg: ThrowawayPostgres, tmp_path: Path) -> Iterator[Cluster]:
    """An empty chaos database and queues; the nodes a test starts are stopped after it."""
    cluster = Cluster(chaos_pg, DBNAME, tmp_path)
    cluster.reset()
    try:
        yield cluster
    finally:
        cluster.stop()

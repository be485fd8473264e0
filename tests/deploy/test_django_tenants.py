"""django-tenants with tenant-schemas-celery, on real schemas and real worker processes.

The project (``tests/deploy/tenants_project/``) has its own settings module, so it runs in
subprocesses against a database of its own: ``migrate_schemas --shared`` puts the
library's tables in the public schema; a script creates two tenants and, in each tenant's
schema, publishes a job of each task (dispatched and planned, ``FairTask`` first and
``TenantTask`` first) with no tenant in its arguments; then a worker starts. The jobs wait
in rows until a worker process publishes them, in whatever schema that process is in: each
must still run in its own tenant's schema, under that schema as its fair tenant, while the
library's statements find its tables in the public schema through the tenant's
search_path.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from tests.conftest import ROOT, Worker, wait_for

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="django-tenants needs PostgreSQL schemas"
    ),
    pytest.mark.workers,
]

SETTINGS = "tests.deploy.tenants_project.settings"
TENANTS = ("tenant_a", "tenant_b")
TASKS = {
    "dispatched_fair_first",
    "dispatched_tenant_first",
    "planned_fair_first",
    "planned_tenant_first",
}


def _server(dbname: str) -> psycopg.Connection[Any]:
    params = connection.settings_dict
    return psycopg.connect(
        dbname=dbname,
        user=params.get("USER") or "postgres",
        host=params.get("HOST") or "127.0.0.1",
        port=params.get("PORT") or 5432,
        password=params.get("PASSWORD") or None,
        autocommit=True,
    )


@pytest.fixture
def project_db() -> Iterator[str]:
    """The project's own database, named after the test database so that two runs of the
    suite (two test databases) never share it; dropped at the end."""
    name = f"{connection.settings_dict['NAME']}_tenants"
    with _server("postgres") as server:
        server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        server.execute(f'CREATE DATABASE "{name}"')
    yield name
    with _server("postgres") as server:
        server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _env(broker_env: dict[str, str], dbname: str) -> dict[str, str]:
    params = connection.settings_dict
    user, host = params.get("USER") or "postgres", params.get("HOST") or "127.0.0.1"
    url = f"postgres://{user}@{host}:{params.get('PORT') or 5432}/{dbname}"
    return {**broker_env, "DJANGO_SETTINGS_MODULE": SETTINGS, "DATABASE_URL": url}


def _run(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _start_worker(env: dict[str, str], log: Path) -> Worker:
    cmd = [
        sys.executable, "-m", "celery", "-A", "tests.deploy.tenants_project.celery_app",
        "worker", "-P", "prefork", "-c", "2", "-Q", "tenants", "-n", "tenants@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    worker = Worker("tenants", proc, log)
    wait_for(lambda: " ready." in worker.output() or proc.poll() is not None, 60, "the worker")
    assert proc.poll() is None, worker.output()
    return worker


def _notes(db: psycopg.Connection[Any], schema: str) -> set[tuple[str, str, str]]:
    rows = db.execute(f"SELECT task, schema, tenant FROM {schema}.notes_note").fetchall()
    return {(str(task), str(ran_in), str(tenant)) for task, ran_in, tenant in rows}


def test_held_jobs__run_in_their_tenants_schema__library_rows_shared(
    project_db: str, broker_env: dict[str, str], tmp_path: Path
) -> None:
    env = _env(broker_env, project_db)
    _run(env, "-m", "django", "migrate_schemas", "--shared", "-v", "0")
    published = _run(env, "-m", "tests.deploy.tenants_project.publish")
    # The public schema gives no tenant: the job waits in the line of the jobs without one.
    held = [line.split() for line in published.splitlines() if line.startswith("public held:")]
    assert [words[2] for words in held] == ["''"], published
    worker = _start_worker(env, tmp_path / "worker.log")
    try:
        with _server(project_db) as db:
            expected = {s: {(t, s, s) for t in TASKS} for s in TENANTS}
            wait_for(
                lambda: all(_notes(db, s) == expected[s] for s in TENANTS),
                60,
                f"every job in its tenant's schema: {[_notes(db, s) for s in TENANTS]}",
            )
            # The library's tables are the public schema's only, and its rows came and went
            # there, though each job's own statements ran with a tenant's search_path.
            shared = db.execute(
                "SELECT table_schema FROM information_schema.tables "
                "WHERE table_name = 'fair_jobs_dispatchjob'"
            ).fetchall()
            assert shared == [("public",)]
            # The public schema's job waits for its countdown; it is not the test's to run.
            db.execute("DELETE FROM public.fair_jobs_dispatchjob WHERE task_id = %s", [held[0][3]])
            wait_for(
                lambda: (
                    db.execute(
                        "SELECT (SELECT COUNT(*) FROM public.fair_jobs_dispatchjob)"
                        " + (SELECT COUNT(*) FROM public.fair_jobs_plannedjob)"
                    ).fetchone()
                    == (0,)
                ),
                30,
                "the dispatched and planned rows to go as their jobs end",
            )
    finally:
        worker.stop()
    assert "Traceback" not in worker.output(), worker.output()[-5000:]

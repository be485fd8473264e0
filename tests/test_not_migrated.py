"""A project that has not run ``manage.py migrate fair_jobs`` (or ran only part of it) is
told so where it first bites: a worker refuses to start, a publish raises an error, and
``fair_jobs_status`` answers, each saying to run ``manage.py migrate fair_jobs``; a
system check warns about a fair task that has no way to find its tenant (issue: operators
see the default mode, item 4). Each test runs a fresh project of its own in a
subprocess, on a database of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from tests.conftest import ROOT
from tests.projects import write_project

_FILES = {
    "proj/settings.py": """
import os
import environ
SECRET_KEY = "x"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_fair_jobs",
                  "shop"]
DATABASES = {"default": environ.Env().db_url("DATABASE_URL")}
CELERY_BROKER_URL = os.environ["CELERY_BROKER_URL"]
CELERY_TASK_ACKS_LATE = True
""",
    "shop/tasks.py": """
from celery import shared_task
from django_fair_jobs import FairTask

class Shop(FairTask):
    @classmethod
    def fair_tenant(cls, shop_id, *args, **kwargs):
        return shop_id

@shared_task(base=Shop)
def sync_catalog(shop_id):
    return shop_id
""",
}

MIGRATE = "manage.py migrate fair_jobs"


@pytest.fixture
def project(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh project and the environment to run it with, on an empty database of its
    own (a PostgreSQL database created for the test, or a SQLite file)."""
    write_project(tmp_path, _FILES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "FAIR_JOBS_"))}
    env.update(
        PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}",
        PYTHONDONTWRITEBYTECODE="1",
        CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
    )
    database: str | None = None
    if connection.vendor == "postgresql":
        database = f"fair_jobs_unmigrated_{uuid.uuid4().hex[:8]}"
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{database}"')
        s = connection.settings_dict
        env["DATABASE_URL"] = (
            f"postgres://{s.get('USER') or 'postgres'}@{s.get('HOST') or '127.0.0.1'}:"
            f"{s.get('PORT') or 5432}/{database}"
        )
    else:
        env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    try:
        yield tmp_path, env
    finally:
        if database is not None:
            with connection.cursor() as cursor:
                cursor.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def _manage(
    project: tuple[Path, dict[str, str]], *args: str, code: str | None = None
) -> subprocess.CompletedProcess[str]:
    path, env = project
    command = [sys.executable, "manage.py", *args] + (["-c", code] if code else [])
    return subprocess.run(
        command, cwd=path, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _migrate(project: tuple[Path, dict[str, str]], *targets: str) -> None:
    for target in targets:
        done = _manage(project, "migrate", *target.split(), "-v0", "--skip-checks")
        assert done.returncode == 0, done.stderr


def _partly_migrated(project: tuple[Path, dict[str, str]]) -> None:
    """Every app migrated but fair_jobs' last migration."""
    _migrate(project, "contenttypes", "auth")
    leaf = sorted(p.stem for p in (ROOT / "django_fair_jobs/migrations").glob("0*.py"))
    _migrate(project, f"fair_jobs {leaf[-2]}")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("state", ["unmigrated", "partly"])
def test_not_migrated__delay_raises_an_error_that_says_run_migrate(
    project: tuple[Path, dict[str, str]], state: str
) -> None:
    if state == "partly":
        _partly_migrated(project)
    else:
        _migrate(project, "contenttypes", "auth")
    code = "from shop.tasks import sync_catalog; sync_catalog.delay(7)"
    done = _manage(project, "shell", code=code)
    assert done.returncode != 0
    assert MIGRATE in done.stderr, done.stderr
    assert "NotMigratedError" in done.stderr, done.stderr
    assert "explicit type casts" not in done.stderr


@pytest.mark.django_db(transaction=True)
def test_not_migrated__status_says_run_migrate_without_a_traceback(
    project: tuple[Path, dict[str, str]],
) -> None:
    _migrate(project, "contenttypes", "auth")
    done = _manage(project, "fair_jobs_status")
    assert done.returncode != 0
    assert MIGRATE in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("state", ["unmigrated", "partly"])
def test_not_migrated__the_worker_refuses_to_start(
    project: tuple[Path, dict[str, str]], state: str
) -> None:
    if state == "partly":
        _partly_migrated(project)
    path, env = project
    log = path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "proj", "worker", "-P", "solo",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            cwd=path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and " ready." not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    output = log.read_text(errors="replace")
    assert " ready." not in output
    assert proc.returncode != 0
    assert MIGRATE in output, output


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("tasks_py", "extra", "warned"),
    [
        ("plain", "", True),
        ("own", "", False),
        ("plain", 'FAIR_JOBS_DEFAULT_TENANT = "shared"\n', False),
        ("plain", 'FAIR_JOBS_TENANT_RESOLVER = "django_fair_jobs.tenants.schema_name"\n', False),
    ],
)
def test_w006__a_fair_task_with_no_way_to_find_its_tenant(
    project: tuple[Path, dict[str, str]], tasks_py: str, extra: str, warned: bool
) -> None:
    path, _ = project
    if tasks_py == "plain":
        (path / "shop/tasks.py").write_text(
            "from celery import shared_task\nfrom django_fair_jobs import FairTask\n\n"
            "@shared_task(base=FairTask)\ndef sync_catalog(shop_id):\n    return shop_id\n"
        )
    with (path / "proj/settings.py").open("a") as f:
        f.write(extra)
    done = _manage(project, "check")
    assert done.returncode == 0, done.stderr
    assert ("fair_jobs.W006" in done.stderr) == warned, done.stderr
    if warned:
        assert "shop.tasks.sync_catalog" in done.stderr
        assert "FAIR_JOBS_DEFAULT_TENANT" in done.stderr


def test_not_migrated__another_database__the_command_names_it() -> None:
    # Where a router puts the library's tables in another database, migrating "default"
    # would not help: the command the error gives must migrate that one.
    from django_fair_jobs import db

    other = str(db.not_migrated("jobs", ["0026_x"]))
    assert f"{MIGRATE} --database jobs" in other
    assert str(db.not_migrated("default", ["0026_x"])).endswith(MIGRATE)

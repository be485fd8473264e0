"""The package as a newcomer installs it: the README's install lines build the sdist and
the wheel from a copy of this checkout and install the wheel, with only the `postgres` and
`redis` extras, into a fresh virtualenv; the README's settings, Celery app and task,
pasted into a new `django-admin startproject`, migrate on PostgreSQL and run one
dispatched job through a real worker with no other edit. So the wheel ships its SQL files,
templates and migrations, and the README's blocks work as written. The `rabbitmq` extra
is installed alone into another virtualenv and connects to RabbitMQ.

Every block is read from the README's "Install" section, in its order: the install lines
(`sh`), the settings, the Celery app and the task (`python`), and the commands that migrate,
start the worker and send a job (`sh`).
"""

from __future__ import annotations

import os
import re
import shutil
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

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.workers,
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="the install test migrates a new project on PostgreSQL (the PostgreSQL pass)",
    ),
]

BROKER_DB = 7
"""The Redis database of the new project's broker: no other test's."""


def install_blocks() -> list[tuple[str, str]]:
    """The fenced blocks of the README's "Install" section: (language, text)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def _run(command: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _venv(path: Path) -> dict[str, str]:
    """A fresh virtualenv at ``path``, and an environment where its commands come first."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "FAIR_JOBS_"))}
    env.pop("PYTHONPATH", None)
    env.update(PATH=f"{path / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(path))
    return env


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of this checkout, as a clone would have it (no virtualenv, no build)."""
    ignored = shutil.ignore_patterns(
        ".git", ".venv", ".nox", "site", "dist", "build", "*.egg-info", "__pycache__",
        ".mypy_cache", ".ruff_cache", ".pytest_cache", ".demo", "*.sqlite3",
    )  # fmt: skip
    return Path(shutil.copytree(ROOT, tmp_path / "django-fair-jobs", ignore=ignored))


@pytest.fixture
def database() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database, dropped at the end."""
    name = f"fair_jobs_install_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')
    s = connection.settings_dict
    yield (
        f"postgres://{s.get('USER') or 'postgres'}@{s.get('HOST') or '127.0.0.1'}:"
        f"{s.get('PORT') or 5432}/{name}"
    )
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _new_project(tmp_path: Path, env: dict[str, str], blocks: list[tuple[str, str]]) -> Path:
    """``django-admin startproject proj`` and ``startapp shop``, with the README's settings
    appended, its Celery app and its task pasted."""
    (_, settings_py), (_, celery_py), (_, tasks_py) = blocks
    site = tmp_path / "site"
    site.mkdir()
    _run("django-admin startproject proj . && python manage.py startapp shop", site, env)
    with (site / "proj/settings.py").open("a") as f:
        f.write("\n" + settings_py)
    (site / "proj/celery.py").write_text(celery_py)
    with (site / "proj/__init__.py").open("a") as f:
        f.write("from .celery import app as celery_app\n")
    (site / "shop/tasks.py").write_text(tasks_py)
    return site


def test_readme_install__a_new_project_runs_a_dispatched_job(
    tmp_path: Path, checkout: Path, database: str
) -> None:
    import redis

    blocks = install_blocks()
    assert [lang for lang, _ in blocks] == ["sh", "python", "python", "python", "sh"]
    env = _venv(tmp_path / "venv")
    for line in blocks[0][1].splitlines():
        _run(line, checkout, env)
    built = sorted(p.name for p in (checkout / "dist").iterdir())
    assert built == ["django_fair_jobs-0.1.0-py3-none-any.whl", "django_fair_jobs-0.1.0.tar.gz"]
    broker = f"{settings.CELERY_BROKER_URL.rsplit('/', 1)[0]}/{BROKER_DB}"
    redis.Redis.from_url(broker).flushdb()
    env.update(DATABASE_URL=database, CELERY_BROKER_URL=broker)
    site = _new_project(tmp_path, env, blocks[1:4])
    migrate, worker_command, send = blocks[4][1].splitlines()
    _run(migrate, site, env)
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            ["bash", "-c", f"exec {worker_command}"], cwd=site, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        _run(send, site, env)
        while "succeeded" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline + 60, log.read_text()
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait(30)
    output = log.read_text(errors="replace")
    assert "shop.tasks.import_csv" in output and "imported 42 for acme" in output
    assert "Traceback" not in output


def test_rabbitmq_extra__alone__connects(tmp_path: Path, checkout: Path) -> None:
    env = _venv(tmp_path / "venv")
    _run("pip install build && python -m build --wheel", checkout, env)
    _run('pip install "dist/django_fair_jobs-0.1.0-py3-none-any.whl[rabbitmq]"', checkout, env)
    connect = (
        'python -c "from kombu import Connection; '
        "c = Connection('amqp://guest:guest@127.0.0.1:5672//'); "
        'c.ensure_connection(max_retries=1); print(c.transport.driver_type)"'
    )
    assert _run(connect, tmp_path, env).strip() == "amqp"

"""One test per system check id, and the settings' read order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import celery
import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection

from django_fair_jobs import FairTask, decisions
from django_fair_jobs.checks import check_settings, check_unknown_names, check_worker_connections
from django_fair_jobs.conf import fair_settings
from tests.projects import write_project


def ids(**overrides: Any) -> list[str]:
    from django.test import override_settings

    with override_settings(**overrides):
        return [m.id for m in check_settings() if m.id]


def test_defaults__pass() -> None:
    assert ids() == []


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_e001__default_max_jobs(value: Any) -> None:
    assert ids(FAIR_JOBS_DEFAULT_MAX_JOBS=value) == ["fair_jobs.E001"]


def test_e002__on_limit() -> None:
    assert ids(FAIR_JOBS_ON_LIMIT="drop") == ["fair_jobs.E002"]


def test_e003__retry_countdown() -> None:
    assert ids(FAIR_JOBS_RETRY_COUNTDOWN=-1) == ["fair_jobs.E003"]


def test_e004__worker_timeout() -> None:
    assert ids(FAIR_JOBS_WORKER_TIMEOUT=0) == ["fair_jobs.E004"]


def test_e005__heartbeat_interval() -> None:
    assert ids(FAIR_JOBS_HEARTBEAT_INTERVAL="10") == ["fair_jobs.E005"]


def test_e006__heartbeat_more_than_half_the_timeout() -> None:
    assert ids(FAIR_JOBS_HEARTBEAT_INTERVAL=31, FAIR_JOBS_WORKER_TIMEOUT=60) == ["fair_jobs.E006"]
    assert ids(FAIR_JOBS_HEARTBEAT_INTERVAL=30, FAIR_JOBS_WORKER_TIMEOUT=60) == []


def test_e007__tenant_warning_interval() -> None:
    assert ids(FAIR_JOBS_TENANT_WARNING_INTERVAL=-5) == ["fair_jobs.E007"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"FAIR_JOBS_DISPATCH_SLACK": -1},
        {"FAIR_JOBS_DISPATCH_SLACK": 1.5},
        {"FAIR_JOBS_DISPATCH_LOST_AFTER": 0},
        {"FAIR_JOBS_DISPATCH_POLL_INTERVAL": -1},
        {"FAIR_JOBS_DISPATCH_POLL_INTERVAL": "1"},
        {"FAIR_JOBS_DISPATCH_POLL_INTERVAL": float("nan")},
    ],
)
def test_e019__dispatch_settings(overrides: dict[str, Any]) -> None:
    assert ids(**overrides) == ["fair_jobs.E019"]


def test_e019__dispatch_settings__edges_pass() -> None:
    # 0 turns the due poll off (maintenance still looks); slack 0 is allowed.
    assert ids(FAIR_JOBS_DISPATCH_POLL_INTERVAL=0, FAIR_JOBS_DISPATCH_SLACK=0) == []


@pytest.mark.parametrize("raw", ["sixty", "1e3x", "5 min", ""])
def test_e008__unparsable_environment(
    monkeypatch: pytest.MonkeyPatch, settings: Any, raw: str
) -> None:
    del settings.FAIR_JOBS_WORKER_TIMEOUT
    monkeypatch.setenv("FAIR_JOBS_WORKER_TIMEOUT", raw)
    messages = [m for m in check_settings() if m.id]
    assert [m.id for m in messages] == ["fair_jobs.E008"]
    assert repr(raw) in messages[0].msg


def test_environment__parsed_strictly(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    del settings.FAIR_JOBS_WORKER_TIMEOUT
    monkeypatch.setenv("FAIR_JOBS_WORKER_TIMEOUT", " 1e3 ")
    assert fair_settings.WORKER_TIMEOUT == 1000.0


def test_check_command__fails_on_bad_setting(settings: Any) -> None:
    settings.FAIR_JOBS_ON_LIMIT = "drop"
    with pytest.raises(SystemCheckError, match=r"fair_jobs\.E002"):
        call_command("check")


def test_settings__django_setting_beats_environment(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    monkeypatch.setenv("FAIR_JOBS_DEFAULT_MAX_JOBS", "7")
    settings.FAIR_JOBS_DEFAULT_MAX_JOBS = 3
    assert fair_settings.DEFAULT_MAX_JOBS == 3
    del settings.FAIR_JOBS_DEFAULT_MAX_JOBS
    assert fair_settings.DEFAULT_MAX_JOBS == 7
    monkeypatch.delenv("FAIR_JOBS_DEFAULT_MAX_JOBS")
    assert fair_settings.DEFAULT_MAX_JOBS == 1


def test_settings__django_values_remembered_until_a_setting_changes(settings: Any) -> None:
    from django.test import override_settings

    from django_fair_jobs import conf

    assert fair_settings.ON_LIMIT == "park"
    # Read once from django.conf.settings (a missing one raises there each time), then
    # remembered...
    assert conf._django_values["FAIR_JOBS_ON_LIMIT"] is conf._UNSET
    # ...until Django says a setting changed, however it was changed.
    with override_settings(FAIR_JOBS_ON_LIMIT="retry"):
        assert fair_settings.ON_LIMIT == "retry"
    assert fair_settings.ON_LIMIT == "park"
    settings.FAIR_JOBS_ON_LIMIT = "retry"
    assert fair_settings.ON_LIMIT == "retry"
    del settings.FAIR_JOBS_ON_LIMIT
    assert fair_settings.ON_LIMIT == "park"


def test_e008__empty_enforce_is_an_error_not_shadow_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    # `FAIR_JOBS_ENFORCE=` (a template left blank) once meant False: shadow mode, silently.
    monkeypatch.setenv("FAIR_JOBS_ENFORCE", "")
    messages = [m for m in check_settings() if m.id]
    assert [m.id for m in messages] == ["fair_jobs.E008"]
    assert "FAIR_JOBS_ENFORCE" in messages[0].msg and "True or False" in (messages[0].hint or "")
    with pytest.raises(ValueError, match="FAIR_JOBS_ENFORCE"):
        decisions.enforcing()


def warnings_of(check: Any, warning_id: str) -> list[str]:
    return [m.msg for m in check() if m.id == warning_id]


def test_w002__unknown_setting__names_the_closest(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    for name in [n for n in os.environ if n.startswith("FAIR_JOBS_")]:
        monkeypatch.delenv(name)  # e.g. the chaos suite's FAIR_JOBS_CHAOS_BROKER
    assert warnings_of(check_unknown_names, "fair_jobs.W002") == []
    settings.FAIR_JOBS_DEFAULT_MAX_JOB = 3
    monkeypatch.setenv("FAIR_JOBS_ENFORSE", "false")
    messages = warnings_of(check_unknown_names, "fair_jobs.W002")
    assert messages == [
        "The environment variable FAIR_JOBS_ENFORSE is not a django-fair-jobs setting; "
        "did you mean FAIR_JOBS_ENFORCE?",
        "The setting FAIR_JOBS_DEFAULT_MAX_JOB is not a django-fair-jobs setting; "
        "did you mean FAIR_JOBS_DEFAULT_MAX_JOBS?",
    ]


def test_w003__unknown_task_option__names_the_closest() -> None:
    from tests.celery_app import app

    assert warnings_of(check_unknown_names, "fair_jobs.W003") == []

    @app.task(base=FairTask, name="tests.typo_task", fair_max_job=2, fair_tenant_queue=[])
    def typo_task() -> None:
        """A task whose options are misspelt."""

    try:
        assert warnings_of(check_unknown_names, "fair_jobs.W003") == [
            "Task tests.typo_task: fair_max_job is not a FairTask option; "
            "did you mean fair_max_jobs?",
            "Task tests.typo_task: fair_tenant_queue is not a FairTask option; "
            "did you mean fair_tenant?",
        ]
    finally:
        app.tasks.unregister("tests.typo_task")


def test_old_setting_names__not_read__unknown_like_any_typo(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    # 0.1.0 is unreleased: a name renamed before it is no setting at all (W002), and the
    # setting keeps its default.
    for name in [n for n in os.environ if n.startswith("FAIR_JOBS_")]:
        monkeypatch.delenv(name)
    settings.FAIR_JOBS_MAX_THROTTLING_WINDOW = 3600
    monkeypatch.setenv("FAIR_JOBS_WINDOW_SCOPE", "queue")
    assert fair_settings.REROUTE_MAX_WINDOW == 86400
    assert fair_settings.REROUTE_SCOPE == "task"
    warned = warnings_of(check_unknown_names, "fair_jobs.W002")
    assert [m.split(";")[0] for m in warned] == [
        "The environment variable FAIR_JOBS_WINDOW_SCOPE is not a django-fair-jobs setting",
        "The setting FAIR_JOBS_MAX_THROTTLING_WINDOW is not a django-fair-jobs setting",
    ]


def test_old_task_option_names__unknown_options__w003() -> None:
    from tests.celery_app import app

    @app.task(base=FairTask, name="tests.old_names", fair_tenant_queues=[], fair_window_scope="q")
    def old_names() -> None:
        """A task that uses option names that are not the library's."""

    try:
        warned = warnings_of(check_unknown_names, "fair_jobs.W003")
        assert [m.split(";")[0] for m in warned] == [
            "Task tests.old_names: fair_tenant_queues is not a FairTask option",
            "Task tests.old_names: fair_window_scope is not a FairTask option",
        ]
        assert old_names.fair_reroute is None
    finally:
        app.tasks.unregister("tests.old_names")


@pytest.mark.django_db
def test_w004__worker_connections_closed_per_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.celery_app import app

    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    monkeypatch.setitem(app.conf, "CELERY_DB_REUSE_MAX", None)
    messages = warnings_of(check_worker_connections, "fair_jobs.W004")
    if connection.vendor == "sqlite":
        assert messages == []  # opening a SQLite file costs next to nothing
        return
    assert len(messages) == 1 and "CONN_MAX_AGE" in messages[0]
    # Celery 5.6 and later close every connection around each job without it; 5.5 did not.
    closes_all = tuple(celery.VERSION[:2]) >= (5, 6)
    assert ("CELERY_DB_REUSE_MAX is not set" in messages[0]) == closes_all
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 600)
    assert len(warnings_of(check_worker_connections, "fair_jobs.W004")) == int(closes_all)
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    monkeypatch.setitem(app.conf, "CELERY_DB_REUSE_MAX", 1000)
    messages = warnings_of(check_worker_connections, "fair_jobs.W004")
    assert len(messages) == 1 and "CELERY_DB_REUSE_MAX" not in messages[0]
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 600)
    assert warnings_of(check_worker_connections, "fair_jobs.W004") == []


_SETTINGS = """
SECRET_KEY = "x"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_fair_jobs",
                  "shop"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}
CELERY_BROKER_URL = "memory://"
"""


def _project(tmp_path: Path, tasks_py: str) -> Path:
    return write_project(tmp_path, {"proj/settings.py": _SETTINGS, "shop/tasks.py": tasks_py})


def _manage(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "FAIR_JOBS_"))}
    env["PYTHONPATH"] = str(project)
    # The tests rewrite the project's files between two runs: no bytecode of the old ones.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


_BAD_PLAN = """
from celery import shared_task
from django_fair_jobs import FairTask

@shared_task(base=FairTask, fair_plan={"enqueue_interval": 0, "enqueue_jobs": 5})
def sync_catalog(merchant_id):
    pass
"""


def test_check_command__sees_task_options_of_a_project_like_the_example(tmp_path: Path) -> None:
    # Nothing imports shop/tasks.py before the checks run: they load the task modules as a
    # worker does, so the bad fair_plan fails `check` (in CI), not the worker's start.
    project = _project(tmp_path, _BAD_PLAN)
    result = _manage(project, "check")
    assert result.returncode != 0
    assert "fair_jobs.E015" in result.stderr
    assert "Task shop.tasks.sync_catalog: fair_plan: enqueue_interval" in result.stderr
    tasks_py = project / "shop/tasks.py"
    written = tasks_py.stat().st_mtime_ns
    fixed = _project(tmp_path, _BAD_PLAN.replace('"enqueue_interval": 0', '"enqueue_interval": 1'))
    # Rewritten within the same second, at the same size: a cached bytecode file of the
    # bad version would still look fresh to Python.
    os.utime(tasks_py, ns=(written, written))
    result = _manage(fixed, "check")
    assert result.returncode == 0, result.stderr


def test_healthcheck_command__sees_task_options(tmp_path: Path) -> None:
    project = _project(tmp_path, _BAD_PLAN)
    assert _manage(project, "migrate", "-v0", "--skip-checks").returncode == 0
    result = _manage(project, "fair_jobs_healthcheck")
    assert result.returncode != 0
    assert "settings FAILED: fair_jobs.E015: Task shop.tasks.sync_catalog" in result.stdout


def test_e018__task_module_that_cannot_import__reported_by_check(tmp_path: Path) -> None:
    project = _project(tmp_path, _BAD_PLAN.replace("fair_plan=", "fair_max_jobs=0, fair_plan="))
    result = _manage(project, "check")
    assert result.returncode != 0
    assert "fair_jobs.E018" in result.stderr
    assert "FairTaskConfigError" in result.stderr and "fair_max_jobs must be" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_e021__prepared_statements_is_a_bool(value: Any) -> None:
    assert ids(FAIR_JOBS_PREPARED_STATEMENTS=value) == ["fair_jobs.E021"]
    assert ids(FAIR_JOBS_PREPARED_STATEMENTS=False) == []


@pytest.mark.parametrize("value", ["0.5", -1, 6, float("nan"), True])
def test_e022__slot_handoff_is_seconds_from_0_to_5(value: Any) -> None:
    assert ids(FAIR_JOBS_SLOT_HANDOFF=value) == ["fair_jobs.E022"]
    assert ids(FAIR_JOBS_SLOT_HANDOFF=0.5) == []
    assert ids(FAIR_JOBS_SLOT_HANDOFF=0) == []


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_e023__async_release_is_a_bool(value: Any) -> None:
    assert ids(FAIR_JOBS_ASYNC_RELEASE=value) == ["fair_jobs.E023"]
    assert ids(FAIR_JOBS_ASYNC_RELEASE=True) == []

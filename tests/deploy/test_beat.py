"""The planner driven by Celery beat: a real ``celery beat`` process with
django-celery-beat's ``DatabaseScheduler`` reads a ``PeriodicTask`` row for
``django_fair_jobs.plan``, a real worker runs that task, it promotes the jobs waiting in
their tenants' virtual queues, and the worker runs them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from django_fair_jobs.models import PlannedJob, PlannerRun
from tests.conftest import ROOT, Worker, wait_for
from tests.testapp.models import JobRun

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]

NO_PLANNER_THREADS = {"FAIR_JOBS_PLANNER_THREADS": "false"}
"""Worker processes start no planner thread: only beat's ``django_fair_jobs.plan`` can
promote, as in a project that drives its planners from beat alone."""


@pytest.fixture
def processes(broker_env: dict[str, str], tmp_path: Path) -> Iterator[list[Worker]]:
    """Processes started by the test (``celery worker``, ``celery beat``), stopped at its end."""
    started: list[Worker] = []
    yield started
    for proc in started:
        proc.stop()


def start(
    processes: list[Worker], env: dict[str, str], tmp_path: Path, name: str, *args: str
) -> Worker:
    """Start ``celery -A tests.testapp.beat_app <args>`` with its output in a log file."""
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.testapp.beat_app", *args],
            cwd=ROOT,
            env={**env, **NO_PLANNER_THREADS},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    process = Worker(name, proc, log)
    processes.append(process)
    return process


@pytest.mark.skipif(
    importlib.util.find_spec("django_celery_beat") is None,
    reason="django-celery-beat is in the dev extra only (2.9 requires Django < 6.1): "
    "the main CI cell runs this test",
)
def test_beat_database_scheduler__plan_task_promotes_waiting_jobs__a_worker_runs_them(
    processes: list[Worker], broker_env: dict[str, str], tmp_path: Path
) -> None:
    from django_celery_beat.models import (
        IntervalSchedule,
        PeriodicTask,
    )

    from tests.testapp.beat_app import beat_planned

    # Jobs wait in their tenants' virtual queues: nothing reaches the broker at delay().
    results = [beat_planned.delay(tenant) for tenant in ("t1", "t2", "t1")]
    assert PlannedJob.objects.filter(promoted_at__isnull=True).count() == 3

    every_second, _ = IntervalSchedule.objects.get_or_create(
        every=1, period=IntervalSchedule.SECONDS
    )
    PeriodicTask.objects.create(
        name="fair jobs planner",
        task="django_fair_jobs.plan",
        interval=every_second,
        kwargs=json.dumps({"task_name": beat_planned.name}),
        queue="default",  # the plan's planner_queue (FAIR_JOBS_PLANNER_QUEUE's default)
    )

    worker = start(
        processes, broker_env, tmp_path, "worker",
        "worker", "-P", "prefork", "-c", "2", "-Q", "fair,default", "-n", "beat-w@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
    )  # fmt: skip
    wait_for(lambda: " ready." in worker.output(), 60, "the worker to start")
    beat = start(
        processes, broker_env, tmp_path, "beat",
        "beat", "-S", "django_celery_beat.schedulers:DatabaseScheduler",
        "--max-interval", "1", "-l", "INFO",
        "--pidfile", str(tmp_path / "beat.pid"), "-s", str(tmp_path / "beat-schedule"),
    )  # fmt: skip

    assert [r.get(timeout=60) for r in results] == ["t1:done", "t2:done", "t1:done"], (
        worker.output() + beat.output()
    )
    # Promoted by beat's task, in one planner run (the workers' threads had not looked yet).
    assert "Sending due task fair jobs planner (django_fair_jobs.plan)" in beat.output()
    assert "{'tests.beat.planned': 3}" in worker.output()
    run = PlannerRun.objects.get(task_name=beat_planned.name)
    assert (run.runs_total, run.last_promoted) == (1, 3)
    assert JobRun.objects.count() == 3
    wait_for(lambda: not PlannedJob.objects.exists(), 30, "the planned rows to go at start")


@pytest.mark.parametrize("threads", [True, False])
def test_planner_threads_setting__a_worker_process_starts_its_planner_thread_or_none(
    threads: bool, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from django_fair_jobs import planner

    settings.FAIR_JOBS_PLANNER_THREADS = threads
    monkeypatch.setattr(planner, "_thread", None)
    stop = threading.Event()
    try:
        planner.start_thread(stop)  # the suite's app has planned tasks
        assert (planner._thread is not None) is threads
    finally:
        stop.set()
        if planner._thread is not None:
            planner._thread.join(10)

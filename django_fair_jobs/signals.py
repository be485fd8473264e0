"""Celery signal handlers: give slots back when a process stops or a job is revoked."""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import task_revoked, worker_init, worker_process_shutdown, worker_shutdown

logger = logging.getLogger("django_fair_jobs.signals")


@worker_init.connect
def _on_worker_init(**kwargs: Any) -> None:
    # Refuse to start on invalid settings instead of misbehaving at the first job.
    from django_fair_jobs.checks import fail_fast_on_bad_settings

    fail_fast_on_bad_settings()


@worker_process_shutdown.connect
def _on_process_shutdown(**kwargs: Any) -> None:
    # A prefork child exits: retire its row so its slots come back at once.
    from django_fair_jobs.workers import shutdown

    shutdown()


@worker_shutdown.connect
def _on_worker_shutdown(**kwargs: Any) -> None:
    # The solo and threads pools run tasks in the main process.
    from django_fair_jobs.workers import shutdown

    shutdown()


@task_revoked.connect
def _on_task_revoked(request: Any = None, terminated: bool = False, **kwargs: Any) -> None:
    # A revoked (or expired) delivery never reaches its release: drop its reservation and
    # parked row, and a terminated job's lease, so no slot waits for the reaper.
    from django_fair_jobs.slots import forget_task

    task_id = getattr(request, "id", None)
    if task_id is None:
        return
    try:
        forget_task(str(task_id), terminated=bool(terminated))
    except Exception:
        logger.exception("Could not drop the slots of revoked job %s", task_id)

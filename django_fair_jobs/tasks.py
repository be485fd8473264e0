"""Celery tasks of django-fair-jobs, for projects that drive the planners from Celery beat
(or django-celery-beat), alone with ``FAIR_JOBS_PLANNER_THREADS = False`` or beside the
workers' planner threads."""

from __future__ import annotations

from typing import Any

from celery import shared_task


@shared_task(name="django_fair_jobs.plan", ignore_result=True)
def plan(task_name: str | None = None) -> dict[str, Any]:
    """Run the due planner of ``task_name`` (default: every planned task). Schedule it on
    your ``planner_queue`` as often as the shortest ``enqueue_interval``; the planner lock
    keeps runs one at a time, whoever starts them."""
    from celery import current_app

    from django_fair_jobs.planner import planned_tasks, run

    done: dict[str, Any] = {}
    for task in planned_tasks(current_app):
        if task_name is None or task.name == task_name:
            report = run(task)
            done[task.name] = None if report is None else report.promoted
    return done

"""Queue limits for plain Celery tasks (``FAIR_JOBS_LIMIT_PLAIN_TASKS = True``): at worker
start-up every task that is not a ``FairTask`` is wrapped, so that a job of a limited
queue goes through the same hold protocol (:func:`django_fair_jobs.admission.enter`) as a
fair task's, with no tenant."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from celery import current_app

from django_fair_jobs import admission, messages, queue_limits, routing
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.conf import fair_settings

if TYPE_CHECKING:
    from celery import Celery, Task


def install(app: Celery | None = None) -> list[str]:
    """Apply queue limits to every task of ``app`` that is not a ``FairTask`` (those are
    limited already), without changing the tasks: each one's ``run`` is wrapped so that a
    job from a limited queue takes its place first, or is parked.

    Called by the worker at start-up when ``FAIR_JOBS_LIMIT_PLAIN_TASKS`` is True, before
    any pool process exists, so every process runs the wrapped tasks. Returns the names
    of the tasks wrapped.
    """
    celery_app = app or current_app
    wrapped: list[str] = []
    for name, task in sorted(celery_app.tasks.items()):
        if messages.is_fair(task) or name.startswith("celery.") or _is_wrapped(task):
            continue
        task.run = _limited_run(task, task.run)  # type: ignore[method-assign]
        # A tracer built earlier keeps the old run; the next job builds a new one.
        task.__trace__ = None
        wrapped.append(name)
    return wrapped


def _is_wrapped(task: Task[Any, Any]) -> bool:
    return bool(getattr(task.run, "_fair_limited", False))


def _limited_run(task: Task[Any, Any], run: Any) -> Any:
    @functools.wraps(run)
    def limited_run(*args: Any, **kwargs: Any) -> Any:
        from celery.exceptions import Ignore

        request = task.request
        if request.is_eager or request.id is None:
            return run(*args, **kwargs)
        queue = routing.request_queue(task)
        # A woken copy goes through enter() even if the limit is gone, to consume its
        # parked row (or be dropped as a stale copy).
        if not queue_limits.is_limited(queue) and not fair_headers.is_woken(task.request):
            return run(*args, **kwargs)
        grant = admission.enter(
            task, tenant=None, queue=queue, limit=fair_settings.DEFAULT_MAX_JOBS,
            on_limit=fair_settings.ON_LIMIT, retry_countdown=fair_settings.RETRY_COUNTDOWN,
            args=args, kwargs=kwargs,
        )  # fmt: skip
        if grant is None:
            raise Ignore()
        try:
            return run(*args, **kwargs)
        finally:
            admission.release(grant, app=task.app)

    limited_run._fair_limited = True  # type: ignore[attr-defined]
    return limited_run

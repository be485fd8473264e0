"""The publish side: the bridge from async code to the database, and the hold of a
fair dispatch job in its tenant's line.

A ``FairTask`` publish may read and write rows (a rerouting count, a planned job, a
shadow-mode decision, and whatever a task's ``fair_tenant`` looks up). Django refuses
database access from a thread that runs an event loop (``SynchronousOnlyOperation``), so
``delay()`` from an async view would fail where plain Celery's works. Called from such a
thread, the publish runs on a small pool of publisher threads instead, and the caller waits
for it, as it waits for the broker in plain Celery's ``delay()``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import close_old_connections

from django_fair_jobs import dispatch
from django_fair_jobs.db import after_commit

if TYPE_CHECKING:
    from celery import Task
    from celery.result import AsyncResult

T = TypeVar("T")

PUBLISHER_THREADS = 4
"""Threads that run publishes called from event loops; each keeps its own connection."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def in_event_loop() -> bool:
    """True where Django would raise ``SynchronousOnlyOperation``: this thread runs an event
    loop and ``DJANGO_ALLOW_ASYNC_UNSAFE`` is not set."""
    if os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE"):
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _publisher_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(PUBLISHER_THREADS, thread_name_prefix="fair-jobs-publish")
        return _pool


def _as_a_request(call: Callable[[], T]) -> T:
    # The pool thread's connection lives as a request's would: closed when broken or older
    # than CONN_MAX_AGE, before and after each publish, so it is never left open forever.
    close_old_connections()
    try:
        return call()
    finally:
        close_old_connections()


def off_event_loop(call: Callable[[], T]) -> T:
    """Run ``call()`` here, or on a publisher thread when this thread runs an event loop;
    either way return its result or raise its exception."""
    if not in_event_loop():
        return call()
    return _publisher_pool().submit(_as_a_request, call).result()


def hold_for_dispatch(
    task: Task[Any, Any],
    tenant: str | None,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> AsyncResult[Any]:
    """Store a job of a ``fair_dispatch`` task in its tenant's line (one round trip) and
    publish whatever that dispatched at once (this job, while its queue has room);
    returns its ``AsyncResult``. See :mod:`django_fair_jobs.dispatch`."""
    job = dispatch.prepare(task, _dispatch_options(task), tenant, args, kwargs, options)
    _publish_after_commit(task, dispatch.enqueue(job))
    result = task.AsyncResult(job.task_id)
    parent = task.app.current_worker_task
    if parent is not None and options.get("add_to_parent", True):
        parent.add_trail(result)  # as Celery's send_task does for a job sent from a job
    return result


def hold_many_for_dispatch(
    task: Task[Any, Any], items: list[tuple[str | None, Any, Any, dict[str, Any]]]
) -> list[AsyncResult[Any]]:
    """Store many jobs of a ``fair_dispatch`` task, ``(tenant, args, kwargs, options)``
    each, in their lines in one round trip, and publish what that dispatched; returns
    their ``AsyncResult``s in the order given."""
    options = _dispatch_options(task)
    jobs = [dispatch.prepare(task, options, t, a, k, o) for t, a, k, o in items]
    _publish_after_commit(task, dispatch.enqueue_many(jobs))
    return [task.AsyncResult(job.task_id) for job in jobs]


def _publish_after_commit(task: Task[Any, Any], ready: list[dispatch.Ready]) -> None:
    """Publish what an enqueue dispatched; inside the caller's ``atomic()``, once it
    commits (the rows are the caller's until then: a worker would not find them)."""
    if not ready:
        return
    app = task.app
    if not after_commit(lambda: dispatch.publish(app, ready), dispatch.alias()):
        dispatch.publish(app, ready)


def _dispatch_options(task: Task[Any, Any]) -> dispatch.Options:
    raw = getattr(task, "fair_dispatch", None)
    # Parsed once per task (it imports the weights callable), not at every enqueue.
    cached = task.__dict__.get("_fair_dispatch_options")
    if cached is not None and cached[0] is raw:
        parsed = cached[1]
    else:
        parsed = dispatch.parse(raw)
        task.__dict__["_fair_dispatch_options"] = (raw, parsed)
    if parsed is None:
        raise dispatch.DispatchError(f"{task.name}: fair_dispatch is not set.")
    return parsed  # type: ignore[no-any-return]

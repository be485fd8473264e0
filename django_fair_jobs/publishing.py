"""The publish pipeline of a ``FairTask`` job (:func:`prepare`): check it, mark its
headers, hold it in its tenant's line or virtual queue, or count it by the rerouting rules
and pick its queue; and the bridge from async code to the database.

A ``FairTask`` publish may read and write rows (a rerouting count, a planned job, a
shadow-mode decision, and whatever a task's ``fair_tenant`` looks up). Django refuses
database access from a thread that runs an event loop (``SynchronousOnlyOperation``), so
``delay()`` from an async view would fail where plain Celery's works. Called from such a
thread, the publish runs on a small pool of publisher threads instead, and the caller waits
for it, as it waits for the broker in plain Celery's ``delay()``.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from celery.utils import uuid
from django.db import DatabaseError, close_old_connections, connections
from kombu.utils.json import dumps

from django_fair_jobs import db, decisions, dispatch, planner, reroute, tenants, validation
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.db import after_commit
from django_fair_jobs.errors import FairArgumentsError, TaskIdError
from django_fair_jobs.tenants import warn_missing_tenant

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
    """Run ``call()`` (a publish) here, or on a publisher thread when this thread runs an
    event loop; either way return its result or raise its exception, or
    :class:`~django_fair_jobs.errors.NotMigratedError` for a database error that comes of
    the library's migrations not being applied."""
    try:
        if not in_event_loop():
            return call()
        # In the caller's context, as asgiref's sync_to_async runs a call: a tenant
        # resolver reads contextvars the caller's middleware set.
        context = contextvars.copy_context()
        return _publisher_pool().submit(context.run, _as_a_request, call).result()
    except DatabaseError as exc:
        problem = db.schema_error(exc, dispatch.alias())
        if problem is None:
            raise
        # Not chained: the database's own hint ("add explicit type casts") points away.
        raise problem from None


def hold_for_dispatch(
    task: Task[Any, Any],
    tenant: str | None,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> AsyncResult[Any]:
    """Store a job of a ``fair_dispatch`` task in its tenant's line and publish whatever
    that dispatched at once (this job, while its queue has room); returns its
    ``AsyncResult``. See :mod:`django_fair_jobs.dispatch`.

    In autocommit that is one round trip (sent again once if its reply is lost: see
    :func:`dispatch.enqueue`). Inside the caller's ``atomic()``
    only the job's row is written (it commits with the caller's data, and holds no line or
    queue row while the caller's transaction lasts); it enters its line and is dispatched
    once the transaction commits. A ``self.retry()`` of a dispatched job inside the job's own
    ``atomic()`` is stored when the job's run ends instead, as Celery's retry is published
    whether the job's transaction commits or not."""
    job = dispatch.prepare(task, _dispatch_options(task), tenant, args, kwargs, options)
    alias = dispatch.alias()
    db.require_migrated_once(alias)
    request = task.request
    if getattr(request, "fair_retrying", False) and connections[alias].in_atomic_block:
        _deferred_retries.__dict__.setdefault("jobs", []).append(job)
    elif connections[alias].in_atomic_block:
        _store_until_commit(task, [job])
    else:
        ready = dispatch.enqueue(job)
        dispatch.publish(task.app, ready)
    result = task.AsyncResult(job.task_id)
    parent = task.app.current_worker_task
    if parent is not None and options.get("add_to_parent", True):
        parent.add_trail(result)  # as Celery's send_task does for a job sent from a job
    return result


_deferred_retries = threading.local()
"""Retries of the dispatched job this thread runs, asked inside the job's own ``atomic()``
(see :func:`hold_for_dispatch`), until :func:`take_deferred_retries`."""


def take_deferred_retries() -> list[dispatch.Job]:
    """The retries this thread's dispatched job asked for inside its own ``atomic()``, once:
    stored by the job's run when it ends."""
    jobs: list[dispatch.Job] = _deferred_retries.__dict__.pop("jobs", [])
    return jobs


def hold_many_for_dispatch(
    task: Task[Any, Any], items: list[tuple[str | None, Any, Any, dict[str, Any]]]
) -> list[AsyncResult[Any]]:
    """Store many jobs of a ``fair_dispatch`` task, ``(tenant, args, kwargs, options)``
    each, in their lines in one round trip, and publish what that dispatched (inside the
    caller's ``atomic()``, once it commits); returns their ``AsyncResult``s in the order
    given."""
    options = _dispatch_options(task)
    jobs = [dispatch.prepare(task, options, t, a, k, o) for t, a, k, o in items]
    db.require_migrated_once(dispatch.alias())
    if connections[dispatch.alias()].in_atomic_block:
        _store_until_commit(task, jobs)
    else:
        dispatch.publish(task.app, dispatch.enqueue_many(jobs))
    return [task.AsyncResult(job.task_id) for job in jobs]


class _DispatchAfterCommit:
    """What runs once the caller's transaction commits: a dispatch of each queue its jobs
    went to, once per queue however many jobs the transaction stored. A dispatch that
    fails is logged, not raised: the caller's data has committed, and the jobs with it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.queues: set[str] = set()
        self.done = False

    def __call__(self) -> None:
        # Django's captureOnCommitCallbacks runs it and leaves it in the transaction's
        # list: the jobs stored after that need one of their own.
        self.done = True
        dispatch.dispatch_queues(self.app, sorted(self.queues))  # logs, never raises


def _store_until_commit(task: Task[Any, Any], jobs: list[dispatch.Job]) -> None:
    """Inside the caller's ``atomic()``: write the jobs' rows alone (one statement), and
    dispatch their queues once the caller's transaction commits.

    The transaction's first such call registers the dispatch; later ones add their queues
    to it. It is found among the transaction's commit callbacks, so a savepoint rolled back
    with it takes it away and the next call registers another: one that survives covers
    every job stored after it (a savepoint that can still roll it back holds them too)."""
    dispatch.stage(jobs)
    app, alias = task.app, dispatch.alias()
    pending = next(
        (
            entry[1]
            for entry in connections[alias].run_on_commit
            if isinstance(entry[1], _DispatchAfterCommit)
            and entry[1].app is app
            and not entry[1].done
        ),
        None,
    )
    if pending is None:
        pending = _DispatchAfterCommit(app)
        after_commit(pending, alias)
    pending.queues.update(job.queue for job in jobs)


def _dispatch_options(task: Task[Any, Any]) -> dispatch.Options:
    # A FairTask's (this module is below the task class: see messages.is_fair).
    raw = getattr(task, "fair_dispatching")()  # noqa: B009
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


@dataclass
class Prepared:
    """A job ready to publish, or held: ``held`` is the ``AsyncResult`` of a job that waits
    in its tenant's line or virtual queue (nothing goes to the broker now); otherwise the
    job goes to the broker with ``task_id`` and ``options`` (headers marked, queue picked)."""

    task_id: str | None
    options: dict[str, Any]
    held: AsyncResult[Any] | None = None


def check_arguments(task: Task[Any, Any], args: Any, kwargs: Any) -> None:
    """Raise :class:`~django_fair_jobs.errors.FairArgumentsError` if kombu's JSON cannot
    store the job's arguments: a parked, planned or dispatched job is kept as JSON."""
    try:
        dumps([args or (), kwargs or {}])
    except (TypeError, ValueError) as exc:
        raise FairArgumentsError(
            f"{task.name}: the job's arguments cannot be stored as JSON ({exc}). A job that "
            "is parked or planned is kept as JSON whatever task_serializer says; pass ids, "
            "strings, numbers, lists and dicts (turn sets into lists, objects into ids)."
        ) from None


def prepare(
    task: Any,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
    *,
    link: Any = None,
    link_error: Any = None,
) -> Prepared:
    """The publish pipeline of a ``FairTask`` job, in order: check the arguments and the
    task id; mark the headers (tenant, dispatch, plan, wake); hold the job in its tenant's
    line (``fair_dispatch``) or virtual queue (``fair_plan``), or in shadow mode record
    that it would have been; else count it by the rerouting rules and pick its queue."""
    check_arguments(task, args, kwargs)
    problem = validation.task_id_problem(task_id)
    if problem is not None:
        raise TaskIdError(f"{task.name}: {problem}.")
    headers, dispatched = _mark(task, args, kwargs, options)
    tenant = headers[fair_headers.TENANT]
    eager = task.app.conf.task_always_eager
    if dispatched is None and not eager and task.fair_dispatching():
        if decisions.enforcing():
            held = _with_links(options, headers, link, link_error, task_id)
            return Prepared(task_id, options, hold_for_dispatch(task, tenant, args, kwargs, held))
        # Shadow mode: the job would wait in its tenant's line; it goes to the broker.
        task_id = _record_hold(task, tenant, options, task_id, "dispatch")
    if task.fair_plan and fair_headers.PLAN not in headers and not eager:
        if decisions.enforcing():
            # A first publish of a planned task waits in its tenant's virtual queue; a
            # promotion and every re-publish of one (retry, wake-up) carry the header.
            held = _with_links(options, headers, link, link_error, task_id)
            return Prepared(task_id, options, planner.intercept(task, tenant, args, kwargs, held))
        # Shadow mode: the job would wait in its tenant's virtual queue; it goes to the
        # broker at once, marked as promoted so that no re-publish is held either.
        headers[fair_headers.PLAN] = fair_headers.PLAN_SHADOW
        task_id = _record_hold(task, tenant, options, task_id, "planner")
    task_id = _reroute(task, headers, args, kwargs, task_id, options)
    options["headers"] = headers
    return Prepared(task_id, options)


def _mark(task: Any, args: Any, kwargs: Any, options: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The job's headers, from its options' ``fair_*`` keys (popped); and the dispatched
    row id it carries, if any."""
    headers = dict(options.get("headers") or {})
    # A dispatched job's header names its row; a re-publish built from its request (a
    # retry) must wait in line again, so only the dispatch itself carries it.
    headers.pop(fair_headers.DISPATCH, None)
    dispatched = options.pop("fair_dispatched", None)
    if dispatched is not None:
        headers[fair_headers.DISPATCH] = int(dispatched)
    if options.pop("fair_planned", False):
        headers[fair_headers.PLAN] = 1  # a promotion: it goes to the broker
    # The wake number marks one specific re-publish of a parked job; a retry or any
    # other re-publish built from that request must not inherit it.
    headers.pop(fair_headers.WAKE, None)
    wake = options.pop("fair_wake", None)
    if wake is not None:
        headers[fair_headers.WAKE] = wake
    # The first publish's time; a re-publish (a wake, a dispatch, a promotion) keeps it,
    # so that the wait histogram measures from the enqueue.
    headers.setdefault(fair_headers.ENQUEUED_AT, time.time())
    explicit = options.pop("fair_tenant", None)
    if explicit is not None or fair_headers.TENANT not in headers:
        headers[fair_headers.TENANT] = tenants.publish_tenant(task, args, kwargs, explicit)
    # tenant-schemas-celery's schema, taken here: a held job is published later, elsewhere.
    return tenants.with_schema_header(task.app, headers), dispatched


def _with_links(
    options: dict[str, Any], headers: dict[str, Any], link: Any, link_error: Any,
    task_id: str | None,
) -> dict[str, Any]:  # fmt: skip
    """The options a held job is stored with: its headers, links and task id."""
    options["headers"] = headers
    if link is not None:
        options["link"] = link
    if link_error is not None:
        options["link_error"] = link_error
    return {**options, "task_id": task_id}


def _record_hold(
    task: Any, tenant: str | None, options: dict[str, Any], task_id: str | None, mechanism: str
) -> str:
    """Shadow mode: record that the job would have been held; returns its task id."""
    task_id = task_id or uuid()
    decisions.record(
        task_id=task_id, task_name=task.name, tenant=tenant,
        queue=str(options.get("queue") or getattr(task, "queue", None)
                  or task.app.conf.task_default_queue),
        mechanism=mechanism, action="hold",
    )  # fmt: skip
    return task_id


def _reroute(
    task: Any,
    headers: dict[str, Any],
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
) -> str | None:
    """Count the job by the task's rerouting rules and send it to the queue they pick
    (``options["queue"]``); returns its task id (made here if it was counted)."""
    rules = task.fair_rules()
    if not rules:
        return task_id
    queue = reroute.should_count(task, headers, options.get("queue"), args, kwargs)
    if queue is None:
        return task_id
    tenant = headers[fair_headers.TENANT]
    if tenant is None:
        warn_missing_tenant(task.name, "published")
        return task_id
    task_id = task_id or uuid()
    decision = reroute.count(task, tenant, queue, rules, task_id)
    reroute.apply(decision, options, headers)
    return task_id

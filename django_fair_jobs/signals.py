"""Celery signal handlers: check at worker start, keep the worker's database connection
sound between jobs, release slots when a process stops or a job is revoked."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery.signals import (
    task_prerun,
    task_revoked,
    task_unknown,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from django.db import DatabaseError
from django.dispatch import receiver

from django_fair_jobs import (
    admission,
    checks,
    db,
    dispatch,
    events,
    identity,
    maintenance,
    plain_tasks,
    planner,
    queue_limits,
)
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.errors import NotMigratedError
from django_fair_jobs.messages import is_fair

logger = logging.getLogger("django_fair_jobs.signals")


UNSUPPORTED_POOLS = ("gevent", "eventlet")
"""Worker pools the library refuses at start: its heartbeat, maintenance and planner
threads and its database calls are not made for their monkey-patched, single-threaded
hubs, and are not tested there. ``prefork`` (the default), ``threads`` and ``solo`` are."""

UNFLAGGED_REDELIVERY = ("sqs", "azurestoragequeues", "azureservicebus", "gcpubsub")
"""Transports that deliver a job again after a visibility timeout or lock expiry without
marking the delivery redelivered. A woken parked job whose worker died would come back
looking like a stale second copy, and be dropped, so the library refuses them at start."""


def refuse_unsupported(worker: Any) -> None:
    """Stop a worker at start-up on a pool or a broker transport the library does not
    support (:data:`UNSUPPORTED_POOLS`, :data:`UNFLAGGED_REDELIVERY`), saying what to use.

    ``SystemExit``, as :func:`~django_fair_jobs.checks.fail_fast_on_bad_settings` uses,
    because Celery's signal dispatch logs and swallows ordinary exceptions."""
    pool = getattr(worker, "pool_cls", None)
    pool_name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    refused = [name for name in UNSUPPORTED_POOLS if name in str(pool_name).lower()]
    if refused:
        raise SystemExit(
            f"django-fair-jobs: the {refused[0]} pool is not supported (its heartbeat, "
            "maintenance and planner threads and its database calls are not made for a "
            "monkey-patched hub). Start the worker with -P prefork (the default) or, for "
            "jobs that wait on I/O, -P threads --concurrency N."
        )
    unflagged = _transport_module(worker) in UNFLAGGED_REDELIVERY
    if unflagged and _parks(getattr(worker, "app", None)):
        raise SystemExit(
            f"django-fair-jobs: the {_transport_module(worker)} broker transport is not "
            "supported: it delivers a job again after its worker died without marking the "
            "delivery redelivered, and a woken parked job would then be dropped as a stale "
            "copy. Use RabbitMQ (amqp://) or Redis (redis://, rediss://, sentinel://)."
        )


def refuse_unmigrated() -> None:
    """Stop a worker at start-up whose database lacks some of the library's migrations,
    saying to run ``manage.py migrate fair_jobs``, instead of failing at every job. A
    database that does not answer yet is not a reason to stop: the worker's registration
    is retried until it does."""
    try:
        db.require_migrated(dispatch.alias())
    except NotMigratedError as exc:
        raise SystemExit(str(exc)) from None
    except DatabaseError as exc:
        logger.warning("Could not check the library's migrations at start-up: %s", exc)


def _transport_module(worker: Any) -> str:
    """The last part of the module of the worker's broker transport, lower case
    (``"sqs"`` for ``sqs://`` or ``kombu.transport.SQS:Transport``), read from the broker
    URL without importing the transport."""
    from kombu.transport import TRANSPORT_ALIASES

    transport = getattr(getattr(worker, "_conninfo", None), "transport_cls", None)
    if isinstance(transport, str):
        path = TRANSPORT_ALIASES.get(transport, transport)
    else:
        path = getattr(transport, "__module__", "")
    return str(path).split(":")[0].rsplit(".", 1)[-1].lower()


def _parks(app: Any) -> bool:
    """True unless ``app`` is known to have no job the library can park: a fair task, or
    plain tasks under queue limits (``FAIR_JOBS_LIMIT_PLAIN_TASKS``)."""
    if app is None or fair_settings.LIMIT_PLAIN_TASKS:
        return True
    return any(is_fair(task) for task in app.tasks.values())


@worker_init.connect
def _on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    # Refuse to start on an unsupported pool or transport, or on invalid settings, instead
    # of misbehaving at the first job. Then, in the main process before the pool forks: the
    # node's identity, the settings' queue limits for queues that have none stored, and the
    # plain-task hook if asked for.
    from django.db import connections

    refuse_unsupported(sender)
    checks.fail_fast_on_bad_settings()
    refuse_unmigrated()
    identity.start_node(getattr(sender, "hostname", None))
    try:
        queue_limits.seed()
    except Exception:
        logger.exception("Could not seed the queue limits from settings; will retry at first use")
    finally:
        # A prefork child must not inherit this process's database connection.
        connections.close_all()
    if fair_settings.LIMIT_PLAIN_TASKS:
        app = getattr(sender, "app", None)
        wrapped = plain_tasks.install(app)
        logger.info("Queue limits apply to %s plain tasks", len(wrapped))


@task_prerun.connect
def _on_task_prerun(sender: Any = None, **kwargs: Any) -> None:
    # With CELERY_DB_REUSE_MAX set, Celery's Django integration keeps connections between
    # jobs; as Django does before each request, drop those that are broken or older than
    # CONN_MAX_AGE and re-arm CONN_HEALTH_CHECKS, so a restarted database server costs one
    # reconnect instead of a failed job. An eager call runs inside its caller's transaction.
    if getattr(getattr(sender, "request", None), "is_eager", False):
        return
    from django.db import close_old_connections

    close_old_connections()


@worker_process_init.connect
def _on_process_init(**kwargs: Any) -> None:
    # A prefork child starts: it beats (and reaps) from now on. It registers from a thread
    # of its own, whose database connection is its own: the main thread may still hold a
    # connection inherited from the parent until Celery's Django fixup drops it.
    import threading

    threading.Thread(
        target=maintenance.start_process, name="fair-jobs-register", daemon=True
    ).start()
    admission.flusher.start()


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    # The solo and threads pools run tasks in the main process, which beats from now on.
    # A prefork parent runs no task and does not register: the children it forks later
    # must not inherit a live database connection.

    pool = getattr(sender, "pool", None)
    if pool is not None and type(pool).__module__ != "celery.concurrency.prefork":
        # A threads pool runs as many jobs at once as it has threads (fair dispatch's
        # capacity); solo runs one.
        identity.set_concurrency(int(getattr(pool, "limit", None) or 1))
        maintenance.start_process()
        admission.flusher.start()


@worker_process_shutdown.connect
def _on_process_shutdown(**kwargs: Any) -> None:
    # A prefork child exits: release the slot it kept for a next job (handoff), then
    # retire its row so its slots come back at once.
    admission.release_kept()
    admission.flusher.stop()
    maintenance.shutdown()


@worker_shutdown.connect
def _on_worker_shutdown(**kwargs: Any) -> None:
    # The solo and threads pools run tasks in the main process.
    admission.release_kept()
    admission.flusher.stop()
    maintenance.shutdown()


@task_revoked.connect
def _on_task_revoked(request: Any = None, terminated: bool = False, **kwargs: Any) -> None:
    # A revoked (or expired) delivery never reaches its release: drop its reservation and
    # parked row, and a terminated job's lease, so no slot waits for the reaper.
    task_id = getattr(request, "id", None)
    if task_id is None:
        return
    # A terminate signals the job's pool process; the job may survive it (SIGUSR1 raises
    # SoftTimeLimitExceeded, a task may handle SIGTERM). Its running lease goes only once
    # that process is gone; until then it is the job's, and its own release frees it.
    try:
        planner.started(str(task_id))  # a revoked planned job's row goes: it no longer counts
        pids = _pool_pids_running(str(task_id)) if terminated else []
        _drop(str(task_id), terminated=bool(terminated) and not pids)
        if pids:
            identity.when_gone(pids, lambda: _drop(str(task_id), terminated=True))
    except Exception:
        logger.exception("Could not drop the slots of revoked job %s", task_id)
    finally:
        # In prefork this runs in the parent: pool processes forked later must not
        # inherit its database connection.
        from django.db import connections

        connections.close_all()


@task_unknown.connect
def _on_task_unknown(message: Any = None, name: Any = None, **kwargs: Any) -> None:
    # Celery rejects a message of a task this worker has not registered; a dispatched job's
    # row would keep its room until the lost-message repair, so it ends failed now.
    headers = getattr(message, "headers", None) or {}
    job_id = headers.get(fair_headers.DISPATCH)
    if not isinstance(job_id, int):
        return
    from celery import current_app

    try:
        dispatch.unregistered(current_app, job_id, str(name))
    except Exception:
        logger.exception("Could not end dispatched job %s of an unregistered task", job_id)
    finally:
        # In prefork this runs in the parent: pool processes forked later must not
        # inherit its database connection.
        from django.db import connections

        connections.close_all()


def _drop(task_id: str, *, terminated: bool) -> None:
    """Drop a revoked job's parked row, reservations and dispatched row, and its running
    lease and row too if it was ``terminated`` (its process is gone)."""
    from celery import current_app

    admission.drop_task(task_id, terminated=terminated)
    dispatch.drop(current_app, task_id, terminated=terminated)


def _pool_pids_running(task_id: str) -> list[int]:
    """The pool processes of this node, other than this one, whose leases or dispatched
    rows say they run ``task_id`` (the prefork children a terminate signals)."""
    import socket

    from django_fair_jobs.dispatch.models import RUNNING, DispatchJob
    from django_fair_jobs.models import SlotLease, WorkerProcess

    host = socket.gethostname()
    pids = set(
        SlotLease.objects.filter(task_id=task_id, process__hostname=host).values_list(
            "process__pid", flat=True
        )
    )
    dispatched = DispatchJob.objects.filter(task_id=task_id, state=RUNNING).values("process_id")
    pids |= set(
        WorkerProcess.objects.filter(id__in=dispatched, hostname=host).values_list("pid", flat=True)
    )
    return sorted({pid for pid in pids if pid is not None and pid != os.getpid()})


@receiver(events.limit_changed)
def _on_limit_changed(
    sender: Any, tenant: str | None = None, queue: str | None = None, app: Any = None, **kwargs: Any
) -> None:
    # A limit raised, a tenant or queue resumed: the lines it frees come back into fair
    # dispatch's selection and the queue is dispatched now, not at the next end or pass
    # (after the caller's transaction commits, as the change is then visible).
    from celery import current_app

    def dispatch_now() -> None:
        try:
            dispatch.unblock(app or current_app, tenant=tenant, queue=queue)
            if queue is not None:
                dispatch.publish(app or current_app, dispatch.dispatch(queue))
        except Exception:
            logger.exception("Could not dispatch %s after its limit changed", queue)

    if not db.after_commit(dispatch_now, dispatch.alias()):
        dispatch_now()

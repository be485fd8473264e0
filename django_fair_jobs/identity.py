"""Who this process is: its worker node, its process row, and what it is running
(layer 2: imports layers 0-1 only).

Every process that runs fair tasks registers one :class:`~django_fair_jobs.models.WorkerProcess`
row the first time it needs a slot (or at pool start). Registration is lazy and keyed by
pid, so a prefork child registers itself after the fork and never shares its parent's
identity. The node's identity (:func:`current_node_id`) is made once per ``celery worker``
start, in the main process before the pool forks, so all of a node's processes share it and
a restarted node gets a new one; per-worker queue limits count by it.

What a registered process must then run (its heartbeat and maintenance threads) lives in
:mod:`django_fair_jobs.maintenance`, which asks to be told through :func:`on_register`; this
module never imports it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import connections
from django.db.models.functions import Now

from django_fair_jobs import db
from django_fair_jobs.conf import fair_settings

logger = logging.getLogger("django_fair_jobs.identity")


@dataclass
class Identity:
    """A registered process: its row's id, its pid, its node name, and the event that
    stops the threads it started."""

    process_id: uuid.UUID
    pid: int
    node: str
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    beaten_at: float = field(default_factory=time.monotonic)
    """When its row was last written (``time.monotonic()``, read before the statement, so
    the row's heartbeat is no older): see :func:`current_process_id`."""


_identity: Identity | None = None
# Re-entrant: a first registration, under the lock, makes the node id under it too (a
# process that no worker start prepared, such as a script running a job).
_lock = threading.RLock()
_node_id: uuid.UUID | None = None
_node_name: str | None = None
_concurrency = 1
"""Jobs this process runs at once: 1 for a prefork child or a solo pool; a threads pool
sets its thread count at ``worker_ready``."""
_on_register: list[Callable[[Identity], object]] = []


def on_register(hook: Callable[[Identity], object]) -> None:
    """Call ``hook`` with the new :class:`Identity` each time this process registers (once
    per process, again after a fork): the heartbeat and maintenance threads start there."""
    if hook not in _on_register:
        _on_register.append(hook)


def set_concurrency(value: int) -> None:
    """Record how many jobs this process runs at once (a threads pool's size)."""
    global _concurrency
    _concurrency = max(int(value), 1)


def concurrency() -> int:
    """How many jobs this process runs at once (see :func:`set_concurrency`)."""
    return _concurrency


def consumed_queues() -> list[str]:
    """The queues this worker consumes (``-Q``), or none outside a worker."""
    from celery import current_app

    try:
        return sorted(current_app.amqp.queues.consume_from or ())
    except Exception:
        return []


def start_node(name: str | None = None) -> uuid.UUID:
    """Give this worker node a new identity (and remember its Celery node name); called at
    ``worker_init``, before the pool starts, so that prefork children inherit both."""
    global _node_id, _node_name
    _node_id, _node_name = uuid.uuid4(), name
    return _node_id


def current_node_id() -> uuid.UUID:
    """This process's worker node identity (made on first use outside a worker)."""
    global _node_id
    if _node_id is None:
        with _lock:
            if _node_id is None:
                _node_id = uuid.uuid4()
    return _node_id


def current_process_id(node: str | None = None) -> uuid.UUID:
    """Return this process's id, registering it and starting its heartbeat on first use.
    After a stall that may have let the others reap it (no beat for
    ``FAIR_JOBS_WORKER_TIMEOUT`` minus one ``FAIR_JOBS_HEARTBEAT_INTERVAL``: the process
    was stopped, its machine paused), it beats first, and registers again if it was
    reaped, so that no job starts under a reaped id (the next reap would take that job for
    a dead process's and put it back in line, to run twice)."""
    global _identity
    ident = _identity
    if ident is not None and ident.pid == os.getpid():
        if time.monotonic() - ident.beaten_at > _stale_after():
            _revive(ident)
        return ident.process_id
    with _lock:
        if _identity is None or _identity.pid != os.getpid():
            _identity = _register(node or _node_name or f"celery@{socket.gethostname()}")
        return _identity.process_id


def _stale_after() -> float:
    return float(fair_settings.WORKER_TIMEOUT - fair_settings.HEARTBEAT_INTERVAL)


def _revive(ident: Identity) -> None:
    """Beat now after a stall, and register again if this process was reaped meanwhile.
    A database that does not answer is left to the statement the id was asked for."""
    from django.db import DatabaseError

    with _lock:
        if time.monotonic() - ident.beaten_at <= _stale_after():
            return  # another thread of this process did it meanwhile
        try:
            keep_registered(ident)
        except DatabaseError:
            logger.warning("Could not beat after a stall; going on", exc_info=True)


def keep_registered(ident: Identity) -> bool:
    """Beat for ``ident``; if its row is gone (it was presumed dead after a stall longer
    than the timeout, and reaped: its old leases are gone and its late releases fenced),
    write the row again. False, with nothing written, if ``ident`` is stopping: its own
    shutdown retired the row. Raises what the database raises."""
    at = time.monotonic()
    if not beat(ident.process_id):
        if ident.stop.is_set():
            return False
        logger.warning("Worker process %s was reaped while alive; re-registering", ident.process_id)
        register_row(ident)
    ident.beaten_at = at
    return True


def registered_process_id() -> uuid.UUID | None:
    """This process's id if it has registered, else None; never registers (so it needs no
    database and starts no thread)."""
    ident = _identity
    return ident.process_id if ident is not None and ident.pid == os.getpid() else None


def current() -> Identity | None:
    """This process's :class:`Identity` if it has registered (in this process, not a
    parent it was forked from), else None."""
    ident = _identity
    return ident if ident is not None and ident.pid == os.getpid() else None


def forget() -> None:
    """Drop this process's identity (it retired its row); the next use registers anew."""
    global _identity
    _identity = None


def register_row(ident: Identity) -> None:
    """Write (or write again, after a reap) ``ident``'s worker process row."""

    register_process(
        process_id=ident.process_id, node=ident.node, hostname=socket.gethostname(),
        pid=ident.pid, node_id=current_node_id(), queues=consumed_queues(),
        concurrency=_concurrency,
    )  # fmt: skip


def _register(node: str) -> Identity:
    ident = Identity(process_id=uuid.uuid4(), pid=os.getpid(), node=node)
    register_row(ident)
    for hook in _on_register:
        hook(ident)
    logger.debug("Registered worker process %s (%s pid %s)", ident.process_id, node, ident.pid)
    return ident


def when_gone(pids: list[int], action: Callable[[], object], within: float | None = None) -> None:
    """Run ``action`` on a thread of its own once every process of ``pids`` (pool
    processes of this node) has exited. Give up after ``within`` seconds (default
    ``FAIR_JOBS_WORKER_TIMEOUT``): a process that lives on keeps what it holds, and its
    job's own release, or the reaper once it dies, gives it back."""
    deadline = time.monotonic() + (fair_settings.WORKER_TIMEOUT if within is None else within)

    def watch() -> None:
        try:
            while time.monotonic() < deadline:
                if not any(_alive(pid) for pid in pids):
                    action()
                    return
                time.sleep(0.05)
        except Exception:
            logger.exception("Could not release what processes %s held", pids)
        finally:
            connections.close_all()

    threading.Thread(target=watch, name="fair-jobs-when-gone", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not: it has exited, unreaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: the pool reaps its children soon enough


# The process rows' storage (database clock only).


def register_process(
    *,
    process_id: uuid.UUID,
    node: str,
    hostname: str,
    pid: int,
    node_id: uuid.UUID | None = None,
    queues: list[str] | None = None,
    concurrency: int = 1,
) -> None:
    """Insert this process's row, or refresh it if it exists (re-registration after a
    stall during which it was reaped). ``node_id``: the worker node's identity (a new
    one if not given); ``queues`` and ``concurrency``: what it consumes and how many
    jobs it runs at once (fair dispatch's capacity)."""
    from django_fair_jobs.models import WorkerProcess

    WorkerProcess.objects.update_or_create(
        pk=process_id,
        defaults={
            "node": node,
            "queues": list(queues or ()),
            "concurrency": concurrency,
            "node_id": node_id or uuid.uuid4(),
            "hostname": hostname,
            "pid": pid,
            "last_heartbeat_at": Now(),
        },
    )


def live_nodes(timeout: float) -> int:
    """How many worker nodes have a process that beat within ``timeout`` seconds."""
    from django_fair_jobs.models import WorkerProcess

    live = WorkerProcess.objects.filter(last_heartbeat_at__gte=db.ago(timeout))
    return live.values("node_id").distinct().count()


def beat(process_id: uuid.UUID) -> bool:
    """Refresh the heartbeat; False if the row is gone (this process was reaped)."""
    from django_fair_jobs.models import WorkerProcess

    return bool(WorkerProcess.objects.filter(pk=process_id).update(last_heartbeat_at=Now()))


def retire_process(process_id: uuid.UUID) -> None:
    """Delete this process's row at a clean shutdown, so its leases are reaped at once."""
    from django_fair_jobs.models import WorkerProcess

    WorkerProcess.objects.filter(pk=process_id).delete()

"""Ends flushed in batches, off the job's path. A dispatched job that ran to its end hands
its end to this process's flusher thread (:func:`hand`) and returns at once, so the worker
takes its next job without waiting for the database. The start of that next job takes
the ends the thread holds and sends them in its own statement (:func:`take`,
:func:`carried`; ``FAIR_JOBS_DISPATCH_CARRY_WAIT``): one round trip and one commit for
both. Ends that no start took within the wait, the thread ends in one round trip of its
own (``fair_jobs_dispatch_end_many``: the rows go, their lines' counts drop, each queue's
room is dispatched); either way the thread publishes the jobs dispatched into that room.

What it bends: until the flush (the next start, at most the wait and a round trip after
the end; longer while the database is slow) the job still counts in flight, so the room
it leaves is dispatched that much later (a process whose last start came later than the
wait after the end before it flushes its next end at once); and a node or pool process
that dies in that window leaves the job running under a dead process, so the reap treats
it as a job whose worker died: an ``acks_late`` job runs again, where plain Celery, which
acknowledged it when it returned, would not. Until its end is committed, the job's row id
is kept (``Ledger.unflushed``), so a copy of it delivered to this process is refused,
never run again.

Only in worker processes (:func:`start`, when a pool process starts). On SQLite only with
``transaction_mode = "IMMEDIATE"`` (as ``RECOMMENDED_SQLITE_OPTIONS`` sets): the thread's
transaction and the job thread's next start then queue for the database's one write lock
in turn, which costs the job less than the end's statements did; in SQLite's default mode
two such transactions can both fail with "database is locked" instead, so there the job
ends its own row as before. A job run in-process (tests, ``apply()``) ends in its own
thread too. At shutdown the
thread flushes what it holds and stops (:func:`stop`); an end whose flush failed is kept
with the process's pending ends and tried again at each heartbeat.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

from django.db import DatabaseError, connections

from django_fair_jobs import dispatch
from django_fair_jobs.admission import ends
from django_fair_jobs.admission.ends import LEDGER
from django_fair_jobs.conf import fair_settings

logger = logging.getLogger("django_fair_jobs.admission")

STOP_TIMEOUT = 10.0
"""Seconds :func:`stop` waits for a flush under way on PostgreSQL (its statement's
lock_timeout is 2 s); on SQLite, 5 s more than the connection's busy timeout."""


def start() -> None:
    """Send this worker process's jobs' ends to a flusher thread from now on, where the
    database allows it (see the module's docstring)."""
    options = _sqlite_options()
    enabled = options is None or options.get("transaction_mode") == "IMMEDIATE"
    with LEDGER.lock:
        LEDGER.flush_in_thread = enabled
        LEDGER.flusher_stopping = False


def _sqlite_options() -> dict[str, Any] | None:
    """The ``OPTIONS`` of the lines' database if it is SQLite, else None."""
    connection = connections[dispatch.alias()]
    if connection.vendor != "sqlite":
        return None
    options: dict[str, Any] = connection.settings_dict.get("OPTIONS") or {}
    return options


def _stop_timeout() -> float:
    options = _sqlite_options()
    if options is None:
        return STOP_TIMEOUT
    return float(options.get("timeout", 5)) + 5.0


def hand(app: Any, job_id: int, process: uuid.UUID) -> bool:
    """Hand the end of ``job_id`` (ran to its end under ``process``) to the flusher thread;
    False if this process ends jobs itself (the caller ends it now). Until the end is
    committed, a copy of the job delivered here is refused (``ends.ended_here``)."""
    with LEDGER.lock:
        if not LEDGER.flush_in_thread or LEDGER.flusher_stopping:
            return False
        try:
            LEDGER.flusher = ends.own_thread(LEDGER.flusher, _loop, "fair-jobs-flusher")
        except RuntimeError:  # no thread to be had: the caller ends the job itself
            return False
        LEDGER.ending.append((job_id, process, app))
        LEDGER.unflushed.add(job_id)
        LEDGER.handed_at = time.monotonic()
    LEDGER.flush_wanted.set()
    return True


def take(process: uuid.UUID) -> list[tuple[int, uuid.UUID, Any]]:
    """Take from the flusher the ends of ``process`` it has not flushed yet, for the start
    of this process's next job to carry (:func:`carried`, or :func:`hand_back` if that
    start failed). Whether this start came within the wait of the last end decides
    whether the flusher keeps the next end for a start (``Ledger.carrying``)."""
    wait = fair_settings.DISPATCH_CARRY_WAIT
    with LEDGER.lock:
        LEDGER.carrying = time.monotonic() - LEDGER.handed_at <= wait
        if LEDGER.flusher_stopping or not LEDGER.ending:
            return []
        mine = [item for item in LEDGER.ending if item[1] == process]
        LEDGER.ending = [item for item in LEDGER.ending if item[1] != process]
    return mine


def carried(
    items: list[tuple[int, uuid.UUID, Any]], ready: tuple[dispatch.Ready, ...], asynchronous: bool
) -> None:
    """The ends of ``items`` (:func:`take`) committed with a start: settle them as a flush
    does, and have the flusher publish the jobs their room went to (here if it stops)."""
    ids = [job_id for job_id, _, _ in items]
    process, app = items[0][1], items[0][2]
    with LEDGER.lock:
        LEDGER.unflushed.difference_update(ids)
        if asynchronous:
            LEDGER.unconfirmed_ends.update(dict.fromkeys(ids, process))
        inline = LEDGER.flusher_stopping
        if ready and not inline:
            LEDGER.publishing.append((app, list(ready)))
    if not asynchronous:
        ends.settled(ids, process, "end")
    if ready and inline:
        _publish(app, list(ready))
    elif ready:
        LEDGER.flush_wanted.set()


def hand_back(items: list[tuple[int, uuid.UUID, Any]]) -> None:
    """The start that was to carry ``items`` failed: the flusher ends them itself."""
    if items:
        with LEDGER.lock:
            LEDGER.ending.extend(items)
        LEDGER.flush_wanted.set()


def _loop() -> None:
    """The flusher thread: publish at once what the ends a start carried dispatched; flush
    the ends handed to it once ``FAIR_JOBS_DISPATCH_CARRY_WAIT`` has passed without a
    start taking them, at once when the process's last start came later than that after
    the end before it, or when the process stops."""
    try:
        deadline: float | None = None
        while True:
            LEDGER.flush_wanted.wait(None if deadline is None else deadline - time.monotonic())
            LEDGER.flush_wanted.clear()
            wait = _wait()
            with LEDGER.lock:
                publishing, LEDGER.publishing = LEDGER.publishing, []
                stopping = LEDGER.flusher_stopping
                if LEDGER.ending and deadline is None:
                    deadline = time.monotonic() + wait
                batch: list[tuple[int, uuid.UUID, Any]] = []
                if LEDGER.ending and (stopping or time.monotonic() >= (deadline or 0.0)):
                    batch, LEDGER.ending = LEDGER.ending, []
                if not LEDGER.ending:
                    deadline = None
            for app, ready in publishing:
                _publish(app, ready)
            if batch:
                flush(batch)
            if stopping:
                return
    finally:
        connections.close_all()


def _wait() -> float:
    """Seconds the flusher keeps an end for the next start: the setting's while the
    process's starts come within it of the end before them, else none."""
    return fair_settings.DISPATCH_CARRY_WAIT if LEDGER.carrying else 0.0


def _publish(app: Any, ready: list[dispatch.Ready]) -> None:
    """Publish ``ready``; an error is logged, never raised (the repair publishes later)."""
    try:
        dispatch.publish(app, ready)
    except Exception:  # publish sets aside what it could not send; never end the thread
        logger.exception("Could not publish the jobs dispatched by a flush")


def flush(batch: list[tuple[int, uuid.UUID, Any]]) -> int:
    """End the jobs of ``batch`` (see :attr:`~django_fair_jobs.admission.ends.Ledger.ending`)
    in one round trip per process and publish what their room went to; an end that fails
    is kept for the heartbeat. Returns how many jobs were flushed."""
    by_process: dict[uuid.UUID, list[tuple[int, Any]]] = {}
    for job_id, process, app in batch:
        by_process.setdefault(process, []).append((job_id, app))
    for process, items in by_process.items():
        ids = [job_id for job_id, _ in items]
        try:
            asynchronous = dispatch.commits_async()
            # An end handed back by a start whose reply was lost may have committed: sent
            # again, it answers with the jobs that start dispatched into its room.
            ready = dispatch.end_many(ids, process, async_commit=asynchronous, again=True)
        except Exception:  # a closed connection raises InterfaceError, not DatabaseError
            logger.exception(
                "Could not end %d dispatched jobs; retrying at the next heartbeat", len(items)
            )
            _drop_connections()
            for job_id in ids:  # still unflushed: their copies stay refused here
                ends.end_later(job_id, process, outcome="end")
            continue
        with LEDGER.lock:
            LEDGER.unflushed.difference_update(ids)
            if asynchronous:
                LEDGER.unconfirmed_ends.update(dict.fromkeys(ids, process))
        if not asynchronous:
            ends.settled(ids, process, "end")
        _publish(items[-1][1], ready)
    return len(batch)


def confirm_dispatch(app: Any) -> int:
    """Confirm this process's starts and ends that did not wait for the disk
    (``FAIR_JOBS_DISPATCH_ASYNC_COMMIT``), making again any that a crash of the database
    server lost, and publish what the room of an end made again went to; returns how many
    starts were made again. Called at every heartbeat's maintenance and at shutdown: until
    then, after such a crash, a job whose start was lost shows dispatched (the lost-message
    repair waits ``FAIR_JOBS_DISPATCH_LOST_AFTER`` from the server's start), and one whose
    end was lost keeps its room. An error keeps them for the next pass; those of a process
    whose row is gone (reaped: the reap put its jobs back) are dropped."""
    redone = 0
    with LEDGER.lock:
        processes = sorted({*LEDGER.unconfirmed_starts.values(), *LEDGER.unconfirmed_ends.values()})
    for process in processes:
        try:
            lost, ready = _confirm(process)
        except Exception:  # a closed connection raises InterfaceError, not DatabaseError
            logger.warning("Could not confirm the starts and ends of %s yet", process)
            continue
        redone += lost
        dispatch.publish(app, ready)
    if redone:
        logger.warning(
            "Made again %s start(s) of dispatched jobs that the database lost (a crash of "
            "the server)",
            redone,
        )
    return redone


def _confirm(process: uuid.UUID) -> tuple[int, list[dispatch.Ready]]:
    """Confirm the starts and ends ``process`` keeps (see :func:`confirm_dispatch`) under
    the ledger's ``confirming`` lock, so that no end of the job's thread puts a job back
    between the copy and the commit; returns the starts made again and the jobs to publish.
    A job whose end is pending (its reply may have been lost) is not started again."""
    with LEDGER.confirming:
        with LEDGER.lock:
            started = [
                job_id
                for job_id, p in LEDGER.unconfirmed_starts.items()
                if p == process and job_id not in LEDGER.pending_ends
            ]
            ended = [job_id for job_id, p in LEDGER.unconfirmed_ends.items() if p == process]
            kept = [job_id for job_id, p in LEDGER.unconfirmed_starts.items() if p == process]
        confirmed, lost, ready = dispatch.confirm(started, ended, process)
        if not confirmed:
            logger.warning(
                "Dropped %s unconfirmed start(s) and end(s) of %s: its row is gone (reaped)",
                len(kept) + len(ended),
                process,
            )
        with LEDGER.lock:
            for job_id in kept:
                if job_id not in LEDGER.pending_ends:
                    LEDGER.unconfirmed_starts.pop(job_id, None)
            for job_id in ended:
                LEDGER.unconfirmed_ends.pop(job_id, None)
    return lost, ready


def _drop_connections() -> None:
    """Drop this thread's connections after a failed flush: the next one opens anew."""
    try:
        connections.close_all()
    except DatabaseError:
        logger.debug("A broken connection could not be closed", exc_info=True)


def stop(timeout: float | None = None) -> int:
    """This process shuts down: the flusher flushes what it holds and ends (waiting up to
    ``timeout`` seconds, by default :data:`STOP_TIMEOUT` or SQLite's busy timeout and 5),
    and whatever is left is flushed here. Returns how many ends were flushed here."""
    timeout = _stop_timeout() if timeout is None else timeout
    with LEDGER.lock:
        LEDGER.flusher_stopping = True
        flusher = LEDGER.flusher
    LEDGER.flush_wanted.set()
    mine = flusher is not None and flusher[0] == os.getpid()
    if flusher is not None and mine and flusher[1] is not threading.current_thread():
        flusher[1].join(timeout)
        if flusher[1].is_alive():
            logger.error(
                "The flusher did not finish its flush within %s s; the jobs it holds may be "
                "reaped as if their process had died",
                timeout,
            )
    with LEDGER.lock:
        left, LEDGER.ending = LEDGER.ending, []
        publishing, LEDGER.publishing = LEDGER.publishing, []
    for app, ready in publishing:
        _publish(app, ready)
    return flush(left) if left else 0

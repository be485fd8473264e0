"""Count the SQL statements a process sends to the library's tables.

Installed in every process of the example project (see ``BenchConfig.ready``). The count
covers everything the library does: acquire, park, release, wake, heartbeats and
maintenance. The jobs' own records go to other tables and are not counted, so a plain
Celery task adds nothing; plain workers count only the heartbeat and maintenance that every
worker process runs (a few statements per process per heartbeat interval).

It also counts the library's durable commits: the transactions that wrote to its tables
and waited for the WAL flush at their commit. A writing statement in autocommit is one
(each of the library's PostgreSQL steps); writing statements inside a transaction are one
at its commit, however many (the ORM steps on SQLite, a ``delay()`` inside ``atomic()``);
a statement that turns ``synchronous_commit`` off for its transaction
(``FAIR_JOBS_ASYNC_RELEASE``) is not one.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

LIBRARY_TABLE_PREFIX = "fair_jobs_"

WRITES = re.compile(
    r"\b(INSERT|UPDATE|DELETE)\b|\bfair_jobs_(enqueue|enqueue_many|dispatch|dispatch_start"
    r"|dispatch_end|dispatch_end_many|dispatch_recount)\s*\(",
    re.IGNORECASE,
)
"""A statement that writes: an insert, update, delete or row lock (``FOR UPDATE``), or a
call of one of fair dispatch's functions that write (``fair_jobs_dispatch_room`` and
``fair_jobs_dispatch_vt`` only read)."""

_lock = threading.Lock()
_count = 0
_on_path = 0
_on_path_to_last_job = 0
_commits = 0


def on_path() -> int:
    """Of :func:`count`, the statements sent by this process's main thread: in a worker
    process, the thread that runs the jobs (the statements on a job's path); the library's
    own threads (heartbeat, maintenance, the flusher) send the rest."""
    return _on_path


def job_ended() -> None:
    """Note the end of a job in this process: :func:`on_path_to_last_job` counts up to here."""
    global _on_path_to_last_job
    with _lock:
        _on_path_to_last_job = _on_path


def on_path_to_last_job() -> int:
    """Of :func:`on_path`, the statements sent up to the end of this process's last job:
    what its shutdown sends after it (retiring its row, a last maintenance pass) is on no
    job's path, so it counts in :func:`count` only."""
    return _on_path_to_last_job


def count() -> int:
    """Statements counted in this process since it started or was last reset."""
    return _count


def commits() -> int:
    """The library's durable commits in this process since it started or was last reset
    (see the module's docstring)."""
    return _commits


def reset() -> None:
    """Start counting from 0 (a forked worker child inherits its parent's count)."""
    global _count, _on_path, _on_path_to_last_job, _commits
    with _lock:
        _count = _on_path = _on_path_to_last_job = _commits = 0


def _counting(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    global _count, _on_path
    if LIBRARY_TABLE_PREFIX in sql:
        main = threading.current_thread() is threading.main_thread()
        with _lock:
            _count += 1
            _on_path += main
        if WRITES.search(sql) and not (isinstance(params, dict) and params.get("async_commit")):
            _count_commit(context["connection"])
    return execute(sql, params, many, context)


def _count_commit(connection: BaseDatabaseWrapper) -> None:
    """A writing statement: one commit now (autocommit), or one at the commit of the
    transaction it runs in, counted once however many of its statements write."""
    if not connection.in_atomic_block:
        _add_commit()
    elif not any(entry[1] is _add_commit for entry in connection.run_on_commit):
        connection.on_commit(_add_commit)


def _add_commit() -> None:
    global _commits
    with _lock:
        _commits += 1


def _on_connection(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    # The wrapper list outlives reconnects of the same connection object: add it once.
    if _counting not in connection.execute_wrappers:
        connection.execute_wrappers.append(_counting)


def install() -> None:
    """Count from now on, on every database connection this process opens."""
    connection_created.connect(_on_connection, dispatch_uid="bench.statements")

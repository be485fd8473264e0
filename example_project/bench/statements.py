"""Count the SQL statements a process sends to the library's tables.

Installed in every process of the example project (see ``BenchConfig.ready``). The count
covers everything the library does: acquire, park, release, wake, heartbeats and
maintenance. The jobs' own records go to other tables and are not counted, so a plain
Celery task adds nothing; plain workers count only the heartbeat and maintenance that every
worker process runs (a few statements per process per heartbeat interval).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

LIBRARY_TABLE_PREFIX = "fair_jobs_"

_lock = threading.Lock()
_count = 0
_on_path = 0


def on_path() -> int:
    """Of :func:`count`, the statements sent by this process's main thread: in a worker
    process, the thread that runs the jobs (the statements on a job's path); the library's
    own threads (heartbeat, maintenance, the flusher) send the rest."""
    return _on_path


def count() -> int:
    """Statements counted in this process since it started or was last reset."""
    return _count


def reset() -> None:
    """Start counting from 0 (a forked worker child inherits its parent's count)."""
    global _count, _on_path
    with _lock:
        _count = _on_path = 0


def _counting(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    global _count, _on_path
    if LIBRARY_TABLE_PREFIX in sql:
        main = threading.current_thread() is threading.main_thread()
        with _lock:
            _count += 1
            _on_path += main
    return execute(sql, params, many, context)


def _on_connection(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    # The wrapper list outlives reconnects of the same connection object: add it once.
    if _counting not in connection.execute_wrappers:
        connection.execute_wrappers.append(_counting)


def install() -> None:
    """Count from now on, on every database connection this process opens."""
    connection_created.connect(_on_connection, dispatch_uid="bench.statements")

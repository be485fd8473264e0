"""Real PostgreSQL sessions for race tests: a second session of its own, a thread with its
own Django connection, a wait until one of them blocks on a row lock, and the three
together (:func:`run_while_open`, :func:`run_while_locked`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connection, connections

from tests.conftest import wait_for


def session(autocommit: bool = False) -> Any:
    """A second PostgreSQL session of its own (not Django's), in a transaction unless
    ``autocommit``."""
    import psycopg

    params = connection.get_connection_params()
    return psycopg.connect(
        autocommit=autocommit, **{k: v for k, v in params.items() if k != "cursor_factory"}
    )


def wait_until_blocked(thread: threading.Thread, what: str) -> None:
    """Until a session of this database waits on a row lock (or ``thread`` has ended)."""
    # Autocommit: inside one transaction pg_stat_activity keeps its first snapshot.
    with session(autocommit=True) as look:
        waiting = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        wait_for(
            lambda: not thread.is_alive() or look.execute(waiting).fetchone() != (0,), 20, what
        )


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``work`` in a thread with its own Django connection; its result or exception
    lands in the returned list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:
            out.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def run_while_open(
    held: Any,
    work: Callable[[], Any],
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> Any:
    """Run ``work`` in a thread while the session ``held`` keeps its transaction open;
    once the thread waits on a lock, call ``meanwhile`` (if given; the thread must still
    wait then). Then commit and close ``held``, and return what ``work`` returned."""
    thread, out = in_thread(work)
    try:
        wait_until_blocked(thread, what)
        if meanwhile is not None:
            assert thread.is_alive(), out
            meanwhile()
    finally:
        held.commit()
        held.close()
        thread.join(20)
    (result,) = out
    assert not isinstance(result, BaseException), result
    return result


def run_while_locked(
    lock: tuple[str, list[Any]],
    work: Callable[[], Any],
    what: str,
    meanwhile: tuple[str, list[Any]],
) -> Any:
    """Run ``work`` in a thread while a second session holds the row locks the statement
    ``lock`` takes; once the thread waits on them, run ``meanwhile`` (a ``... NOWAIT``
    lock, which raises if ``work`` holds that row) in a third session. Then release the
    locks and return what ``work`` returned."""
    held = session()
    held.execute(*lock)

    def probe() -> None:
        with session() as look:
            look.execute(*meanwhile)
            look.rollback()

    return run_while_open(held, work, what, probe)


def finishes_while_held(lock: tuple[str, list[Any]], work: Callable[[], Any], what: str) -> Any:
    """Run ``work`` in a thread while a second session holds the row locks the statement
    ``lock`` takes, and fail if ``work`` waits on a lock instead of finishing meanwhile
    (a step that must never wait for those rows). Returns what ``work`` returned."""
    held = session()
    held.execute(*lock)
    thread, out = in_thread(work)
    try:
        wait_until_blocked(thread, what)
        thread.join(2)
        assert not thread.is_alive(), f"{what}: it waits on the rows the other session holds"
    finally:
        held.rollback()
        held.close()
        thread.join(20)
    (result,) = out
    assert not isinstance(result, BaseException), result
    return result

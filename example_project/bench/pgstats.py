"""PostgreSQL's cumulative statistics as a session reads its own counts: the WAL
benchmark's row updates and the tests of what a step writes or calls."""

from __future__ import annotations

import time
from typing import Any

from django.db import connection


def statistics(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` over PostgreSQL's cumulative statistics views, read after this
    session reported its own counts: from PostgreSQL 15 at the end of a statement that
    asks for it; before, by the statistics collector, about half a second after the
    session went idle."""
    with connection.cursor() as cursor:
        if connection.pg_version >= 150000:  # type: ignore[attr-defined]
            cursor.execute("SELECT pg_stat_force_next_flush()")
        else:
            time.sleep(1.0)
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(sql, params)
        return [tuple(row) for row in cursor.fetchall()]


def row_updates(tables: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each of ``tables``' row updates so far, and how many were HOT (in place, no index
    entry)."""
    rows = statistics(
        "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = ANY(%s)",
        [list(tables)],
    )
    return {name: (int(upd), int(hot)) for name, upd, hot in rows}

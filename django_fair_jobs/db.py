"""Database helpers every room shares (layer 0: imports nothing of the package)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections, models, transaction
from django.db.models.functions import Now

from django_fair_jobs.sql import queries


def after_commit(action: Callable[[], object], using: str) -> bool:
    """Run ``action`` once the caller's transaction on ``using`` commits, if the caller is
    inside ``atomic()``, and return True; else return False, and the caller runs it now.

    For whatever publishes to the broker rows written in the caller's transaction (a
    wake-up's reservation, a dispatched job): published before the commit, the message can
    reach a worker that does not see the rows yet, and the row lock would be held across
    broker I/O until the caller's transaction ends. On a rollback nothing is published,
    which is right: the rows are gone too."""
    if not connections[using].in_atomic_block:
        return False
    transaction.on_commit(action, using=using)
    return True


def is_postgres(alias: str) -> bool:
    """True if ``alias`` is a PostgreSQL database (its statements are the named blocks)."""
    return connections[alias].vendor == "postgresql"


def uses_sql(alias: str) -> bool:
    """Whether the stores run their named statements on ``alias`` (PostgreSQL) rather than
    the ORM path every other database takes. Kept apart from :func:`is_postgres` (which
    picks the SQL dialect, such as the clock's) so that the stores' contract tests run both
    paths against PostgreSQL."""
    return is_postgres(alias)


def run(alias: str, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run the named statement ``name`` (see :func:`django_fair_jobs.sql.queries`) and return
    its rows."""
    with connections[alias].cursor() as cursor:
        cursor.execute(queries()[name], params)
        return list(cursor.fetchall())


def database_now(alias: str = "default") -> datetime:
    """The database clock (aware), for ages shown to operators. SQLite has no clock of its
    own: there it is the host's, the one every process of the host reads."""

    with connections[alias].cursor() as cursor:
        if is_postgres(alias):
            cursor.execute("SELECT now()")
            value: datetime = cursor.fetchone()[0]
            return value
        cursor.execute("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")
        return datetime.fromisoformat(cursor.fetchone()[0]).replace(tzinfo=UTC)


def savepoint_if_needed(alias: str) -> Any:
    """A savepoint only inside a caller's transaction, so that a failed statement does not
    break it; in autocommit (the worker's case) no extra round trip is spent."""

    if connections[alias].in_atomic_block:
        return transaction.atomic(using=alias)
    return nullcontext()


def ago(seconds: float) -> Any:
    """A database-clock expression for ``now() - seconds`` (never the worker's clock)."""

    delta: timedelta = timedelta(seconds=seconds)
    return Now() - models.Value(delta, output_field=models.DurationField())

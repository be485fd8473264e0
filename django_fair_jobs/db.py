"""Database helpers every room shares (layer 0: imports nothing of the package)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from django.db import (
    InterfaceError,
    OperationalError,
    ProgrammingError,
    connections,
    models,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.functions import Now

from django_fair_jobs.conf import fair_settings
from django_fair_jobs.errors import NotMigratedError
from django_fair_jobs.sql import queries

try:
    import psycopg
except ImportError:  # psycopg2 only: the named statements run unprepared
    psycopg = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
    return run_on(connections[alias], name, params)


def run_on(
    connection: BaseDatabaseWrapper, name: str, params: dict[str, Any]
) -> list[tuple[Any, ...]]:
    """Run the named statement ``name`` on ``connection`` and return its rows: prepared on
    PostgreSQL with psycopg 3 from its second run on a connection (planned once there)
    unless ``FAIR_JOBS_PREPARED_STATEMENTS`` is off."""
    for attempt in (1, 2):
        try:
            with statement_cursor(connection) as cursor:
                cursor.execute(queries()[name], params)
                return list(cursor.fetchall())
        except OperationalError as exc:
            # A lock wait past the statement's lock_timeout (fair dispatch's functions set
            # one, so that a wait the lock order allows fails fast instead of stalling a
            # queue): in autocommit nothing was done, and the next try usually finds the
            # row free.
            if not _lock_timed_out(exc) or attempt == 2 or connection.in_atomic_block:
                raise
        except ProgrammingError as exc:
            # The session lost the connection's prepared statements behind psycopg's back
            # (a DISCARD ALL or DEALLOCATE of the caller's, a pooler's reset): psycopg's
            # record of them is dropped, and in autocommit, where the failed statement
            # changed nothing, it runs once more and is prepared afresh.
            if not _lost_prepared(connection, exc) or attempt == 2:
                raise
            if connection.in_atomic_block:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def sent_again(alias: str, step: Callable[[bool], T], *, pause: float = 0.25) -> T:
    """``step(False)``; if its reply is lost (an operational error or a closed connection:
    a failover or a pooler restart, often after the statement committed), ``step(True)``
    once more after ``pause`` seconds, on a new connection if the old one is unusable:
    sent again, a step must answer with what its first try did. Inside ``atomic()`` the
    error is raised (the caller's transaction is gone with it), as is any other error (a
    statement that is wrong would be wrong again)."""
    try:
        return step(False)
    except (OperationalError, InterfaceError):  # a closed connection raises the latter
        connection = connections[alias]
        if connection.in_atomic_block:
            raise
        logger.warning("A statement's reply was lost; sending it again", exc_info=True)
        # Only an unusable connection is closed: a healthy one may hold the caller's
        # session state (a server-side cursor, a SET).
        if connection.connection is not None and not connection.is_usable():
            connection.close()
        time.sleep(pause)
        return step(True)


def skip_health_check(alias: str) -> None:
    """Let the caller's next statement on ``alias`` stand in for Django's health check
    (``CONN_HEALTH_CHECKS``, re-armed before each job as before each request): a step that
    is sent again on a new connection after an error needs no ``SELECT 1`` first, a round
    trip a job would wait for. A new connection needs none either."""
    connection = connections[alias]
    if connection.connection is not None:
        setattr(connection, "health_check_done", True)  # noqa: B010 (not in django-stubs)


def _lock_timed_out(exc: Exception) -> bool:
    """Whether ``exc`` is a lock wait that ran past its ``lock_timeout``."""
    return psycopg is not None and isinstance(exc.__cause__, psycopg.errors.LockNotAvailable)


def _lost_prepared(connection: BaseDatabaseWrapper, exc: Exception) -> bool:
    """Whether ``exc`` says a prepared statement is missing; if so, forget them all."""
    cause = exc.__cause__
    if psycopg is None or not isinstance(cause, psycopg.errors.InvalidSqlStatementName):
        return False
    raw = connection.connection
    if isinstance(raw, psycopg.Connection):
        raw._prepared.clear()  # psycopg's own bookkeeping; no public way to reset it
    return True


def statement_cursor(connection: BaseDatabaseWrapper) -> Any:
    """A cursor for the library's named statements on ``connection``.

    Planning is most of a named statement's server time (the slot's acquire: 0.3 ms to
    plan, 0.07 ms to run), so on PostgreSQL with psycopg 3 each is prepared on a
    connection the second time it runs there (a connection used once, as with
    ``CONN_MAX_AGE = 0``, never pays for preparing) and only executed after that. The
    cursor binds its parameters on the server (as ``server_side_binding`` does) and goes
    through Django's cursor wrapper, so query logging, ``execute_wrapper`` and the
    database error classes are the same as for any other statement. Django's own queries
    are left alone: the connection's ``prepare_threshold`` (None unless ``OPTIONS`` sets
    it) is raised only while a library statement runs. Prepared statements live on one
    server connection: behind a transaction pooler they need PgBouncer 1.22 or later with
    ``max_prepared_statements`` set; turn them off with ``FAIR_JOBS_PREPARED_STATEMENTS =
    False`` for older poolers."""
    if (
        psycopg is None
        or connection.vendor != "postgresql"
        or not fair_settings.PREPARED_STATEMENTS
    ):
        return connection.cursor()
    # What Django's own cursor() does before it hands out a cursor.
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    raw = connection.connection
    if not isinstance(raw, psycopg.Connection):  # psycopg2 installed beside psycopg 3
        return connection.cursor()
    cursor: Any
    with connection.wrap_database_errors:
        cursor = _Preparing(raw)
        _same_time_zone(connection, cursor)
    if connection.queries_logged:
        return connection.make_debug_cursor(cursor)
    return connection.make_cursor(cursor)


def _same_time_zone(connection: Any, cursor: Any) -> None:
    """Load timestamps in the connection's time zone, as Django's cursors do."""
    from django.db.backends.postgresql.psycopg_any import register_tzloader
    from psycopg.pq import Format

    tzloader = connection.connection.adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT)
    if connection.timezone != tzloader.timezone:
        register_tzloader(connection.timezone, cursor)


TIMESTAMPTZ_OID = 1184
"""PostgreSQL's type oid of ``timestamptz``."""

PREPARE_AT = 1
"""The ``prepare_threshold`` while a library statement runs, where the connection's own is
None (Django's default): psycopg prepares a statement once it has run this many times on
the connection, so at its second run there."""


@dataclass(frozen=True)
class _Shown:
    """What Django's query log reads of a cursor's last statement (``_query.query``),
    which psycopg does not keep for a prepared statement."""

    query: bytes


if psycopg is not None:

    class _Preparing(psycopg.Cursor[Any]):
        """A server-binding cursor that prepares the statements it runs from their second
        run on its connection, without changing how the connection runs other queries."""

        def execute(
            self,
            query: Any,
            params: Any = None,
            *,
            prepare: bool | None = None,
            binary: bool | None = None,
        ) -> Any:
            """Execute ``query``, counted by psycopg towards its preparation."""
            raw = self.connection
            threshold = raw.prepare_threshold
            if threshold is None:
                raw.prepare_threshold = PREPARE_AT
            try:
                done = super().execute(query, params, prepare=prepare, binary=binary)
            finally:
                if threshold is None:
                    raw.prepare_threshold = None
            if self._query is None:
                self._query = _Shown(str(query).encode())  # type: ignore[assignment]
            return done


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


SCHEMA_STATES = frozenset({"42883", "42P01", "42703"})
"""PostgreSQL's codes for an undefined function, table and column: what a statement of
the library meets on a database that lacks some of its migrations."""


def missing_migrations(alias: str) -> list[str]:
    """The library's migrations that ``alias`` has not applied, in order. Read on a
    connection of its own, since the caller's may be inside a transaction a failed
    statement has aborted."""
    from django.db.migrations.recorder import MigrationRecorder

    on_disk = sorted(p.stem for p in (Path(__file__).parent / "migrations").glob("[0-9]*.py"))
    connection = connections.create_connection(alias)
    try:
        recorder = MigrationRecorder(connection)
        applied = (
            {name for app, name in recorder.applied_migrations() if app == "fair_jobs"}
            if recorder.has_table()
            else set()
        )
    finally:
        connection.close()
    return [name for name in on_disk if name not in applied]


def not_migrated(alias: str, missing: list[str]) -> NotMigratedError:
    """The error that says which of the library's migrations ``alias`` lacks."""
    return NotMigratedError(
        f"django-fair-jobs: the database {alias!r} has not applied the migrations "
        f"{', '.join(missing)} of the app fair_jobs, so the library's tables or functions "
        "are missing or out of date. Run: python manage.py migrate fair_jobs"
        + ("" if alias == "default" else f" --database {alias}")
    )


def require_migrated(alias: str) -> None:
    """Raise :class:`NotMigratedError` if ``alias`` lacks any of the library's
    migrations."""
    missing = missing_migrations(alias)
    if missing:
        raise not_migrated(alias, missing)


_migrated: set[str] = set()
"""The aliases this process found fully migrated (:func:`require_migrated_once`)."""


def require_migrated_once(alias: str) -> None:
    """:func:`require_migrated`, read once per process and alias that has every migration:
    the first ``delay()`` of a process on a database that lacks one raises, even where its
    statements would still work (a migration that changed only the worker's). A database
    that cannot be read now is read again at the next call."""
    if alias in _migrated:
        return
    try:
        require_migrated(alias)
    except (OperationalError, ProgrammingError):
        return  # the statement that follows says what is wrong with the database
    _migrated.add(alias)


def schema_error(exc: BaseException, alias: str) -> NotMigratedError | None:
    """For an error a statement of the library raised on ``alias``: the
    :class:`NotMigratedError` to raise instead, when the statement met a missing table,
    column or function and migrations are indeed missing; else None (only then are the
    migrations read, so other errors cost nothing more)."""
    cause = exc.__cause__ or exc
    text = str(exc)
    if getattr(cause, "sqlstate", None) not in SCHEMA_STATES and not text.startswith(
        ("no such table", "no such column", "table fair_jobs_")
    ):
        return None
    try:
        missing = missing_migrations(alias)
    except (OperationalError, ProgrammingError):
        return None
    return not_migrated(alias, missing) if missing else None

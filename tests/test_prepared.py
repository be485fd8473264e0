"""The library's named statements are prepared on each PostgreSQL connection (planned
once), unless ``FAIR_JOBS_PREPARED_STATEMENTS`` is off; the user's own queries are not;
and the prepared statements still pass through Django's cursor wrapper (query capture)."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_fair_jobs.slots import store as slot_store

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="prepared statements are PostgreSQL's"
    ),
]


def prepared_on_connection() -> list[str]:
    """The statements prepared on this session (the server's own view)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def acquire_and_release(process_id: uuid.UUID) -> None:
    acquired = slot_store.try_acquire(
        tenant="acme", queue="fair", task_id=str(uuid.uuid4()), limit=5,
        process_id=process_id, timeout=60,
    )  # fmt: skip
    assert acquired.grant is not None, acquired
    assert slot_store.release(acquired.grant) == 0


def test_on__acquire_and_release_are_prepared_once__and_still_captured(
    process: uuid.UUID,
) -> None:
    connection.close()  # a fresh session: nothing prepared on it yet
    with CaptureQueriesContext(connection) as captured:
        for _ in range(3):
            acquire_and_release(process)
    assert len(captured) == 6  # one acquire and one release per job, all seen by Django
    assert all("fair_jobs_slotlease" in (query["sql"] or "") for query in captured), captured
    prepared = prepared_on_connection()
    assert len([s for s in prepared if "fair_jobs_slotlease" in s]) == 2, prepared
    # Django's own queries keep Django's setting: nothing is prepared by count.
    assert connection.connection.prepare_threshold is None


def test_on__a_connection_used_once_prepares_nothing(process: uuid.UUID) -> None:
    # CONN_MAX_AGE = 0: a statement run once on a connection would pay for preparing
    # (a round trip more) and gain nothing.
    connection.close()
    acquire_and_release(process)
    assert prepared_on_connection() == []


def test_on__prepared_statements_lost_behind_psycopg_s_back__prepared_again(
    process: uuid.UUID,
) -> None:
    connection.close()
    for _ in range(2):
        acquire_and_release(process)
    assert prepared_on_connection() != []
    # A reset psycopg does not see: its record says prepared, the session has none.
    with connection.cursor() as cursor:
        cursor.execute("DISCARD ALL")
        cursor.execute("DISCARD ALL")
    for _ in range(2):
        acquire_and_release(process)
    assert len([s for s in prepared_on_connection() if "fair_jobs_slotlease" in s]) == 2


def test_on__the_users_own_queries_are_not_prepared(process: uuid.UUID) -> None:
    connection.close()
    acquire_and_release(process)  # raises the connection's threshold
    for _ in range(20):
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s AS users_own_query", [4242])
    assert not [s for s in prepared_on_connection() if "users_own_query" in s]


@override_settings(FAIR_JOBS_PREPARED_STATEMENTS=False)
def test_off__nothing_is_prepared(process: uuid.UUID) -> None:
    connection.close()
    for _ in range(3):
        acquire_and_release(process)
    assert prepared_on_connection() == []

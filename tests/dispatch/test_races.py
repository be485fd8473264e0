"""Dispatch under concurrency, with real PostgreSQL sessions."""

from __future__ import annotations

import threading
import uuid

import pytest
from django.db import connection, connections

from django_fair_jobs import dispatch, identity
from django_fair_jobs.dispatch.models import DispatchQueue
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="two sessions racing need PostgreSQL"
)


@pytest.mark.django_db(transaction=True)
def test_refresh_capacity__the_queue_row_inserted_meanwhile_by_an_enqueue__no_error() -> None:
    # A worker process that starts computes its queue's capacity while the first enqueue
    # on that queue inserts the queue's row. The refresh found no row, waited on the
    # enqueue's, and failed on the duplicate key: the queue kept no capacity until the
    # next maintenance pass, so a countdown come due was not dispatched.
    identity.register_process(
        process_id=uuid.uuid4(), node="n@h", hostname="h", pid=1, queues=["race"], concurrency=2
    )
    import psycopg

    params = connection.get_connection_params()
    connect_params = {k: v for k, v in params.items() if k != "cursor_factory"}
    enqueue = psycopg.connect(**connect_params)
    enqueue.execute(
        "INSERT INTO fair_jobs_dispatchqueue"
        " (queue, capacity, slack, in_flight, virtual_time, dispatched_total, updated_at)"
        " VALUES ('race', 0, 0, 0, 0, 0, now()) ON CONFLICT (queue) DO NOTHING"
    )  # uncommitted: its transaction is open, as an enqueue's is mid-statement
    errors: list[BaseException] = []

    def refresh() -> None:
        try:
            dispatch.refresh_capacity(slack_per_node=0, timeout=60)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=refresh)
    thread.start()
    try:
        # Autocommit: inside one transaction pg_stat_activity keeps its first snapshot.
        with psycopg.connect(autocommit=True, **connect_params) as look:
            # Until the refresh waits on the enqueue's row (or ends at once, an error).
            waiting = (
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            wait_for(
                lambda: not thread.is_alive() or look.execute(waiting).fetchone() != (0,),
                20,
                "the refresh to wait on the enqueue's row",
            )
    finally:
        enqueue.commit()
        enqueue.close()
        thread.join(20)
    assert errors == []
    assert DispatchQueue.objects.get(queue="race").capacity == 2

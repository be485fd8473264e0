"""The wait histogram's statements. One upsert adds a flush's counts to their rows; it is
the same SQL on PostgreSQL and SQLite (``INSERT ... ON CONFLICT DO UPDATE``), so this room
has no ORM twin."""

from __future__ import annotations

from django.db import connections, router


def _alias() -> str:
    # The models are imported when used: this module is imported before the app registry
    # is ready (through the task class).
    from django_fair_jobs.models import WaitBucket

    return router.db_for_write(WaitBucket)


def add(counts: dict[tuple[str, str, int], tuple[int, float]]) -> None:
    """Add ``counts`` ((queue, tenant class, bucket) -> (jobs, waits' sum)) to the rows,
    creating the rows that do not exist yet: one ``executemany`` (one round trip on
    psycopg 3, which pipelines it)."""
    if not counts:
        return
    rows = [
        (queue, cls, bucket, count, total)
        for (queue, cls, bucket), (count, total) in sorted(counts.items())
    ]
    with connections[_alias()].cursor() as cursor:
        cursor.executemany(
            "INSERT INTO fair_jobs_waitbucket (queue, tenant_class, bucket, count, total_seconds)"
            " VALUES (%s, %s, %s, %s, %s)"
            " ON CONFLICT (queue, tenant_class, bucket) DO UPDATE SET"
            " count = fair_jobs_waitbucket.count + excluded.count,"
            " total_seconds = fair_jobs_waitbucket.total_seconds + excluded.total_seconds",
            rows,
        )


def rows() -> list[tuple[str, str, int, int, float]]:
    """Every stored bucket: (queue, tenant class, bucket, jobs, waits' sum)."""
    from django_fair_jobs.models import WaitBucket

    return list(
        WaitBucket.objects.using(router.db_for_read(WaitBucket)).values_list(
            "queue", "tenant_class", "bucket", "count", "total_seconds"
        )
    )

"""The wait histogram's statements. One upsert adds a flush's counts to their rows; it is
the same SQL on PostgreSQL and SQLite (``INSERT ... ON CONFLICT DO UPDATE``), so this room
has no ORM twin."""

from __future__ import annotations

from django.db import connections, router

_TABLE = "fair_jobs_waitbucket"
""":class:`~django_fair_jobs.models.WaitBucket`'s table (its Meta says so too)."""


def _alias() -> str:
    # The models are imported when used: this module is imported before the app registry
    # is ready (through the task class).
    from django_fair_jobs.models import WaitBucket

    return router.db_for_write(WaitBucket)


def add(counts: dict[tuple[str, str, int], tuple[int, float]]) -> None:
    """Add ``counts`` ((queue, tenant class, bucket) -> (jobs, waits' sum)) to the rows,
    creating the rows that do not exist yet, in one statement."""
    if not counts:
        return
    values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(counts))
    params: list[str | int | float] = []
    for (queue, cls, bucket), (count, total) in sorted(counts.items()):
        params += [queue, cls, bucket, count, total]
    with connections[_alias()].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {_TABLE} (queue, tenant_class, bucket, count, total_seconds)"
            f" VALUES {values}"
            " ON CONFLICT (queue, tenant_class, bucket) DO UPDATE SET"
            f" count = {_TABLE}.count + excluded.count,"
            f" total_seconds = {_TABLE}.total_seconds + excluded.total_seconds",
            params,
        )


def rows() -> list[tuple[str, str, int, int, float]]:
    """Every stored bucket: (queue, tenant class, bucket, jobs, waits' sum)."""
    from django_fair_jobs.models import WaitBucket

    return list(
        WaitBucket.objects.using(router.db_for_read(WaitBucket)).values_list(
            "queue", "tenant_class", "bucket", "count", "total_seconds"
        )
    )

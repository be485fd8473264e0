"""Mechanism A, tenant concurrency slots: acquire, defer, release, wake.

The protocol, each step one statement on PostgreSQL (see ``slots/store.sql``):

1. **acquire**: a conditional increment of the (tenant, queue) row plus a lease row.
2. If that fails, **defer**: ``park`` stores the job's signature in ``fair_jobs_parkedjob``
   (only if the slot is still full under the row lock, else acquire again), or ``retry``
   re-publishes it with a jittered countdown. The message is then acknowledged.
3. **release**: delete the holder's lease (fenced by its token) and decrement; if jobs are
   parked on the slot, **wake** the oldest: take the slot on its behalf, reserve a lease
   for it, and re-publish its signature at once.

Parked jobs keep their task id, arguments, headers, links and retry count. Deferral never
consumes ``max_retries``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django_fair_jobs import db, events, messages
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.conf import MAX_LIMIT, is_limit
from django_fair_jobs.db import after_commit
from django_fair_jobs.errors import (
    TenantLimitError as TenantLimitError,
)
from django_fair_jobs.slots import store as slot_store

if TYPE_CHECKING:
    from datetime import datetime

    from celery import Celery, Task

    from django_fair_jobs.models import TenantQueueSlot

logger = logging.getLogger("django_fair_jobs.slots")


def is_woken(task: Task[Any, Any]) -> bool:
    """True if the current job of ``task`` is a woken parked job's copy: such a copy runs
    only while its parked row exists, and consumes it. A redelivery (its holder died
    before acknowledging) is a fresh start instead: the parked row went when the job first
    started, so as a woken copy it would be dropped as stale and the job lost."""
    return fair_headers.is_woken(task.request)


def wake(slot_id: int, limit: int | None = 1, app: Celery | None = None) -> int:
    """Wake up to ``limit`` parked jobs of ``slot_id`` (None: as many as have room).

    Returns how many were re-published. Inside the caller's ``atomic()`` (an admin save,
    ``ATOMIC_REQUESTS``) the wake-up waits for the commit and 0 is returned: a reservation
    and a message sent before it would reach a worker that cannot see them yet.
    """
    from django.db import router

    from django_fair_jobs.models import TenantQueueSlot

    if after_commit(lambda: wake(slot_id, limit, app), router.db_for_write(TenantQueueSlot)):
        return 0
    woken = 0
    while limit is None or woken < limit:
        job = slot_store.wake_one(slot_id)
        if job is None:
            break
        messages.publish_woken(job, app=app)
        woken += 1
    return woken


def _check_limit(value: Any, what: str) -> None:
    if value is not None and not is_limit(value):
        raise TenantLimitError(
            f"{what} must be a whole number from 0 (0 pauses the tenant) to {MAX_LIMIT},"
            f" or None; got {value!r}."
        )


def set_tenant_limit(
    tenant: str,
    queue: str,
    max_jobs: int | None,
    *,
    user: str = "",
    source: str = "python",
    app: Celery | None = None,
) -> TenantQueueSlot:
    """Set ``tenant``'s ``max_jobs`` override on ``queue`` (None: the task's default; 0:
    paused), ending any boost; records the change in the limit history and wakes the
    parked jobs the new limit lets start. Creates the slot row if the tenant has none."""
    from django.db import transaction

    from django_fair_jobs.models import LimitChange, TenantQueueSlot

    _check_limit(max_jobs, "max_jobs")
    with transaction.atomic():
        row, _ = TenantQueueSlot.objects.get_or_create(tenant=tenant, queue=queue)
        row = TenantQueueSlot.objects.select_for_update().get(pk=row.pk)
        old = row.max_jobs
        TenantQueueSlot.objects.filter(pk=row.pk).update(
            max_jobs=max_jobs, boost_until=None, boost_restore=None
        )
        LimitChange.record(
            tenant=tenant, queue=queue, field="max_jobs", old=old, new=max_jobs, user=user,
            source=source, note="boost ended early" if row.boost_until is not None else "",
        )  # fmt: skip
    row.max_jobs, row.boost_until, row.boost_restore = max_jobs, None, None
    wake(row.pk, limit=None, app=app)
    events.limit_changed.send(sender=TenantQueueSlot, tenant=tenant, queue=queue, app=app)
    return row


def boost(
    tenant: str,
    queue: str,
    max_jobs: int,
    until: datetime,
    *,
    user: str = "",
    source: str = "python",
    app: Celery | None = None,
) -> TenantQueueSlot:
    """Raise ``tenant``'s limit on ``queue`` to ``max_jobs`` until ``until`` (an aware
    datetime); then the maintenance pass puts back the override it replaced, by itself.

    Boosting a boosted tenant changes the boost and keeps the override to put back.
    Records the change and wakes the parked jobs the boost lets start.
    """
    from django.db import transaction

    from django_fair_jobs.models import LimitChange, TenantQueueSlot

    _check_limit(max_jobs, "A boost's max_jobs")
    if until.tzinfo is None:
        raise TenantLimitError("A boost's end must be an aware datetime (with a time zone).")
    if until <= db.database_now():
        raise TenantLimitError(f"A boost must end in the future; {until.isoformat()} is past.")
    with transaction.atomic():
        row, _ = TenantQueueSlot.objects.get_or_create(tenant=tenant, queue=queue)
        row = TenantQueueSlot.objects.select_for_update().get(pk=row.pk)
        restore = row.boost_restore if row.boost_until is not None else row.max_jobs
        TenantQueueSlot.objects.filter(pk=row.pk).update(
            max_jobs=max_jobs, boost_until=until, boost_restore=restore
        )
        LimitChange.record(
            tenant=tenant, queue=queue, field="max_jobs", old=row.max_jobs, new=max_jobs,
            user=user, source=source, note=f"boost until {until.isoformat()}",
        )  # fmt: skip
    row.max_jobs, row.boost_until, row.boost_restore = max_jobs, until, restore
    wake(row.pk, limit=None, app=app)
    events.limit_changed.send(sender=TenantQueueSlot, tenant=tenant, queue=queue, app=app)
    return row


def end_boosts(app: Celery | None = None) -> int:
    """Put back the override of every boost whose time is up (database clock); returns
    how many ended. Run by the maintenance pass; safe to run from several processes."""
    from django.db import transaction
    from django.db.models.functions import Now

    from django_fair_jobs.models import LimitChange, TenantQueueSlot

    ended = 0
    # The database's clock in the statement itself: no extra round trip on every pass.
    due = TenantQueueSlot.objects.filter(boost_until__lte=Now())
    for pk in due.values_list("pk", flat=True):
        with transaction.atomic():
            row = due.select_for_update().filter(pk=pk).first()
            if row is None:
                continue  # another pass ended it, or it was changed meanwhile
            TenantQueueSlot.objects.filter(pk=pk).update(
                max_jobs=row.boost_restore, boost_until=None, boost_restore=None
            )
            LimitChange.record(
                tenant=row.tenant, queue=row.queue, field="max_jobs", old=row.max_jobs,
                new=row.boost_restore, source="maintenance", note="boost ended",
            )  # fmt: skip
        ended += 1
        wake(pk, limit=None, app=app)  # a lower limit wakes nothing; a higher one may
        events.limit_changed.send(
            sender=TenantQueueSlot, tenant=row.tenant, queue=row.queue, app=app
        )
    return ended

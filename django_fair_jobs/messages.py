"""The one place a job is sent again (layer 1: imports layer 0 only).

A parked job woken on its tenant slot or in its queue's line (:func:`publish_woken`), and
a delivery postponed (a duplicate, or the database unreachable: :func:`postpone`), are
published again from their stored or delivered signature. A woken copy carries the wake
number, which marks it as the copy that may consume its parked row: as the ``fair_wake``
header for a publisher without the task class, and as ``FairTask``'s ``fair_wake`` option,
which its ``apply_async`` reads.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from celery import current_app
from kombu.utils.json import loads

from django_fair_jobs import headers as fair_headers

if TYPE_CHECKING:
    from celery import Celery, Signature, Task

logger = logging.getLogger("django_fair_jobs.messages")


class WokenJob(Protocol):
    """A parked job given its turn: the row it was woken on, its id, its stored signature
    (kombu JSON) and its wake number."""

    @property
    def slot_id(self) -> int: ...
    @property
    def task_id(self) -> str: ...
    @property
    def signature(self) -> str: ...
    @property
    def wake(self) -> int: ...


def is_fair(task: Any) -> bool:
    """Whether ``task`` is a ``FairTask`` (it takes the ``fair_*`` publish options). Asked
    by the attribute every ``FairTask`` has, so that the layers below the task class never
    import it."""
    return getattr(task, "fair_jobs_task", False) is True


def send(sig: Signature[Any], task: Any, wake: int | None = None) -> None:
    """Publish ``sig`` (a job of ``task``) again; with ``wake``, as a woken copy."""
    if wake is None:
        sig.apply_async()
        return
    sig.options["headers"] = {**(sig.options.get("headers") or {}), fair_headers.WAKE: wake}
    if is_fair(task):
        sig.apply_async(fair_wake=wake)
    else:
        sig.apply_async()  # a plain task (queue limits) knows no fair_* option


def publish_woken(job: WokenJob, app: Celery | None = None) -> None:
    """Re-publish a woken parked job. If the broker refuses it, the job stays marked
    woken and the sweep puts it back in line once its reservation expires."""
    celery_app = app or current_app
    try:
        sig = celery_app.signature(loads(job.signature))
        send(sig, celery_app.tasks.get(sig.task or ""), job.wake)
    except Exception:
        logger.exception("Could not re-publish woken job %s; the sweep will retry it", job.task_id)
        return
    logger.debug("Woke parked job %s on slot %s", job.task_id, job.slot_id)


def postpone(
    task: Task[Any, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    countdown: float,
    reason: str,
    fresh: bool = False,
) -> None:
    """Re-publish the current job unchanged (same task id, same ``retries``) to come back
    after ``countdown`` seconds. Needs only the broker, not the database. ``fresh``: the
    copy comes back unmarked even if this one was woken (its claim is known to have taken
    its parked row, so as a woken copy it would be dropped as stale)."""
    request = task.request
    logger.warning(
        "%s[%s]: %s; re-published to run in %.1f s", task.name, request.id, reason, countdown
    )
    # A woken copy stays marked as one, so that it still cannot run after another copy. A
    # redelivery is a fresh start (see is_woken) and must come back as one: unmarked.
    headers = dict(request.headers or {})
    woken = fair_headers.is_woken(task.request) and not fresh
    wake = headers.pop(fair_headers.WAKE, None) if woken else None
    headers.pop(fair_headers.WAKE, None)
    sig = task.signature_from_request(request, args, kwargs, countdown=countdown, headers=headers)
    send(sig, task, wake)

"""How a deferred job waits when it cannot be parked in a line: published again with a
jittered countdown (``fair_on_limit = "retry"``), and the stored signature parking needs."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

from celery import Task as CeleryTask
from kombu.exceptions import EncodeError
from kombu.utils.json import dumps

from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.slots import store as slot_store
from django_fair_jobs.tenants import for_log

if TYPE_CHECKING:
    from celery import Task

logger = logging.getLogger("django_fair_jobs.admission")


def reschedule(
    task: Task[Any, Any],
    tenant: str | None,
    queue: str,
    limited: bool,
    retry_countdown: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    headers: dict[str, Any],
) -> None:
    """``fair_on_limit = "retry"`` (or a job that cannot be parked): publish it again with
    a jittered countdown, and count the deferral."""

    request = task.request
    countdown = retry_countdown * random.uniform(0.5, 1.5)
    # Like Task.retry(), but keeping request.retries: deferral is not a failure.
    sig = task.signature_from_request(request, args, kwargs, countdown=countdown, headers=headers)
    if limited:
        queue_store.count_deferral(queue)
    elif tenant is not None:
        slot_store.count_deferral(tenant=tenant, queue=queue)
    try:
        sig.apply_async()
    except EncodeError:
        # Arguments JSON cannot store (FairArgumentsError): straight to the broker in
        # the job's own serializer, which FairTask.apply_async refuses at a first publish.
        CeleryTask.apply_async(task, sig.args, sig.kwargs, **sig.options)
    logger.debug(
        "Deferred %s[%s]: tenant %s at its limit on %s; retrying in %.1f s",
        task.name, request.id, for_log(tenant), queue, countdown,
    )  # fmt: skip


def stored_signature(
    task: Task[Any, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    headers: dict[str, Any],
    retry_countdown: float,
) -> str | None:
    """The current job's signature as kombu JSON, to park it; None if JSON cannot hold it."""
    request = task.request
    try:
        return dumps(dict(task.signature_from_request(request, args, kwargs, headers=headers)))
    except (TypeError, ValueError) as exc:
        # Only a job published by name with a serializer richer than JSON gets here
        # (FairTask.apply_async refuses such arguments): it cannot be stored, so it
        # waits through the broker instead, never lost.
        logger.warning(
            "%s[%s]: cannot park (%s: its arguments are not JSON); re-published to "
            "retry in %.1f s instead", task.name, request.id, exc, retry_countdown,
        )  # fmt: skip
        return None

"""Fair dispatch: jobs wait in PostgreSQL, and the next one is chosen when a worker frees.

A task with ``fair_dispatch = True`` publishes nothing at ``delay()``: the job (task id,
arguments, headers, links, countdown or ETA) is stored in its tenant's line on its queue
(:class:`~django_fair_jobs.dispatch.models.DispatchJob`) and ``AsyncResult`` works as
usual. The broker holds, per queue, no more messages than the queue's **capacity** (the
live worker processes consuming it) plus a small **slack** (``FAIR_JOBS_DISPATCH_SLACK``
per worker node), counting jobs published and not started and jobs running.

**When.** A job's end dispatches the room it leaves in the statement that ends it (the
start of its process's next job, or its flusher's); an enqueue while the queue has room
(after the caller's commit); a worker process that starts or stops; the maintenance pass
repairs what was missed (a lost message, a crashed publisher, a count that drifted).

**Room.** A queue's room is its live capacity plus slack, less its jobs dispatched or
running (counted from their rows), bounded by its queue limit and per-worker limit (a
paused queue has none). No step of a job writes a row shared by the whole queue.

**Who.** One rule, per queue: among tenants with jobs due and below their cap, the one
with the fewest jobs in flight per weight (``floor(in_flight / weight)``: max-min fair),
then the lowest virtual time (stride: each dispatch adds ``1 / weight``; a tenant whose
line was empty re-enters at the queue's virtual time, so idleness banks no credit), then
the oldest job. It is an index scan in that order, whatever the number of tenants.

**Caps are filters.** A tenant at its cap (the ``fair_max_jobs`` of the task of its oldest
waiting job, or its tenant slot's ``max_jobs`` override, boost or pause) is skipped and the
room goes to the next tenant; its line is marked blocked, out of the selection's index,
until its room comes back. At start the job takes its tenant slot with its own task's cap
and, on a limited queue, its queue place: the fence that keeps the limits. A job the fence
refuses goes back aside and its line stays blocked, so the line does not cycle through
the broker.

**At-least-once.** A dispatched job's row is marked before its message is published: a
publisher that dies in between leaves a row the maintenance pass publishes again. Every
copy of a message names its row; only the first copy to start runs (one conditional
UPDATE), later copies are acknowledged without running. A step whose reply was lost is
sent again: a start answers "again" (the job runs), an end or a dispatch returns the jobs
its first try dispatched. A job whose worker process died while running it goes back to
its line as Celery would redeliver it (``acks_late`` with ``reject_on_worker_lost``, or
``acks_late`` when its whole node is gone); otherwise it is dropped, as Celery records the
failure.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import InterfaceError, OperationalError, connections, router
from django.utils import timezone

from django_fair_jobs import broker, db, validation
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.dispatch import message
from django_fair_jobs.dispatch.types import BATCH as BATCH
from django_fair_jobs.dispatch.types import Job as Job
from django_fair_jobs.dispatch.types import Outcome as Outcome
from django_fair_jobs.dispatch.types import Ready as Ready
from django_fair_jobs.dispatch.types import Started as Started
from django_fair_jobs.errors import DispatchError as DispatchError
from django_fair_jobs.routing import declared_queue, queue_name
from django_fair_jobs.tenants import for_log, warn_missing_tenant

if TYPE_CHECKING:
    from celery import Celery, Task

logger = logging.getLogger("django_fair_jobs.dispatch")

KNOWN_KEYS = frozenset({"tenant_weights"})

NO_TENANT = ""
"""The tenant of the one line that holds a queue's jobs without a tenant: no real tenant
can be empty (:func:`~django_fair_jobs.tenants.normalize_tenant` reads blank as none)."""

WEIGHT_TTL = 60.0
"""Seconds a process reuses a tenant's weight before asking ``tenant_weights`` again."""

MIN_WEIGHT, MAX_WEIGHT = validation.MIN_WEIGHT, validation.MAX_WEIGHT

FENCE_DELAY = 1.0
"""Seconds a job waits aside when the fence refused it at start (its tenant slot or queue
place was taken after it was dispatched: a job of another task, a lowered limit)."""


@dataclass(frozen=True)
class Options:
    """A validated ``fair_dispatch`` option."""

    tenant_weights: Callable[[list[str]], Mapping[str, Any]] | None


def option_errors(raw: Any) -> list[str]:
    """What is wrong with a ``fair_dispatch`` value (empty if nothing)."""
    if raw is None or isinstance(raw, bool):
        return []
    if not isinstance(raw, Mapping):
        return [f"fair_dispatch must be True, False or a dict, got {type(raw).__name__}"]
    problems = [f"unknown key {key!r}" for key in sorted(set(raw) - KNOWN_KEYS)]
    problem = validation.weights_problem(raw.get("tenant_weights"))
    return [*problems, problem] if problem else problems


def parse(raw: Any) -> Options | None:
    """The task's dispatch options, or None if it does not dispatch."""
    if not raw:
        return None
    problems = option_errors(raw)
    if problems:
        raise DispatchError("; ".join(problems))
    spec = raw.get("tenant_weights") if isinstance(raw, Mapping) else None
    if spec is None:
        spec = fair_settings.PLANNER_TENANT_WEIGHTS
    return Options(tenant_weights=None if spec is None else validation.weights_callable(spec))


def clean_weight(value: Any) -> float | None:
    """A weight as stored: a finite number >= 0 kept within ``[MIN_WEIGHT, MAX_WEIGHT]``
    (0 becomes ``MIN_WEIGHT``: such a tenant runs when no other waits); None if not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    weight = float(value)
    if math.isnan(weight) or weight < 0 or math.isinf(weight):
        return None
    return min(max(weight, MIN_WEIGHT), MAX_WEIGHT)


_weights: dict[tuple[str, str], tuple[float, float]] = {}


def weight_of(options: Options, queue: str, tenant: str, task_name: str) -> float | None:
    """The tenant's weight to store with this enqueue, or None to keep the stored one.
    ``tenant_weights`` is asked at most once per ``WEIGHT_TTL`` per tenant and process;
    if it fails or answers something that is not a weight, the tenant weighs 1 (logged)."""
    if options.tenant_weights is None:
        return None
    now = time.monotonic()
    cached = _weights.get((queue, tenant))
    if cached is not None and cached[1] > now:
        return None
    try:
        answer = options.tenant_weights([tenant])
        raw = answer.get(tenant, 1) if isinstance(answer, Mapping) else None
    except Exception:
        logger.exception("tenant_weights of %s failed; %s weighs 1", task_name, for_log(tenant))
        raw = 1
    weight = clean_weight(raw)
    if weight is None:
        logger.warning(
            "tenant_weights of %s gave %r for %s; weighs 1", task_name, raw, for_log(tenant)
        )
        weight = 1.0
    _weights[(queue, tenant)] = (weight, now + WEIGHT_TTL)
    return weight


def prepare(
    task: Task[Any, Any],
    options: Options,
    tenant: str | None,
    args: Any,
    kwargs: Any,
    publish_options: dict[str, Any],
) -> Job:
    """Freeze a job to wait in its tenant's line: its queue, its due time and its message,
    built now as Celery would publish it. A job without a tenant waits in the line of
    :data:`NO_TENANT`, under no tenant's cap, with a warning logged at most once per
    interval per task. Raises :class:`DispatchError` when it cannot be stored as JSON."""
    if tenant is None:
        warn_missing_tenant(task.name, "dispatched")
    publish_options = dict(publish_options)
    task_id = str(publish_options.pop("task_id", None) or uuid.uuid4())
    countdown, eta = publish_options.pop("countdown", None), publish_options.pop("eta", None)
    not_before = None
    if eta is not None:
        if isinstance(eta, str):
            eta = datetime.fromisoformat(eta)
        not_before = eta if timezone.is_aware(eta) else timezone.make_aware(eta, UTC)
    expires = publish_options.get("expires")
    if isinstance(expires, int | float) and not isinstance(expires, bool):
        # Celery counts a number of seconds from the publish; the job's clock starts at
        # delay(), however long it waits in its line.
        publish_options["expires"] = (timezone.now() + timedelta(seconds=expires)).isoformat()
    queue = queue_name(publish_options.get("queue") or declared_queue(task, args, kwargs))
    publish_options["queue"] = queue
    try:
        # Built now, as Celery would for a plain publish (lineage, priority, headers,
        # routing): it is published as stored when the job is dispatched.
        stored = message.build(task, args, kwargs, {**publish_options, "task_id": task_id})
    except message.Unstorable as exc:
        raise DispatchError(
            f"{task.name}: the job cannot wait in its tenant's line as JSON ({exc}); pass "
            "arguments, headers and options that JSON can hold."
        ) from None
    return Job(
        queue=queue,
        tenant=NO_TENANT if tenant is None else tenant,
        task_name=task.name,
        task_id=task_id,
        message=stored,
        not_before=not_before,
        weight=1.0 if tenant is None else weight_of(options, queue, tenant, task.name),
        cap=None if tenant is None else getattr(task, "fair_max_jobs", None),
        delay=float(countdown or 0.0) if eta is None else 0.0,
        on_loss=on_loss(task),
    )


def on_loss(task: Task[Any, Any]) -> int:
    """What the reap does with ``task``'s job if its process dies, as Celery would."""
    from django_fair_jobs.dispatch import models

    if not getattr(task, "acks_late", False):
        return models.DROP_ON_LOSS
    if getattr(task, "reject_on_worker_lost", None):
        return models.REQUEUE_ON_LOSS
    return models.REQUEUE_IF_NODE_LOST


def alias() -> str:
    """The database alias the lines are written to."""
    from django_fair_jobs.dispatch.models import DispatchJob

    return router.db_for_write(DispatchJob)


def _store() -> Any:
    """The lines' database's store: PostgreSQL's functions, or the ORM (``db.uses_sql``)."""
    alias_ = alias()
    if db.uses_sql(alias_):
        from django_fair_jobs.dispatch import store

        return store.Store(alias_)
    from django_fair_jobs.dispatch import store_orm

    return store_orm.Store(alias_)


def draw() -> int:
    """A number for one enqueue or dispatch to keep on what it does (its receipt, the
    jobs it dispatches): negative, so never a job's id as an end's is, and 62 random bits,
    so that two never meet in practice (a first enqueue whose number is taken raises)."""
    return -1 - secrets.randbits(62)


def enqueue(job: Job) -> list[Ready]:
    """Store ``job`` in its line and dispatch at once while its queue has room (one round
    trip, in autocommit); returns the jobs to publish now. It draws a number, stored as
    its receipt and kept on the jobs its dispatch takes, as :func:`dispatch`'s: after a
    lost reply (:func:`db.sent_again`) the same enqueue, sent again, finds the receipt
    (whatever became of the job since) and answers with the jobs its first try dispatched
    that have not started, or, if the first try did not commit, stores the job now; while
    the first try is still under way, the receipt's key makes the second wait for it."""
    by, store_ = draw(), _store()
    ready: list[Ready] = db.sent_again(alias(), lambda again: store_.enqueue(job, by, again=again))
    return ready


def stage(jobs: list[Job]) -> None:
    """Write the jobs' rows alone (one statement), aside and due at once (or at their
    countdown or ETA), inside the caller's transaction: they commit with the caller's data
    and lock nothing another step waits for; :func:`dispatch` after the commit lines them."""
    if jobs:
        _store().stage(jobs)


def enqueue_many(jobs: list[Job]) -> list[Ready]:
    """Store ``jobs`` in their lines in one round trip, then dispatch their queues while
    they have room; returns the jobs to publish. Lines are locked in (queue, tenant) order."""
    if not jobs:
        return []
    ordered = sorted(jobs, key=lambda j: (j.queue, j.tenant))
    return _store().enqueue_many(ordered)  # type: ignore[no-any-return]


def commits_async() -> bool:
    """Whether a start or an end of many commits without waiting for the disk here and now
    (``FAIR_JOBS_DISPATCH_ASYNC_COMMIT``, in autocommit): kept until :func:`confirm`."""
    if not fair_settings.DISPATCH_ASYNC_COMMIT:  # the default: no router call per start
        return False
    conn = connections[alias_ := alias()]
    return db.uses_sql(alias_) and conn.get_autocommit() and not conn.in_atomic_block


def start(
    job_id: int,
    process_id: uuid.UUID,
    *,
    ended: list[int] | None = None,
    async_commit: bool = False,
) -> Started:
    """A dispatched job starts in ``process_id``; one round trip. Sent again after a lost
    reply, it answers ``"again"``. ``ended``: jobs that ran to their end under the same
    process, ended in the same round trip after the start (as :func:`end_many`; the jobs
    their room went to come back in ``Started.ready``). ``async_commit`` (see
    :func:`commits_async`): its commit does not wait for the disk."""
    started: Started = _store().start(job_id, process_id, ended=ended, async_commit=async_commit)
    return started


def confirm(
    started: list[int], ended: list[int], process_id: uuid.UUID
) -> tuple[bool, int, list[Ready]]:
    """Make durable what ``process_id`` committed without waiting for the disk (starts,
    ends of many), making again what a crash of the server lost (``Store.confirm``).
    Returns whether they are confirmed (False: the process row is gone, nothing written),
    how many starts had been lost, and the jobs to publish."""
    return _store().confirm(started, ended, process_id)  # type: ignore[no-any-return]


def end(
    job_id: int,
    process_id: uuid.UUID | None,
    *,
    outcome: Outcome = "end",
    delay: float = 0.0,
    block: bool = False,
    limit: int = BATCH,
    again: bool = False,
) -> list[Ready]:
    """Take a job out of flight (see :data:`~django_fair_jobs.dispatch.types.Outcome`):
    fenced by ``process_id`` for a running job, None for a dispatched one. ``block`` keeps
    its line out of the selection until its room comes back. The room it leaves is
    dispatched in the same round trip (up to ``limit`` jobs); returns the jobs to publish.
    ``again``: sent again after an error; if the first try committed (its reply lost),
    returns the jobs it dispatched that have not started (never published)."""
    return _store().end(  # type: ignore[no-any-return]
        job_id, process_id, outcome=outcome, delay=delay, block=block, limit=limit, again=again
    )


def end_many(
    job_ids: list[int],
    process_id: uuid.UUID,
    *,
    limit: int = BATCH,
    async_commit: bool = False,
    again: bool = False,
) -> list[Ready]:
    """End many jobs that ran to their end under ``process_id`` in one round trip (a
    process's ends flushed together); a job not running under it is skipped. Each queue
    they leave dispatches up to ``limit`` jobs into its room; returns the jobs to publish.
    ``async_commit`` as in :func:`start`, ``again`` as in :func:`end`."""
    if not job_ids:
        return []
    return _store().end_many(  # type: ignore[no-any-return]
        job_ids, process_id, limit=limit, async_commit=async_commit, again=again
    )


def dispatch(queue: str, limit: int = BATCH) -> list[Ready]:
    """Dispatch into whatever room ``queue`` has; returns the jobs to publish. Its jobs
    keep a number it draws, so that sent again after a lost reply (:func:`db.sent_again`)
    it answers with those its first try dispatched (negative: never a job's, as an end's)."""
    by, store_ = draw(), _store()
    ready: list[Ready] = db.sent_again(alias(), lambda a: store_.dispatch(queue, limit, by, a))
    return ready


def dispatch_queues(app: Celery, queues: Iterable[str]) -> int:
    """Dispatch each of ``queues`` and publish what that dispatched; returns how many were
    published. A dispatch that fails (its second try too) is logged, not raised: its jobs
    stay in line for the due poll and the maintenance pass (those its first try dispatched,
    for the lost-message repair)."""
    published = 0
    for queue in queues:
        try:
            published += publish(app, dispatch(queue))
        except (OperationalError, InterfaceError):
            logger.exception("Could not dispatch %s; the due poll or maintenance will", queue)
    return published


def due_queues(queues: list[str]) -> list[str]:
    """Those of ``queues`` that are due a dispatch: they hold countdowns or ETAs come due
    (their next dispatch puts them in line), or jobs waiting in line while they have room
    (an end that freed the room while an enqueue was committing could not see its job).
    One round trip: an index probe or two per queue, and the room of one with jobs waiting."""
    if not queues:
        return []
    return _store().due_queues(queues)  # type: ignore[no-any-return]


def publish(app: Celery, ready: list[Ready]) -> int:
    """Publish dispatched jobs; returns how many were published.

    Jobs dispatched together go to the broker together: on Redis (kombu 5.7 and later)
    their pushes travel in one pipeline, one round trip, sent once all are built; on other
    brokers one by one. A job that cannot be published goes aside for a delay that doubles
    with each failure (2 s, 4 s, ... at most a minute); nothing is dispatched into the
    room it leaves. After ``store.PUBLISH_ATTEMPTS`` failures it ends failed at its next
    failure of its own; a broker that cannot be reached is not one (its jobs wait the
    outage out). After a broker error the rest stay dispatched, for the lost-message
    repair once the broker is back. So one call makes at most one failed attempt (a
    ``delay()`` fails as fast as plain Celery's), and a poison job never stalls the
    others."""
    if not ready:
        return 0
    with app.producer_or_acquire() as producer:
        try:
            with message.together(producer, len(ready)):
                return _send(app, producer, ready)
        except Exception as exc:  # the pipeline failed: whether its pushes arrived is unknown
            logger.exception("Could not publish %d dispatched jobs together", len(ready))
            _gave_up(ready, 0, broker.unreachable(exc))
            return 0


def _send(app: Celery, producer: Any, ready: list[Ready]) -> int:
    """Hand each of ``ready`` to ``producer`` until one fails; returns how many were."""
    for position, item in enumerate(ready):
        try:
            message.send(app, producer, item.message, item.job_id)
        except Exception as exc:
            logger.exception("Could not publish dispatched job %s; it goes aside", item.job_id)
            _gave_up(ready, position, broker.unreachable(exc))
            return position
    return len(ready)


def _gave_up(ready: list[Ready], position: int, unreachable: bool) -> None:
    """The publish of ``ready[position]`` failed: aside; the rest wait for the repair."""
    _set_aside(ready[position].job_id, unreachable)
    if position + 1 < len(ready):
        logger.warning(
            "%d dispatched jobs are published again by the lost-message repair",
            len(ready) - position - 1,
        )


def _set_aside(job_id: int, unreachable: bool) -> None:
    """A job whose publish failed: aside after a growing delay, or failed for good after
    ``PUBLISH_ATTEMPTS`` failures, the last of them its own (``unreachable``: the broker
    could not be reached, which fails no job)."""
    from django_fair_jobs.dispatch.store import MAX_BACKOFF, PUBLISH_ATTEMPTS

    store_ = _store()
    try:
        failures = store_.failures(job_id) + 1
        if failures >= PUBLISH_ATTEMPTS and not unreachable:
            logger.error("Dispatched job %s failed %d publishes: it ends failed", job_id, failures)
            store_.end(job_id, None, outcome="failed", limit=0)
        else:
            delay = min(2.0**failures, MAX_BACKOFF)
            store_.end(job_id, None, outcome="later", delay=delay, limit=0)
    except Exception:
        logger.exception("Could not set job %s aside; the lost-message repair will", job_id)


def unregistered(app: Celery, job_id: int, task_name: str) -> None:
    """A worker rejected the dispatched job ``job_id``: it has no task ``task_name``. The job
    ends failed (shown by explain, status and the admin, which puts it back), and its room
    is dispatched now rather than held until the lost-message repair sends it again."""
    logger.error("Dispatched job %s: no task %r registered here; it ends failed", job_id, task_name)
    store_ = _store()
    ready: list[Ready] = db.sent_again(
        alias(), lambda again: store_.end(job_id, None, outcome="unregistered", again=again)
    )
    publish(app, ready)


def drop(app: Celery, task_id: str, *, terminated: bool) -> None:
    """A revoked job's message was dropped by the worker: its dispatched row goes (and a
    terminated running one), and the room it leaves is dispatched."""
    store_ = _store()
    for job_id, process_id in store_.running_rows(task_id, terminated=terminated):
        publish(app, store_.end(job_id, process_id))


def unblock(
    app: Celery | None = None, *, tenant: str | None = None, queue: str | None = None
) -> int:
    """Put back in the selection the blocked lines (of ``tenant``, on ``queue``; every one
    if both are None) whose room came back, and dispatch their queues; returns how many
    jobs that published. Called when a limit changes, and by maintenance."""
    from celery import current_app

    return dispatch_queues(app or current_app, _store().unblock(tenant, queue))


def recount() -> int:
    """Set every line's counts of jobs waiting and in flight, and its head, from the job
    rows, logging each that drifted (a count or a head should never drift: each is a sign
    of a defect); returns how many lines were set."""
    drift = _store().recount()
    for queue, tenant, waiting_was, waiting, in_flight_was, in_flight in drift:
        if (waiting_was, in_flight_was) == (waiting, in_flight):  # its head drifted
            logger.warning("The line of %s on %s had lost its head; set again",
                           for_log(tenant), queue)  # fmt: skip
            continue
        logger.warning(
            "The line of %s on %s counted %s waiting and %s in flight; its jobs say %s and %s",
            for_log(tenant), queue, waiting_was, in_flight_was, waiting, in_flight,
        )  # fmt: skip
    return len(drift)


def in_flight() -> dict[str, int]:
    """``{queue: jobs dispatched or running}``, counted from the job rows."""
    return _store().in_flight()  # type: ignore[no-any-return]


def put_back_failed(app: Celery, job_ids: list[int]) -> int:
    """Put failed jobs (refused by the broker too often, or by a worker without their
    task) back in line, due now, their failure forgotten; returns how many. Their queues
    are dispatched after the caller's commit, as ``delay()``'s: inside ``atomic()`` they
    are not due yet (due from the update's time), and a publish would precede the rows."""
    from django.db.models.functions import Now

    from django_fair_jobs.dispatch.models import FAILED, SCHEDULED, DispatchJob

    rows = DispatchJob.objects.using(alias()).filter(pk__in=job_ids, state=FAILED)
    queues = sorted(set(rows.values_list("queue", flat=True)))
    count = rows.update(state=SCHEDULED, not_before=Now(), publish_failures=0, failure="")
    if not db.after_commit(lambda: dispatch_queues(app, queues), alias()):
        dispatch_queues(app, queues)
    return count


def live_processes() -> dict[str, int]:
    """``{queue: worker processes consuming it}`` over the processes that beat within
    ``FAIR_JOBS_WORKER_TIMEOUT`` (the processes that make a queue's capacity)."""
    from django_fair_jobs.dispatch import store

    return store.live_capacity(alias(), fair_settings.WORKER_TIMEOUT)[0]


def room() -> dict[str, int]:
    """``{queue: how many more jobs it may have in flight now}``."""
    return _store().room()  # type: ignore[no-any-return]


def cancel(
    queue: str, tenant: str, task: str | None = None, limit: int = BATCH
) -> list[tuple[str, bool]]:
    """Delete up to ``limit`` of ``tenant``'s jobs scheduled, waiting in its line or failed
    on ``queue``, of the task named ``task`` or of every task, oldest first; the line's
    counts stay true. Returns ``(task id, had it failed)`` of each. Jobs dispatched or
    running are left alone (revoke those). A line blocked at its old head's cap whose new
    head may run stays blocked until :func:`unblock` (``backlog.cancel`` asks for it)."""
    return list(_store().cancel(queue, tenant, task, limit))


def lines_of(tenant: str) -> list[str]:
    """The queues on which ``tenant`` has a line, or jobs scheduled or failed (a countdown
    stored in its caller's transaction, or a failed job, may have none)."""
    from django_fair_jobs.dispatch.models import FAILED, SCHEDULED, DispatchJob, DispatchTenant

    lines = DispatchTenant.objects.using(alias()).filter(tenant=tenant)
    staged = DispatchJob.objects.using(alias()).filter(tenant=tenant, state__in=(SCHEDULED, FAILED))
    queues = set(lines.values_list("queue", flat=True))
    return sorted(queues | set(staged.values_list("queue", flat=True).distinct()))


@dataclass(frozen=True)
class Repaired:
    """What one maintenance pass of dispatch did."""

    requeued: int = 0
    dropped: int = 0
    republished: int = 0
    dispatched: int = 0


def refresh_capacity(slack_per_node: int, timeout: float) -> dict[str, int]:
    """Set every queue's capacity from the live worker processes (their queues and
    concurrency, heartbeat within ``timeout``) and its slack from their nodes; returns
    ``{queue: capacity}`` of the queues whose room grew."""
    return _store().refresh_capacity(slack_per_node, timeout)  # type: ignore[no-any-return]


def prune_receipts() -> int:
    """Delete the enqueue receipts older than ``RECEIPT_SECONDS``: an enqueue is sent
    again within seconds, or not at all. Returns how many."""
    from django_fair_jobs.dispatch.models import RECEIPT_SECONDS

    return _store().prune_receipts(RECEIPT_SECONDS)  # type: ignore[no-any-return]


def repair(app: Celery, *, timeout: float, lost_after: float, slack_per_node: int) -> Repaired:
    """The maintenance of dispatch: capacity from live processes; running jobs of dead
    processes back to line or dropped, as Celery would; dispatched jobs not started within
    ``lost_after`` seconds (doubling with each copy) published again while their queue has
    live capacity (a copy that arrives twice runs once); counts recounted; blocked lines
    whose room came back unblocked; every queue with room and jobs waiting dispatched (one
    whose dispatch fails twice is logged, and the pass goes on to the others)."""
    store_ = _store()
    store_.refresh_capacity(slack_per_node, timeout)
    requeued, dropped = store_.reap(timeout)
    republished = publish(app, store_.lost(lost_after))
    recount()
    store_.unblock(None, None)
    dispatched = dispatch_queues(app, store_.queues_with_room())
    return Repaired(requeued, dropped, republished, dispatched)

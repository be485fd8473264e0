"""A dispatched job's message, built once at ``delay()`` and published as stored.

At ``delay()`` Celery builds the job's message as it would for a plain publish (its
``send_task``: routing, lineage, headers, time limits, the publish signals), but the
producer it is handed records the message instead of sending it: :func:`build` returns
it as JSON, stored in the job's row. When the job is dispatched, :func:`send` publishes
that message through a real producer with the mark that names the row, without building
it again (building a message cost about as much as sending it). Several jobs dispatched
together share one producer.

What is recorded: the body (arguments, keyword arguments, callbacks), the headers and
properties, the exchange and routing key, the queue to declare, the serializer and
compression. Celery's ``before_task_publish`` and ``after_task_publish`` signals are sent
at ``delay()``, when the message is built, as for any ``delay()``; a ``task-sent`` event
is sent when the job is published, with the queue it goes to.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from celery.app.task import Task as CeleryTask
from kombu.utils.json import dumps, loads

from django_fair_jobs import headers as fair_headers

if TYPE_CHECKING:
    from celery import Celery, Task

PUBLISH_KEYS = (
    "exchange", "routing_key", "serializer", "compression", "delivery_mode", "headers",
    "timeout", "confirm_timeout",
)  # fmt: skip
"""The keyword arguments of the recorded publish that are stored as they are; ``declare``
is stored as queue names, the retry settings as the caller gave them, the rest as the
message's properties (reply-to, correlation id, priority, expiration)."""


class _Connection:
    """What Celery asks of a producer's connection while it builds a message."""

    recoverable_connection_errors: tuple[type[BaseException], ...] = ()
    connection_errors: tuple[type[BaseException], ...] = ()
    channel_errors: tuple[type[BaseException], ...] = ()

    def _reraise_as_library_errors(self) -> nullcontext[None]:
        return nullcontext()


class _Recorder:
    """A producer that records the first message published through it and sends nothing:
    the job's message. Its ``channel`` is a real one, on a connection of its own opened
    when asked for: the ``rpc://`` result backend declares the caller's reply queue on it
    at ``delay()``, as for any publish. (Not one of the app's pooled producers: a caller
    such as a group holds one already, and a thread waiting for a second could wait for
    ever once the pool is exhausted.)"""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.connection = _Connection()
        self.serializer: str | None = None
        self.message: tuple[Any, dict[str, Any]] | None = None
        self.real: Any = None

    @property
    def channel(self) -> Any:
        if self.real is None:
            self.real = self.app.connection_for_write()
        return self.real.default_channel

    def publish(self, body: Any, **kwargs: Any) -> None:
        if self.message is None:
            self.message = (body, kwargs)

    def release(self) -> None:
        """Close the connection of :attr:`channel`, if one was opened."""
        if self.real is not None:
            self.real.release()
            self.real = None


class _Events:
    """An event dispatcher that keeps the ``task-sent`` event's fields for :func:`send`."""

    def __init__(self) -> None:
        self.sent: dict[str, Any] | None = None

    def publish(self, type: str, fields: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if type == "task-sent":
            self.sent = {k: v for k, v in fields.items() if k not in ("queue", "exchange")}


class Unstorable(ValueError):
    """Part of a job's message cannot be stored as JSON."""


NOT_RECORDED = ("connection", "publisher", "producer", "retry", "retry_policy")
"""Options not handed to Celery when the message is built: a connection, publisher or
producer of the caller's would send it at once, and the retry settings apply when it is
sent (the caller's own are stored apart)."""


def build(task: Task[Any, Any], args: Any, kwargs: Any, options: dict[str, Any]) -> str:
    """The message Celery would publish for ``task`` with ``args``, ``kwargs`` and the
    publish ``options`` now (``task_id`` among them; no countdown or ETA: the job's row
    keeps its due time), as JSON. Raises :class:`Unstorable` when part of it cannot be
    stored as JSON, and what Celery raises for options it refuses."""
    recorder, events = _Recorder(task.app), _Events()
    # Celery's own apply_async, not a FairTask's (which would hold the job again); its
    # send_task passes the options it does not know on to the message's publish.
    given = {k: v for k, v in options.items() if k not in NOT_RECORDED}
    extra: dict[str, Any] = {"add_to_parent": False, "event_dispatcher": events}
    try:
        CeleryTask.apply_async(
            task, args, kwargs, producer=cast(Any, recorder), **{**given, **extra}
        )
    finally:
        recorder.release()
    if recorder.message is None:  # pragma: no cover - Celery always publishes once
        raise Unstorable("Celery built no message")
    body, publish = recorder.message
    stored: dict[str, Any] = {key: publish[key] for key in PUBLISH_KEYS if key in publish}
    exchange = stored.get("exchange")
    if exchange is not None and not isinstance(exchange, str):
        stored["exchange"] = exchange.name
    declared = [q for q in publish.get("declare") or () if hasattr(q, "bindings")]
    stored["declare"] = [q.name for q in declared]
    # The queue a task-sent event names, as Celery's send_task_message gives it.
    stored["queue"] = declared[0].name if declared else publish.get("routing_key")
    # Only the caller's own retry settings; the app's apply when the job is sent.
    stored["retry"] = options.get("retry")
    stored["retry_policy"] = options.get("retry_policy")
    skip = {*PUBLISH_KEYS, "declare", "retry", "retry_policy"}
    stored["properties"] = {k: v for k, v in publish.items() if k not in skip}
    stored["body"] = body
    stored["sent_event"] = events.sent
    try:
        return str(dumps(stored))
    except TypeError as exc:  # an argument, header or option JSON cannot hold
        raise Unstorable(str(exc)) from None


def send(app: Celery, producer: Any, stored: str, job_id: int) -> None:
    """Publish the stored message of the job whose row is ``job_id`` through
    ``producer``, with the mark that names that row. Raises what the broker raises."""
    message = loads(stored)
    headers = dict(message["headers"])
    headers[fair_headers.DISPATCH] = job_id
    properties = dict(message["properties"])
    expires = headers.get("expires")
    if expires and "expiration" in properties:
        # The broker's time to live counts from now: the job waited in its line. Celery
        # writes an aware time; a naive one is read as UTC, as Celery reads it.
        at = datetime.fromisoformat(expires)
        at = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
        properties["expiration"] = max(at.timestamp() - time.time(), 0.0)
    queues = app.amqp.queues
    # What this connection declared already goes unsaid: kombu would find it in the same
    # cache, but only after binding a copy of the queue to the channel at every publish.
    declared = getattr(producer.connection, "declared_entities", ())
    declare = [
        queue
        for queue in (queues[name] for name in message["declare"])
        if not (queue.can_cache_declaration and hash(queue) in declared)
    ]
    retry, policy = message.get("retry"), message.get("retry_policy")
    default_policy = app.conf.task_publish_retry_policy
    producer.publish(
        message["body"],
        exchange=message.get("exchange", ""),
        routing_key=message.get("routing_key"),
        serializer=message.get("serializer"),
        compression=message.get("compression"),
        delivery_mode=message.get("delivery_mode"),
        headers=headers,
        declare=declare,
        retry=app.conf.task_publish_retry if retry is None else retry,
        retry_policy=default_policy if policy is None else {**default_policy, **policy},
        timeout=message.get("timeout"),
        confirm_timeout=message.get("confirm_timeout"),
        **properties,
    )
    sent = message.get("sent_event")
    if sent is not None:
        route = {"queue": message.get("queue"), "exchange": message.get("exchange", "")}
        # Celery's own dispatcher (not enabled: it publishes through the producer given),
        # as its send_task_message uses.
        cast(Any, app.amqp)._event_dispatcher.publish(
            "task-sent", {**sent, **route, "routing_key": message.get("routing_key")}, producer
        )


def together(producer: Any, count: int) -> AbstractContextManager[Any]:
    """A batch of ``producer``'s publishes sent in one round trip at its exit, where the
    transport has one (kombu's ``Producer.batch``, Redis); else publish at once. A batch's
    failure leaves each of its messages sent or not: the caller's fence refuses a copy
    either way (a job set aside or published again starts at most once)."""
    batch = getattr(producer, "batch", None)
    if count < 2 or batch is None or not getattr(producer, "supports_batch_publish", False):
        return nullcontext()
    return cast(AbstractContextManager[Any], batch())

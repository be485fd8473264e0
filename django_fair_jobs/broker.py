"""What the broker holds, where it can be asked cheaply (layer 0: imports nothing of the
package): a bounded search of a Redis broker's queues for one job, for explain; and which
errors of a publish say that the broker cannot be reached, not that the job is wrong.

kombu's Redis transport keeps each queue as a list (one more list per priority step),
pushed on the left and consumed from the right, so the oldest messages are at the right
end and can be read without taking them. Other transports (RabbitMQ, SQS, the SQLAlchemy
transport) cannot be searched without consuming messages: :func:`find` says so instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django import db as django_db
from kombu.exceptions import InconsistencyError, KombuError
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.utils.json import loads


def _connection_level() -> tuple[type[BaseException], ...]:
    """The errors of a connection that failed (refused, reset, timed out, closed by the
    broker, refused its credentials, or the broker still loading its data), on every
    transport the library knows; redis-py's only where installed. Not a transport's own
    ``connection_errors`` whole: kombu's Redis transport lists ``KeyError`` there, which
    a publish's own router or serializer raises for a reason of the job's."""
    import amqp.exceptions

    kinds: list[type[BaseException]] = [
        OSError,
        amqp.exceptions.ConnectionError,
        InconsistencyError,
        django_db.OperationalError,
        django_db.InterfaceError,
    ]
    try:
        import redis.exceptions
    except ImportError:  # the Redis extra not installed: no Redis broker either
        return tuple(kinds)
    # ConnectionError covers the refused credentials and a broker still loading its data.
    return (*kinds, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a publish, says that the broker cannot be reached (a
    connection refused, reset, timed out or closed), not that the job is wrong. kombu's
    retry wraps a broker's refusal of one message (a Redis error reply, RabbitMQ's
    ``ContentTooLarge``, a queue no longer declared) in the same ``OperationalError`` as
    a lost connection, and a Redis batch (kombu 5.7) wraps either in a
    ``BatchPublishError``, so the error is looked through to its cause."""
    seen: BaseException = exc
    while isinstance(seen, KombuError) and seen.__cause__ is not None:
        seen = seen.__cause__
    return isinstance(seen, (KombuOperationalError, *_connection_level()))


SEARCHED = 10_000
"""Messages read at most in one search, the oldest of each queue first: a job further back
in a longer queue is not found (the answer says how many were read)."""


@dataclass(frozen=True)
class Search:
    """The answer of :func:`find`: whether the broker could be searched (``transport``
    names it), the queues and the number of messages read, and where the job is:
    ``queue`` and ``ahead`` (messages that the queue delivers before it), or None."""

    searchable: bool
    transport: str
    queues: tuple[str, ...]
    read: int = 0
    queue: str | None = None
    ahead: int | None = None


def find(app: Any, task_id: str, queues: list[str], limit: int = SEARCHED) -> Search:
    """Look for job ``task_id`` among the oldest messages of ``queues`` in ``app``'s
    broker, reading at most ``limit`` messages in all. Read-only: nothing is taken."""
    with app.connection_for_read() as conn:
        transport = str(conn.transport.driver_type)
        if transport != "redis":
            return Search(False, transport, tuple(queues))
        # One try: explain answers from the rows when the broker is down, without waiting
        # for the app's connection retries.
        conn.ensure_connection(max_retries=0)
        channel = conn.default_channel
        # The queues named, then every queue a publisher declared on this broker: a job
        # sent to a queue no worker consumes yet is exactly the one an operator asks about.
        queues = list(dict.fromkeys([*queues, *bound_queues(channel)]))
        # Every priority list of every queue, in delivery order: priority 0 first.
        keys = [(q, channel._q_for_pri(q, pri)) for q in queues for pri in channel.priority_steps]
        # One LLEN per list: a few queues of four priorities, each a loopback round trip.
        lengths = [int(channel.client.llen(key)) for _, key in keys]
        return _search(channel.client, task_id, queues, keys, lengths, limit)


BINDINGS = 1_000
"""Exchanges whose bindings :func:`bound_queues` reads at most."""


def bound_queues(channel: Any, limit: int = BINDINGS) -> list[str]:
    """Every queue bound to an exchange on a kombu Redis broker, sorted: kombu keeps each
    exchange's bindings in a set ``_kombu.binding.<exchange>`` whose members end with the
    queue's name, written when a publisher or a worker declares the queue. At most
    ``limit`` exchanges are read."""
    prefix = channel.global_keyprefix or ""
    pattern = prefix + channel.keyprefix_queue % "*"
    found: set[str] = set()
    for n, key in enumerate(channel.client.scan_iter(match=pattern, count=500)):
        if n >= limit:
            break
        name = key.decode() if isinstance(key, bytes) else str(key)
        exchange = name[len(prefix) + len(channel.keyprefix_queue % "") :]
        try:
            found.update(queue for _, _, queue in channel.get_table(exchange))
        except InconsistencyError:  # its last binding went since the scan
            continue
    return sorted(found)


def _search(
    client: Any, task_id: str, queues: list[str], keys: list[tuple[str, str]],
    lengths: list[int], limit: int,
) -> Search:  # fmt: skip
    """:func:`find` over the lists ``keys`` of ``lengths`` messages."""
    needle, budget, read = task_id.encode(), limit, 0
    before: dict[str, int] = {}  # per queue: messages of its higher priorities
    for (queue, key), length in zip(keys, lengths, strict=True):
        if length == 0 or budget <= 0:
            before[queue] = before.get(queue, 0) + length
            continue
        oldest = client.lrange(key, -min(length, budget), -1)
        budget -= len(oldest)
        read += len(oldest)
        for i, raw in enumerate(oldest):
            if needle in raw and _id_of(raw) == task_id:
                # Consumed from the right: the messages to its right go first.
                ahead = before.get(queue, 0) + len(oldest) - 1 - i
                return Search(True, "redis", tuple(queues), read, queue, ahead)
        before[queue] = before.get(queue, 0) + length
    return Search(True, "redis", tuple(queues), read)


def _id_of(raw: bytes) -> str | None:
    """The task id of a kombu Redis message (Celery's message protocol 2), or None."""
    try:
        message = loads(raw)
        return str(message["headers"]["id"])
    except (ValueError, KeyError, TypeError):
        return None

"""Queue names: which queue a job goes to when its caller names none.

Layer 0: imports nothing of the package, so every room may use it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Task


_DELAY_PREFIX = re.compile(r"(?:[01]\.){28}")
"""What native delayed delivery puts before a routing key: 28 binary digits, each followed
by a dot (``kombu.transport.native_delayed_delivery``)."""


def queue_from_routing_key(routing_key: str) -> str:
    """The queue's key in a delivery's ``routing_key``: the key itself, or, for a job that
    RabbitMQ's native delayed delivery held (a countdown or ETA on quorum queues, Celery
    5.5+), the key after the 28 binary digits that chain of exchanges routes by."""
    delayed = _DELAY_PREFIX.match(routing_key)
    return routing_key[delayed.end() :] if delayed else routing_key


def queue_name(queue: Any) -> str:
    """The name of a queue given as a string or a kombu ``Queue``."""
    return queue if isinstance(queue, str) else str(queue.name)


def declared_queue(task: Task[Any, Any], args: Any, kwargs: Any) -> str:
    """The queue Celery sends the task to when the caller names none: the task's ``queue``
    option, else its ``task_routes`` entry, else ``task_default_queue``."""
    own = getattr(task, "queue", None)
    if own:
        return queue_name(own)
    # Celery passes the task itself as task_type (its stubs say a class).
    task_type: Any = task
    route = task.app.amqp.router.route({}, task.name, args or (), kwargs or {}, task_type=task_type)
    return queue_name(route["queue"])


def request_queue(task: Task[Any, Any]) -> str:
    """The queue the current job of ``task`` was delivered from: the queue this worker
    consumes that is bound under the delivery's routing key (see :func:`consumed_queue`),
    else the task's declared queue, else ``task_default_queue``."""
    info = task.request.delivery_info or {}
    key = info.get("routing_key")
    if key:
        return consumed_queue(task.app, str(key))
    queue = getattr(task, "queue", None)
    return str(queue or task.app.conf.task_default_queue)


_consumed: dict[tuple[int, str], str] = {}
""":func:`consumed_queue`'s answers by the worker's queues and routing key: a worker's
queues seldom change while it runs, and the answer is on every job's path. Emptied when
it reaches :data:`CONSUMED_KEPT` keys (a topic exchange's keys may name entities)."""

CONSUMED_KEPT = 1024
"""Most answers :data:`_consumed` keeps."""


def consumed_queue(app: Any, routing_key: str) -> str:
    """The name of the queue a delivery under ``routing_key`` came from.

    A delivery names its routing key, not its queue. With Celery's default routing the two
    are the same. Otherwise the queue is found among the queues this worker consumes: the
    only one, or the one bound under that key (exactly, or by a topic exchange's pattern
    with ``*`` and ``#``), after native delayed delivery's prefix is stripped
    (:func:`queue_from_routing_key`). A key that names no such queue, or more than one, is
    taken as the queue's name."""
    key = queue_from_routing_key(routing_key)
    queues = app.amqp.queues
    # A worker started with -Q selected the queues it consumes (Celery keeps them in
    # _consume_from; its public consume_from falls back to every queue); elsewhere, every
    # queue the app knows.
    worker_queues = getattr(queues, "_consume_from", None)
    consumed = worker_queues or queues
    cached = (id(consumed), key)
    found = _consumed.get(cached)
    if found is not None:
        return found
    if worker_queues and len(worker_queues) == 1:  # every delivery comes from it
        found = next(iter(worker_queues))
    elif key in consumed:
        found = key
    else:
        bound = [name for name, queue in consumed.items() if _binds(queue, key)]
        found = bound[0] if len(bound) == 1 else key
    if len(_consumed) >= CONSUMED_KEPT:
        _consumed.clear()
    _consumed[cached] = found
    return found


def _binds(queue: Any, key: str) -> bool:
    """True if ``queue`` is bound under ``key``: its routing key is ``key``, or, on a topic
    exchange, a pattern that matches it (``*`` one word, ``#`` zero or more)."""
    binding = str(queue.routing_key or "")
    if binding == key:
        return True
    if getattr(queue.exchange, "type", None) != "topic" or not binding:
        return False
    return _topic_matches(binding.split("."), key.split("."))


def _topic_matches(pattern: list[str], words: list[str]) -> bool:
    """True if the words of a routing key match the words of a topic binding key."""
    # reachable[j]: the pattern so far can have consumed the first j words of the key.
    reachable = [True] + [False] * len(words)
    for token in pattern:
        if token == "#":
            for j in range(1, len(words) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
        else:
            reachable = [False] + [
                reachable[j] and (token == "*" or token == words[j]) for j in range(len(words))
            ]
    return reachable[-1]

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
""":func:`consumed_queue`'s answers by app and routing key: a worker's queues do not change
while it runs, and the answer is on every job's path."""


def consumed_queue(app: Any, routing_key: str) -> str:
    """The name of the queue a delivery under ``routing_key`` came from.

    A delivery names its routing key, not its queue. With Celery's default routing the two
    are the same; a queue declared with a routing key of its own (a topic exchange, as
    native delayed delivery on quorum queues needs) is found among the queues this worker
    consumes by that key, after the delay prefix is stripped
    (:func:`queue_from_routing_key`). A key no consumed queue is bound under is taken as
    the queue's name."""
    # Keyed after the prefix is stripped: countdowns give up to 2**28 prefixes.
    key = queue_from_routing_key(routing_key)
    found = _consumed.get((id(app), key))
    if found is not None:
        return found
    queues = app.amqp.queues
    # In a worker, consume_from holds the queues it consumes (-Q); elsewhere every queue.
    consumed = getattr(queues, "consume_from", None) or queues
    bound = [name for name, queue in consumed.items() if queue.routing_key == key]
    found = bound[0] if len(bound) == 1 and key not in consumed else key
    _consumed[(id(app), key)] = found
    return found

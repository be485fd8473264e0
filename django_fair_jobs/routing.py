"""Queue names: which queue a job goes to when its caller names none.

Layer 0: imports nothing of the package, so every room may use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Task


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
    """The queue the current job of ``task`` was delivered from: the delivery's routing
    key (the queue's name with Celery's default direct exchanges), else the task's
    declared queue, else ``task_default_queue``."""
    info = task.request.delivery_info or {}
    queue = info.get("routing_key") or getattr(task, "queue", None)
    return str(queue or task.app.conf.task_default_queue)

"""The values the dispatch room's steps pass between its package and its stores: a job to
store, a job to publish, what a start found, the outcomes of an end, and the batch size.
Its own module so that the stores import it and never the room's package, which imports
them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

BATCH = 1000
"""Most jobs one step dispatches at once (a new worker node's whole capacity)."""

Outcome = Literal["end", "back", "later", "failed", "unregistered"]
"""How a job leaves flight: it ended (its row goes), back at the head of its line, aside
for a delay, failed (its message could never be published), or failed because the worker
that received it had no task of its name (``unregistered``, not a failed publish)."""


@dataclass(frozen=True)
class Ready:
    """A job dispatched and to be published now: its row id and its message, built at
    ``delay()`` (see :mod:`django_fair_jobs.dispatch.message`)."""

    job_id: int
    message: str


@dataclass(frozen=True)
class Started:
    """What the start of a dispatched job found: ``"started"`` (it runs; ``cap`` is the
    cap the fence keeps, or None), ``"again"`` (the row already runs under this process:
    its own start whose reply was lost, or a second copy delivered to it) or
    ``"duplicate"`` (another copy ran or runs, or the job went back to its line while a
    start carrying ends looked: it is dispatched again from there). ``ready``: the jobs
    dispatched into the room of the ends the start carried, to publish."""

    status: str
    cap: int | None = None
    ready: tuple[Ready, ...] = ()


@dataclass(frozen=True)
class Job:
    """A job ready to be stored in its line: due after ``delay`` seconds (a countdown, by
    the database's clock) or at ``not_before`` (an ETA), at once if neither."""

    queue: str
    tenant: str
    task_name: str
    task_id: str
    message: str
    not_before: datetime | None
    weight: float | None
    cap: int | None
    delay: float = 0.0
    on_loss: int = 0

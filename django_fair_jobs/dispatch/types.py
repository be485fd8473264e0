"""The values the dispatch room's steps pass between its package and its stores: a job to
store, a job to publish, what a start found, and the batch size. Its own module so that the
stores import it and never the room's package, which imports them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

BATCH = 1000
"""Most jobs one step dispatches at once (a new worker node's whole capacity)."""


@dataclass(frozen=True)
class Ready:
    """A job dispatched and to be published now: its row id and stored signature."""

    job_id: int
    signature: str


@dataclass(frozen=True)
class Started:
    """What the start of a dispatched job found: ``"started"`` (it runs; ``cap`` is its
    tenant's cap in force, or None) or ``"duplicate"`` (another copy ran or runs)."""

    status: str
    cap: int | None = None


@dataclass(frozen=True)
class Job:
    """A job ready to be stored in its line."""

    queue: str
    tenant: str
    task_name: str
    task_id: str
    signature: str
    not_before: datetime | None
    weight: float | None
    cap: int | None

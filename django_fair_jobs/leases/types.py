"""The values the hold protocol passes between the stores and admission: a grant (proof that
a job holds its slots), the answers of an acquire, a woken parked job, a reap's count."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

ParkOutcome = Literal["parked", "already_parked", "room", "stale"]
AcquireStatus = Literal["held", "full", "duplicate", "stale"]


@dataclass(frozen=True)
class Grant:
    """Proof that a job holds its slots: its tenant slot (``slot_id``), its place in a
    limited queue (``queue_limit_id``), or both; what a release needs."""

    slot_id: int | None
    task_id: str
    token: uuid.UUID
    queue_limit_id: int | None = None
    spare: bool = False
    """The tenant slot left room to spare when this job took it (below the limit, nobody
    parked): keeping it for the process's next job blocks no one (slot handoff)."""


@dataclass(frozen=True)
class Acquisition:
    """The answer of an acquire: ``"held"`` (with a grant), ``"full"`` (the tenant is at
    its limit), ``"duplicate"`` (this task id is running in a live process) or ``"stale"``
    (a copy of a woken parked job that another copy already started)."""

    status: AcquireStatus
    grant: Grant | None = None


@dataclass(frozen=True)
class Woken:
    """A parked job that was given a slot (or, in a queue's line, its turn) and must now
    be re-published. ``slot_id`` is the tenant slot or the queue row it was woken on."""

    slot_id: int
    task_id: str
    signature: str
    wake: int


LimitedStatus = Literal[
    "held", "full", "queue_full", "unlimited", "new_tenant", "duplicate", "reserved", "stale"
]


@dataclass(frozen=True)
class LimitedAcquisition:
    """The answer of an acquire on a limited queue: see ``acquire_limited`` in
    ``queue_limits/store.sql`` for the statuses. ``grant`` is set when ``"held"``."""

    status: LimitedStatus
    grant: Grant | None = None


@dataclass(frozen=True)
class Reaped:
    """What a reap gave back: leases deleted, and per tenant slot and per queue row how
    many of them it held."""

    leases: int = 0
    slots: tuple[tuple[int, int], ...] = ()
    queues: tuple[tuple[int, int], ...] = ()

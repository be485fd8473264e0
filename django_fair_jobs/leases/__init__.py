"""Leases: what tenant slots and queue limits share (layer 2). A lease row says which job
holds a tenant slot or a place in a limited queue, and which process holds it; a parked row
says which job waits for one. :mod:`~django_fair_jobs.leases.store` reaps the leases of
dead holders, drops those of revoked jobs and gives their places back;
:mod:`~django_fair_jobs.leases.types` holds the values the stores answer with."""

from __future__ import annotations

from django_fair_jobs.leases.types import (
    AcquireStatus as AcquireStatus,
)
from django_fair_jobs.leases.types import (
    Acquisition as Acquisition,
)
from django_fair_jobs.leases.types import (
    Grant as Grant,
)
from django_fair_jobs.leases.types import (
    LimitedAcquisition as LimitedAcquisition,
)
from django_fair_jobs.leases.types import (
    LimitedStatus as LimitedStatus,
)
from django_fair_jobs.leases.types import (
    ParkOutcome as ParkOutcome,
)
from django_fair_jobs.leases.types import (
    Reaped as Reaped,
)
from django_fair_jobs.leases.types import (
    Woken as Woken,
)

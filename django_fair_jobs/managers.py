"""The old home of the storage, kept for one release so that old imports still work.

The statements moved into each mechanism's store (:mod:`django_fair_jobs.slots.store`,
:mod:`django_fair_jobs.queue_limits.store`, :mod:`django_fair_jobs.reroute.store`,
:mod:`django_fair_jobs.planner.store`), the leases both limits share into
:mod:`django_fair_jobs.leases.store`, worker process rows into
:mod:`django_fair_jobs.identity` and the database clock into :mod:`django_fair_jobs.db`.
Nothing in the package imports this module; see the changelog for every new path.
"""

from __future__ import annotations

from django_fair_jobs.db import database_now as database_now
from django_fair_jobs.leases.types import AcquireStatus as AcquireStatus
from django_fair_jobs.leases.types import Acquisition as Acquisition
from django_fair_jobs.leases.types import Grant as Grant
from django_fair_jobs.leases.types import LimitedAcquisition as LimitedAcquisition
from django_fair_jobs.leases.types import LimitedStatus as LimitedStatus
from django_fair_jobs.leases.types import ParkOutcome as ParkOutcome
from django_fair_jobs.leases.types import Reaped as Reaped
from django_fair_jobs.leases.types import Woken as Woken
from django_fair_jobs.queue_limits.store import UNCHANGED as UNCHANGED
from django_fair_jobs.reroute.store import Recorded as Recorded

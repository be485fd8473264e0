"""The message headers the library reads and writes, and the questions a worker asks of a
delivered job's request (layer 0: imports nothing of the package).

Every header starts with ``fair_``."""

from __future__ import annotations

from typing import Any

TENANT = "fair_tenant"
"""Carries an explicit tenant (``fair_tenant=`` at publish)."""

DEFERRALS = "fair_deferrals"
"""Counts how many times a job was deferred (for logs and explain)."""

WAKE = "fair_wake"
"""Marks a re-published parked job (its value: the wake number). Such a copy starts only
while the job's parked row exists; the first copy to start deletes it."""

WINDOW = "fair_window"
"""A counted job's reroute counts: ``{"counts": [...], "rule": index or None}``. Its
presence is what keeps a retry or any other re-publish from being counted again."""

MAX_JOBS = "fair_max_jobs"
"""A job rerouted by a rule with ``max_jobs``: its tenant's slot limit on the rule's
queue."""

PLAN_SHADOW = "shadow"
"""The :data:`PLAN` header's value on a planned job that shadow mode sent straight to the
broker: it has no virtual-queue row to delete when it starts."""

PLAN = "fair_plan"
"""A promoted planned job: it passes straight through (a retry of it too), and its start
deletes its row."""

DISPATCH = "fair_dispatch"
"""A dispatched job: the id of its row. A job that carries it was dispatched (it starts
and ends its row); a re-publish built from its request (a retry) goes back through its
tenant's line."""


ENQUEUED_AT = "fair_enqueued_at"
"""When the job was first enqueued (epoch seconds, the publisher's clock). Set by the first
publish, kept by every re-publish; the wait histogram measures a start from it."""


def is_redelivered(request: Any) -> bool:
    """True if the broker delivers this job again because its holder died before
    acknowledging it (a Celery request's ``delivery_info["redelivered"]``)."""
    return bool((request.delivery_info or {}).get("redelivered"))


def is_woken(request: Any) -> bool:
    """True if the job is a woken parked job's copy: such a copy runs only while its parked
    row exists, and consumes it. A redelivery (its holder died before acknowledging) is a
    fresh start instead: the parked row went when the job first started, so as a woken copy
    it would be dropped as stale and the job lost."""
    return WAKE in (request.headers or {}) and not is_redelivered(request)

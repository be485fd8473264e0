"""Stride scheduling, the planner's weighted fair share with memory: how one run's
promotions are shared among tenants (:func:`allocate`), the bound on a tenant's wait
(:func:`wait_bound`), and the weights a plan's ``tenant_weights`` gives (:func:`weights`)."""

from __future__ import annotations

import heapq
import logging
import math
import reprlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django_fair_jobs import validation
from django_fair_jobs.planner.plans import Plan, as_seconds
from django_fair_jobs.tenants import for_log

logger = logging.getLogger("django_fair_jobs.planner")


@dataclass(frozen=True)
class Allocation:
    """What one run promotes per tenant, and the virtual times after it."""

    counts: dict[str, int]
    passes: dict[str, float]
    virtual_time: float
    order: tuple[str, ...] = ()
    """Tenants in the order of their first promotion: the order their jobs are published
    in, so that a tenant the draw served first is not queued behind a big batch."""


def allocate(
    pending: Mapping[str, int],
    weights: Mapping[str, float],
    passes: Mapping[str, float],
    virtual_time: float,
    budget: int,
) -> Allocation:
    """Stride scheduling: give ``budget`` promotions one at a time to the tenant with the
    lowest pass among those with jobs left and weight > 0; each promotion adds ``1 /
    weight`` to its pass. A tenant's pass never starts below ``virtual_time`` (no credit
    for idle time); ``virtual_time`` advances to the pass of each tenant served."""
    heap: list[tuple[float, str]] = []
    new_passes = dict(passes)
    left = {}
    for tenant, n in pending.items():
        weight = weights.get(tenant, 0)
        if n > 0 and weight > 0:
            new_passes[tenant] = max(passes.get(tenant, virtual_time), virtual_time)
            left[tenant] = n
            heapq.heappush(heap, (new_passes[tenant], tenant))
    counts: dict[str, int] = {}
    order: list[str] = []
    while budget > 0 and heap:
        current, tenant = heapq.heappop(heap)
        virtual_time = max(virtual_time, current)
        if tenant not in counts:
            order.append(tenant)
        counts[tenant] = counts.get(tenant, 0) + 1
        left[tenant] -= 1
        budget -= 1
        new_passes[tenant] = current + 1.0 / weights[tenant]
        if left[tenant] > 0:
            heapq.heappush(heap, (new_passes[tenant], tenant))
    return Allocation(counts, new_passes, virtual_time, tuple(order))


def wait_bound(weight: float, weights: Sequence[float], budget: int) -> int:
    """The most runs a newly due tenant of ``weight`` waits for its first promotion
    among tenants of ``weights`` (its own included) with ``budget`` promotions a run."""
    total = sum(weights)
    return math.ceil(((total - weight) / weight + len(weights)) / budget) + 1


MIN_WEIGHT = validation.MIN_WEIGHT
MAX_WEIGHT = validation.MAX_WEIGHT


def weights(plan: Plan, tenants: list[str], *, task_name: str = "") -> dict[str, float]:
    """The weights ``plan``'s ``tenant_weights`` gives ``tenants`` (all 1 without one).

    The planner keeps running whatever the callable does: if it raises or returns
    something other than a mapping, every tenant weighs 1 in this run (logged); a value
    that is not a finite number >= 0 (a string, None, NaN, an infinity, a negative
    number) weighs 1 (logged); weights are kept within :data:`MIN_WEIGHT` and
    :data:`MAX_WEIGHT` (0 stays 0: not promoted). A call that takes longer than the
    plan's ``enqueue_interval`` is logged as a warning; the run still completes.
    """
    if plan.tenant_weights is None:
        return {tenant: 1.0 for tenant in tenants}
    name = task_name or "a planned task"
    started = time.monotonic()
    try:
        raw = plan.tenant_weights(list(tenants))
    except Exception:
        logger.exception("tenant_weights of %s failed; every tenant weighs 1 in this run", name)
        return {tenant: 1.0 for tenant in tenants}
    finally:
        elapsed = time.monotonic() - started
        if elapsed > plan.enqueue_interval:
            logger.warning(
                "tenant_weights of %s took %.2f s, longer than the enqueue interval (%s s): "
                "runs are late by as much, and past planner_lock_ttl (%s s) another planner "
                "may start meanwhile. Cache the weights, or compute them elsewhere.",
                name, elapsed, plan.enqueue_interval, plan.planner_lock_ttl,
            )  # fmt: skip
    if not isinstance(raw, Mapping):
        logger.warning(
            "tenant_weights of %s returned %s, not a dict of tenant to weight; every tenant "
            "weighs 1 in this run",
            name, reprlib.repr(raw),
        )  # fmt: skip
        return {tenant: 1.0 for tenant in tenants}

    found: dict[str, float] = {}
    for tenant, value in raw.items():
        number = as_seconds(value)  # a plain number check
        if number is None or not math.isfinite(number) or number < 0:
            logger.warning(
                "Weight %s of tenant %s (%s) is not a finite number >= 0; it weighs 1",
                reprlib.repr(value), for_log(tenant), name,
            )  # fmt: skip
            number = 1.0
        elif number and not MIN_WEIGHT <= number <= MAX_WEIGHT:
            bound = MIN_WEIGHT if number < MIN_WEIGHT else MAX_WEIGHT
            logger.warning(
                "Weight %r of tenant %s (%s) is outside [%g, %g]; it weighs %g",
                number, for_log(tenant), name, MIN_WEIGHT, MAX_WEIGHT, bound,
            )  # fmt: skip
            number = bound
        found[str(tenant)] = number
    return found

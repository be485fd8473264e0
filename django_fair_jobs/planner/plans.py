"""A task's ``fair_plan``: its keys, what is wrong with a value, and the validated
:class:`Plan` with the ``FAIR_JOBS_PLANNER_*`` defaults filled in."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django_fair_jobs import validation
from django_fair_jobs.conf import MAX_LIMIT, fair_settings
from django_fair_jobs.errors import PlanError

REQUIRED_KEYS = ("enqueue_jobs",)
KNOWN_KEYS = frozenset(
    {
        *REQUIRED_KEYS,
        "enqueue_interval",
        "tenant_weights",
        "latency_threshold",
        "planner_queue",
        "planner_lock_ttl",
    }
)

DEFAULT_ENQUEUE_INTERVAL = 1.0
"""Seconds between planner runs when ``fair_plan`` leaves ``enqueue_interval`` out: a job
enqueued on idle workers waits for the next run, so a long default would delay every job."""


@dataclass(frozen=True)
class Plan:
    """A validated ``fair_plan``, settings defaults filled in."""

    enqueue_interval: float
    enqueue_jobs: int
    tenant_weights: Callable[[list[str]], Mapping[str, Any]] | None
    latency_threshold: float
    planner_queue: str
    planner_lock_ttl: float


def as_seconds(value: Any) -> float | None:
    """``value`` as seconds (a number or a timedelta), or None if it is neither."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def plan_errors(raw: Any) -> list[str]:
    """What is wrong with a ``fair_plan`` value (empty if nothing)."""
    if raw is None:
        return []
    if not isinstance(raw, Mapping):
        return [f"fair_plan must be a dict, got {type(raw).__name__}"]
    problems = [f"unknown key {key!r}" for key in sorted(set(raw) - KNOWN_KEYS)]
    for key in REQUIRED_KEYS:
        if raw.get(key) is None:
            problems.append(f"{key} is required (how many jobs one planner run promotes)")
    interval = as_seconds(raw.get("enqueue_interval"))
    if raw.get("enqueue_interval") is not None and (
        interval is None or not 0 < interval <= MAX_LIMIT
    ):
        problems.append(
            f"enqueue_interval must be seconds > 0 (at most {MAX_LIMIT}) or a timedelta"
        )
    jobs = raw.get("enqueue_jobs")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        problems.append("enqueue_jobs must be a whole number >= 1")
    for key, strict in (("latency_threshold", False), ("planner_lock_ttl", True)):
        value = raw.get(key)
        seconds = None if value is None else as_seconds(value)
        if value is not None and (
            seconds is None
            or seconds < 0
            or (strict and not 0 < seconds <= MAX_LIMIT)
            or math.isnan(seconds)
        ):
            bound = f"> 0 (at most {MAX_LIMIT})" if strict else ">= 0"
            problems.append(f"{key} must be seconds {bound} or a timedelta")
    problem = validation.weights_problem(raw.get("tenant_weights"))
    return [*problems, problem] if problem else problems


def parse_plan(raw: Mapping[str, Any]) -> Plan:
    """Validate ``raw`` and fill in the ``FAIR_JOBS_PLANNER_*`` defaults."""
    problems = plan_errors(raw)
    if problems:
        raise PlanError("; ".join(problems))

    def given(key: str, default: Any) -> Any:
        # A key left out, or given as None, takes the FAIR_JOBS_PLANNER_* default.
        value = raw.get(key)
        return default if value is None else value

    weights = given("tenant_weights", fair_settings.PLANNER_TENANT_WEIGHTS)
    threshold = given("latency_threshold", fair_settings.PLANNER_LATENCY_THRESHOLD)
    return Plan(
        enqueue_interval=float(
            as_seconds(given("enqueue_interval", DEFAULT_ENQUEUE_INTERVAL)) or 0
        ),
        enqueue_jobs=int(raw["enqueue_jobs"]),
        tenant_weights=None if weights is None else validation.weights_callable(weights),
        latency_threshold=float(as_seconds(threshold) or 0),
        planner_queue=str(given("planner_queue", fair_settings.PLANNER_QUEUE)),
        planner_lock_ttl=float(
            as_seconds(given("planner_lock_ttl", fair_settings.PLANNER_LOCK_TTL)) or 0
        ),
    )

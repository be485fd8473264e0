"""Mechanism B, sliding-window rerouting: a tenant that enqueued more than ``threshold``
jobs of a task within the last ``per`` seconds has its next ones published to a slower
queue, and comes back by itself once its rate falls.

A task declares its rules as ``fair_reroute``::

    fair_reroute = [
        {"queue": "imports_slow", "threshold": 1000, "per": 86400},
        {"queue": "imports_slower", "threshold": 40, "per": 3600, "max_jobs": 2},
    ]

Each enqueue is counted once, at publish (:meth:`FairTask.apply_async`, so ``delay()``,
signatures and canvas too), in one statement that also picks the rule: the LAST rule whose
count is above its threshold wins. A job published by name (``send_task``) is counted when
a worker first receives it and, if a rule matches, re-published to the rule's queue.

Not counted and never rerouted: a job published to a queue other than the task's declared
one, a job without a tenant, and any re-publish of a counted job (a retry, a woken parked
job), which carries the :data:`~django_fair_jobs.headers.WINDOW` of its first count.

Exactness: counts are exact to the whole second of the database clock, like the original
(each rule counts the enqueues of ``[now - per, now]``, both ends included), and exact under
concurrency (the tenant's row lock serializes enqueues). See :class:`TenantWindow`.
"""

from __future__ import annotations

import logging
import math
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from numbers import Real
from typing import TYPE_CHECKING, Any

from django_fair_jobs import decisions, messages, routing
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.conf import MAX_LIMIT, fair_settings
from django_fair_jobs.errors import (
    RuleError as RuleError,
)
from django_fair_jobs.reroute import store as reroute_store
from django_fair_jobs.reroute.types import Deciding
from django_fair_jobs.routing import declared_queue, queue_name
from django_fair_jobs.tenants import for_log

if TYPE_CHECKING:
    from celery import Task

logger = logging.getLogger("django_fair_jobs.reroute")

RULE_KEYS = frozenset({"queue", "threshold", "per", "max_jobs"})
"""The keys a rule may have; ``queue`` and ``threshold`` are required."""

SCOPES = ("task", "queue")
"""Counting scopes besides ``"group:<name>"``."""


@dataclass(frozen=True)
class Rule:
    """One validated rerouting rule."""

    queue: str
    threshold: int
    per: int
    """Window length in whole seconds."""
    max_jobs: int | None = None
    """If set, the tenant's slot limit for the jobs this rule reroutes."""


def _whole(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= MAX_LIMIT


def _shown(value: Any) -> str:
    # Error messages quote what they got, cut short: a 10 KB value must not fill a log.
    return reprlib.repr(value)


def _seconds(value: Any) -> float | None:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    return float(value)


def rule_errors(raw: Any, max_window: int) -> list[str]:
    """Everything wrong with a ``fair_reroute`` value, one message each."""
    if raw is None:
        return []
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
        return ["fair_reroute must be a list of rules (dicts)"]
    errors: list[str] = []
    for number, rule in enumerate(raw, start=1):
        where = f"rule {number}"
        if not isinstance(rule, Mapping):
            errors.append(f"{where} is {_shown(rule)}, not a dict")
            continue
        # str() shows a key as written; a key too long to read is cut.
        unknown = sorted(str(k) if len(str(k)) <= 40 else _shown(k) for k in set(rule) - RULE_KEYS)
        if unknown:
            errors.append(
                f"{where} has unknown keys {', '.join(unknown)} "
                f"(allowed: {', '.join(sorted(RULE_KEYS))})"
            )
        queue = rule.get("queue")
        if not isinstance(queue, str) or not queue.strip():
            errors.append(f"{where}: queue must be a queue name (got {_shown(queue)})")
        elif len(queue) > 255 or "\x00" in queue:
            errors.append(
                f"{where}: queue must be a queue name of at most 255 characters without "
                f"NUL (got {_shown(queue)})"
            )
        threshold = rule.get("threshold")
        if not _whole(threshold, 1):
            errors.append(
                f"{where}: threshold must be a whole number from 1 to {MAX_LIMIT}, the jobs "
                f"allowed in the window before rerouting (got {_shown(threshold)})"
            )
        if "per" in rule:
            per = _seconds(rule["per"])
            # NaN and infinities first: int() of them raises.
            if per is None or not math.isfinite(per) or not (per > 0 and per == int(per)):
                errors.append(
                    f"{where}: per must be a whole number of seconds > 0 or a timedelta "
                    f"(got {_shown(rule['per'])})"
                )
            elif int(per) > max_window:
                errors.append(
                    f"{where}: per is {int(per)} s, above FAIR_JOBS_REROUTE_MAX_WINDOW "
                    f"({max_window} s), so older enqueues would already be pruned; raise "
                    "the setting or shorten the window"
                )
        max_jobs = rule.get("max_jobs")
        if max_jobs is not None and not _whole(max_jobs, 1):
            errors.append(
                f"{where}: max_jobs must be a whole number from 1 to {MAX_LIMIT} "
                f"(got {_shown(max_jobs)})"
            )
    return errors


def parse_rules(raw: Any, max_window: int) -> tuple[Rule, ...]:
    """Validate ``fair_reroute`` and return its rules; raise :class:`RuleError`."""
    errors = rule_errors(raw, max_window)
    if errors:
        raise RuleError("; ".join(errors))
    rules = []
    for rule in raw or ():
        per = _seconds(rule.get("per", max_window))
        assert per is not None  # rule_errors checked it
        rules.append(Rule(rule["queue"], rule["threshold"], int(per), rule.get("max_jobs")))
    return tuple(rules)


def scope_error(scope: Any) -> str | None:
    """Why ``scope`` is not a counting scope, or None if it is one."""
    if scope in SCOPES:
        return None
    if isinstance(scope, str) and scope.startswith("group:") and scope[6:].strip():
        return None
    return f'must be "task", "queue" or "group:<name>" (got {scope!r})'


def counting_key(task: Task[Any, Any], declared_queue: str) -> str:
    """The key a task's enqueues are counted under: its name, its declared queue, or the
    named group (``fair_reroute_scope``, else ``FAIR_JOBS_REROUTE_SCOPE``)."""
    scope = getattr(task, "fair_reroute_scope", None) or fair_settings.REROUTE_SCOPE
    problem = scope_error(scope)
    if problem:
        raise RuleError(f"{task.name}: fair_reroute_scope {problem}")
    if scope == "task":
        return f"task:{task.name}"
    if scope == "queue":
        return f"queue:{declared_queue}"
    return str(scope)


@dataclass(frozen=True)
class Decision:
    """What counting one enqueue decided."""

    counts: tuple[int, ...]
    rule: Rule | None
    index: int | None

    def header(self) -> dict[str, Any]:
        """The :data:`~django_fair_jobs.headers.WINDOW` value that marks the job as counted."""
        return {"counts": list(self.counts), "rule": self.index}


def count(
    task: Task[Any, Any],
    tenant: str,
    queue: str,
    rules: Sequence[Rule],
    task_id: str | None = None,
) -> Decision:
    """Record one enqueue of ``tenant`` for ``task`` (declared on ``queue``) and pick the
    rule that reroutes it, in one statement; with ``task_id``, that statement also
    records the reroute's decision (see :func:`apply`). Logs each reroute at debug level."""

    recorded = reroute_store.record(
        key=counting_key(task, queue),
        tenant=tenant,
        task_name=task.name,
        rules=[(rule.per, rule.threshold, rule.queue) for rule in rules],
        deciding=None if task_id is None else Deciding(task_id, queue, decisions.enforcing()),
    )
    index = recorded.rule
    rule = None if index is None else rules[index]
    if rule is not None:
        logger.debug(
            "Rerouted a %s job of tenant %s to %s: %s enqueues in %s s, above %s (rule %s)",
            task.name,
            for_log(tenant),
            rule.queue,
            recorded.counts[index],  # type: ignore[index]
            rule.per,
            rule.threshold,
            index + 1,  # type: ignore[operator]
        )
    return Decision(recorded.counts, rule, index)


def should_count(
    task: Task[Any, Any], headers: Mapping[str, Any], queue: Any, args: Any, kwargs: Any
) -> str | None:
    """The declared queue if this publish is to be counted, else None: it is not when the
    job was counted before (a re-publish) or is sent to another queue than the declared
    one (a caller's choice, which is never second-guessed)."""
    if fair_headers.WINDOW in headers:
        return None
    declared = declared_queue(task, args, kwargs)
    if queue is not None and queue_name(queue) != declared:
        return None
    return declared


def apply(
    decision: Decision,
    options: dict[str, Any],
    headers: dict[str, Any],
) -> None:
    """Mark the job as counted and, if a rule matched, send it to the rule's queue (in
    shadow mode it stays on its declared queue). The reroute's decision row was stored by
    :func:`count`, in the statement that counted the job."""

    headers[fair_headers.WINDOW] = decision.header()
    rule = decision.rule
    if rule is None or not decisions.enforcing():
        return
    options["queue"] = rule.queue
    # A caller's routing key or exchange would send it elsewhere than the rule's queue.
    options.pop("routing_key", None)
    options.pop("exchange", None)
    if rule.max_jobs is not None:
        headers[fair_headers.MAX_JOBS] = rule.max_jobs


def prune() -> int:
    """Delete the window rows of tenants idle for longer than the maximum window; run by
    the workers' maintenance pass, so no scheduled job is needed."""

    return reroute_store.prune(max_window=fair_settings.REROUTE_MAX_WINDOW)


def windows_by_key(app: Any = None) -> dict[str, list[int]]:
    """For each counting key in use by the app's fair tasks, the window lengths (``per``)
    its rules count over; the admin shows a tenant's count for each."""
    from celery import current_app

    found: dict[str, set[int]] = {}
    max_window = fair_settings.REROUTE_MAX_WINDOW
    task: Any
    for task in (app or current_app).tasks.values():
        if not messages.is_fair(task):
            continue
        try:
            rules = task.fair_rules()
            key = counting_key(task, declared_queue(task, (), {})) if rules else ""
        except (RuleError, ValueError):
            continue  # reported by the system checks
        if rules:
            found.setdefault(key, set()).update(min(rule.per, max_window) for rule in rules)
    return {key: sorted(pers) for key, pers in found.items()}


def count_delivered(task: Any, tenant: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Count a job that was published without ``FairTask.apply_async`` (``send_task`` by
    name) when it is first delivered; True if a rule re-published it elsewhere.

    A redelivery is not counted again. Jobs that went through ``apply_async`` carry the
    window header and are left alone.
    """
    request = task.request
    if fair_headers.is_redelivered(request):
        return False
    headers = request.headers if request.headers is not None else {}
    queue = should_count(task, headers, routing.request_queue(task), args, kwargs)
    if queue is None:
        return False
    decision = count(task, tenant, queue, task.fair_rules(), str(request.id))
    options: dict[str, Any] = {}
    marks: dict[str, Any] = {fair_headers.TENANT: tenant}
    apply(decision, options, marks)
    if "queue" not in options:
        # It stays: a retry or a park of this run is built from these headers.
        request.headers = {**headers, **marks}
        return False
    task.signature_from_request(
        request, args, kwargs, queue=options["queue"], headers={**headers, **marks}
    ).apply_async()
    return True

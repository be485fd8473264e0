"""System checks: a bad ``FAIR_JOBS_*`` setting fails ``manage.py check`` and start-up.

Ids are stable (``fair_jobs.E001`` to ``E024``, ``W001`` to ``W004``, ``W006``): the Reference
page lists each with what it means and how to fix it. ``W006`` is a fair task with no way
to find its jobs' tenant (no ``fair_tenant()``, resolver or default tenant).

The task checks read the tasks of the current Celery app after importing its task modules,
as a worker does at start-up (``autodiscover_tasks()``, ``imports``, ``include``): the app
is the one the project's package imports (``from .celery import app as celery_app`` in
``proj/__init__.py``, as Celery's Django guide sets it up).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from django_fair_jobs import tenants
from django_fair_jobs.conf import (
    MAX_LIMIT,
    MAX_SLOT_HANDOFF,
    ON_LIMIT_CHOICES,
    PREFIX,
    SETTING_NAMES,
    fair_settings,
    is_limit,
)
from django_fair_jobs.dispatch import option_errors as dispatch_option_errors
from django_fair_jobs.errors import TenantError
from django_fair_jobs.planner import plan_errors
from django_fair_jobs.reroute import rule_errors, scope_error
from django_fair_jobs.routing import queue_name
from django_fair_jobs.task import TASK_OPTIONS, FairTask
from django_fair_jobs.validation import weights_problem

logger = logging.getLogger("django_fair_jobs.checks")


def _number(value: Any, minimum: float, strict: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, Real):
        return False
    number = float(value)
    if not math.isfinite(number):
        return False  # NaN compares false to everything; an infinite wait never ends
    return number > minimum if strict else number >= minimum


def _tenant(value: Any) -> bool:
    """A value a job's tenant can be: text that is not blank and can be stored."""
    try:
        return isinstance(value, str) and tenants.normalize_tenant(value) is not None
    except TenantError:
        return False


def _queue_limits(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(queue, str) and queue and is_limit(limit) for queue, limit in value.items()
    )


_RULES: list[tuple[str, str, Callable[[Any], bool], str]] = [
    (
        "DEFAULT_MAX_JOBS",
        "fair_jobs.E001",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_LIMIT,
        f"a whole number from 1 to {MAX_LIMIT} (to pause a tenant, set its slot's max_jobs to 0)",
    ),
    ("ON_LIMIT", "fair_jobs.E002", lambda v: v in ON_LIMIT_CHOICES, '"park" or "retry"'),
    ("RETRY_COUNTDOWN", "fair_jobs.E003", lambda v: _number(v, 0, False), "a number >= 0"),
    ("WORKER_TIMEOUT", "fair_jobs.E004", lambda v: _number(v, 0, True), "a number > 0"),
    ("HEARTBEAT_INTERVAL", "fair_jobs.E005", lambda v: _number(v, 0, True), "a number > 0"),
    ("TENANT_WARNING_INTERVAL", "fair_jobs.E007", lambda v: _number(v, 0, False), "a number >= 0"),
    (
        "REROUTE_MAX_WINDOW",
        "fair_jobs.E009",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_LIMIT,
        f"a whole number of seconds from 1 to {MAX_LIMIT} (default 86400)",
    ),
    (
        "QUEUE_LIMITS",
        "fair_jobs.E013",
        lambda v: _queue_limits(v),
        f"a dict of queue names to whole numbers from 0 to {MAX_LIMIT} (0 pauses), "
        f'e.g. {{"webhooks": 2}}',
    ),
    (
        "QUEUE_LIMITS_PER_WORKER",
        "fair_jobs.E013",
        lambda v: _queue_limits(v),
        f"a dict of queue names to whole numbers from 0 to {MAX_LIMIT} (0 pauses), "
        f'e.g. {{"webhooks": 1}}',
    ),
    ("LIMIT_PLAIN_TASKS", "fair_jobs.E014", lambda v: isinstance(v, bool), "True or False"),
    ("ENFORCE", "fair_jobs.E017", lambda v: isinstance(v, bool), "True or False (False: shadow)"),
    (
        "DECISION_RETENTION",
        "fair_jobs.E017",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 3600,
        "a whole number of seconds >= 3600 (default 86400)",
    ),
    (
        "DASHBOARD_REFRESH",
        "fair_jobs.E017",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "a whole number of seconds >= 0 (0: no reload)",
    ),
    ("PLANNER_LATENCY_THRESHOLD", "fair_jobs.E016", lambda v: _number(v, 0, False), "seconds >= 0"),
    ("PLANNER_LOCK_TTL", "fair_jobs.E016", lambda v: _number(v, 0, True), "seconds > 0"),
    (
        "PLANNER_THREADS",
        "fair_jobs.E016",
        lambda v: isinstance(v, bool),
        "True or False (False: planners run only from the django_fair_jobs.plan task)",
    ),
    (
        "PREPARED_STATEMENTS",
        "fair_jobs.E021",
        lambda v: isinstance(v, bool),
        "True or False (False: behind PgBouncer before 1.22, or without max_prepared_statements)",
    ),
    (
        "SLOT_HANDOFF",
        "fair_jobs.E022",
        lambda v: _number(v, 0, False) and v <= MAX_SLOT_HANDOFF,
        f"a number of seconds from 0 (off) to {MAX_SLOT_HANDOFF:g}, e.g. 0.5",
    ),
    (
        "ASYNC_RELEASE",
        "fair_jobs.E023",
        lambda v: isinstance(v, bool),
        "True or False (True: slot releases commit without waiting for the disk)",
    ),
    ("PLANNER_QUEUE", "fair_jobs.E016", lambda v: isinstance(v, str) and bool(v), "a queue name"),
    (
        "DEFAULT_TENANT",
        "fair_jobs.E024",
        lambda v: v is None or _tenant(v),
        "None or a tenant: a non-blank string of at most 255 characters, without NUL",
    ),
    (
        "PLANNER_TENANT_WEIGHTS",
        "fair_jobs.E016",
        lambda v: (
            v is None
            or not plan_errors({"enqueue_interval": 1, "enqueue_jobs": 1, "tenant_weights": v})
        ),
        "None, a callable or the dotted path of one",
    ),
    (
        "METRICS_TENANTS",
        "fair_jobs.E017",
        is_limit,
        "a whole number of tenants >= 0 (default 1000; 0: no per-tenant gauges)",
    ),
    (
        "METRICS_TENANT_CLASS",
        "fair_jobs.E017",
        lambda v: v is None or weights_problem(v) is None,
        "None, a callable or the dotted path of one (tenant -> class)",
    ),
    (
        "DISPATCH_SLACK",
        "fair_jobs.E019",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1000,
        "a whole number of messages per worker node from 0 to 1000 (default 1)",
    ),
    ("DISPATCH_LOST_AFTER", "fair_jobs.E019", lambda v: _number(v, 0, True), "seconds > 0"),
    (
        "DISPATCH_CARRY_WAIT",
        "fair_jobs.E019",
        lambda v: _number(v, 0, False) and v <= 1,
        "seconds from 0 to 1 (0: a dispatched job's end is not kept for the next start)",
    ),
    (
        "DISPATCH_ASYNC_COMMIT",
        "fair_jobs.E019",
        lambda v: isinstance(v, bool),
        "True or False (False: a dispatched job's start and end wait for the disk)",
    ),
    (
        "DISPATCH_POLL_INTERVAL",
        "fair_jobs.E019",
        lambda v: _number(v, 0, False),
        "seconds >= 0 (0: countdowns come due at maintenance only)",
    ),
    (
        "REROUTE_SCOPE",
        "fair_jobs.E010",
        lambda v: scope_error(v) is None,
        '"task", "queue" or "group:<name>"',
    ),
]


@checks.register("fair_jobs")
def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Validate every ``FAIR_JOBS_*`` setting; see the module docstring for the ids."""
    errors: list[checks.CheckMessage] = []
    values: dict[str, Any] = {}
    for name, error_id, valid, expected in _RULES:
        try:
            value = getattr(fair_settings, name)
        except (ImproperlyConfigured, ValueError) as exc:
            errors.append(
                checks.Error(
                    f"The environment variable {PREFIX}{name} cannot be parsed: {exc}",
                    hint=f"Set {PREFIX}{name} to {expected}, or unset it.",
                    id="fair_jobs.E008",
                )
            )
            continue
        if not valid(value):
            errors.append(
                checks.Error(
                    f"{PREFIX}{name} is {value!r}.",
                    hint=f"Set {PREFIX}{name} to {expected}.",
                    id=error_id,
                )
            )
        else:
            values[name] = value
    errors.extend(_tenant_resolver_errors())
    interval, timeout = values.get("HEARTBEAT_INTERVAL"), values.get("WORKER_TIMEOUT")
    if interval is not None and timeout is not None and interval * 2 > timeout:
        errors.append(
            checks.Error(
                f"{PREFIX}HEARTBEAT_INTERVAL ({interval}) is more than half of "
                f"{PREFIX}WORKER_TIMEOUT ({timeout}): one late beat would get a live worker "
                "reaped.",
                hint="Keep the interval at most half the timeout (defaults: 10 and 60).",
                id="fair_jobs.E006",
            )
        )
    return errors


def _tenant_resolver_errors() -> list[checks.CheckMessage]:
    """``fair_jobs.E020``: the resolver is imported as a publish would, and the error says
    what failed (the import, the callable, its signature), not only the value."""
    problem = tenants.resolver_problem(fair_settings.TENANT_RESOLVER)
    if problem is None:
        return []
    return [checks.Error(problem, hint=tenants.RESOLVER_FIX, id="fair_jobs.E020")]


def _known_queues(app: Any) -> set[str]:
    """Every queue the Celery configuration names: a worker may consume these."""
    conf = app.conf
    known = {str(conf.task_default_queue)}
    known.update(queue_name(q) for q in conf.task_queues or ())
    routes = conf.task_routes or ()
    for route in [routes] if isinstance(routes, dict) else list(routes):
        if isinstance(route, dict):
            for target in route.values():
                if isinstance(target, dict) and target.get("queue"):
                    known.add(queue_name(target["queue"]))
    for task in app.tasks.values():
        if getattr(task, "queue", None):
            known.add(queue_name(task.queue))
    return known


@checks.register("fair_jobs")
def check_task_rules(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Validate the ``fair_*`` options of every fair task of the current Celery app, once
    its task modules are imported."""
    from celery import current_app

    messages: list[checks.CheckMessage] = []
    problem = _import_task_modules(current_app)
    if problem is not None:
        messages.append(
            checks.Error(
                f"The Celery app's task modules cannot be imported: {problem}",
                hint="Fix the error above: a worker of this app could not start either.",
                id="fair_jobs.E018",
            )
        )
    try:
        max_window = int(fair_settings.REROUTE_MAX_WINDOW)
    except (ImproperlyConfigured, ValueError, TypeError):
        return messages  # reported by check_settings
    known: set[str] | None = None
    finds_tenant = bool(fair_settings.TENANT_RESOLVER or fair_settings.DEFAULT_TENANT)
    for task in fair_tasks(current_app):
        messages += _option_errors(task, max_window)
        if not finds_tenant and vars(FairTask)["fair_tenant"] is _own_fair_tenant(task):
            messages.append(_no_tenant_warning(task))
        raw = task.fair_reroute
        if not raw or rule_errors(raw, max_window):
            continue
        known = _known_queues(current_app) if known is None else known
        messages += _unknown_queue_warnings(task, raw, known)
    return messages


def _option_errors(task: Any, max_window: int) -> list[checks.CheckMessage]:
    """The errors of one fair task's ``fair_*`` options (E011, E015, E019, E012)."""
    found: list[checks.CheckMessage] = []
    raw = task.fair_reroute
    for problem in rule_errors(raw, max_window):
        found.append(
            checks.Error(
                f"Task {task.name}: {problem}.",
                hint='Each rule is {"queue": str, "threshold": int >= 1, "per": seconds '
                'or timedelta (optional, default the maximum window), "max_jobs": int '
                "(optional)}.",
                id="fair_jobs.E011",
            )
        )
    for problem in plan_errors(task.fair_plan):
        found.append(
            checks.Error(
                f"Task {task.name}: fair_plan: {problem}.",
                hint='fair_plan = {"enqueue_interval": seconds, "enqueue_jobs": N} plus '
                "optional tenant_weights, latency_threshold, planner_queue, "
                "planner_lock_ttl.",
                id="fair_jobs.E015",
            )
        )
    for problem in dispatch_option_errors(getattr(task, "fair_dispatch", None)):
        found.append(
            checks.Error(
                f"Task {task.name}: {problem}.",
                hint='fair_dispatch = True, or {"tenant_weights": callable or dotted path}.',
                id="fair_jobs.E019",
            )
        )
    scope = task.fair_reroute_scope
    if scope is not None and scope_error(scope):
        found.append(
            checks.Error(
                f"Task {task.name}: fair_reroute_scope {scope_error(scope)}.",
                hint="Leave it unset to use FAIR_JOBS_REROUTE_SCOPE.",
                id="fair_jobs.E012",
            )
        )
    return found


def _unknown_queue_warnings(task: Any, raw: Any, known: set[str]) -> list[checks.CheckMessage]:
    """W001 for each of ``task``'s valid rules whose queue no routing setting names."""
    found: list[checks.CheckMessage] = []
    for rule in raw:
        if rule["queue"] not in known:
            found.append(
                checks.Warning(
                    f"Task {task.name}: rule queue {rule['queue']!r} is not named in "
                    "task_queues, task_routes, task_default_queue or any task's queue, "
                    "so perhaps no worker consumes it.",
                    hint=f"Start workers with -Q including {rule['queue']} and add it to "
                    "CELERY_TASK_QUEUES, or silence fair_jobs.W001.",
                    id="fair_jobs.W001",
                )
            )
    return found


_importing = False
"""True while :func:`_import_task_modules` runs: importing the task modules makes Celery's
Django integration run the system checks again, which must not import them again."""


def _own_fair_tenant(task: Any) -> Any:
    """The ``fair_tenant`` the class of ``task`` defines or inherits (the classmethod
    object itself, so that FairTask's own is told from an override)."""
    return next(vars(k)["fair_tenant"] for k in type(task).__mro__ if "fair_tenant" in vars(k))


def _no_tenant_warning(task: Any) -> checks.CheckMessage:
    """W006: ``task`` defines no ``fair_tenant()``, and neither a resolver nor a default
    tenant is set, so its jobs have a tenant only when each publish passes one."""
    return checks.Warning(
        f"Task {task.name} has no way to find its jobs' tenant: it defines no fair_tenant(), "
        "and neither FAIR_JOBS_TENANT_RESOLVER nor FAIR_JOBS_DEFAULT_TENANT is set. A job "
        "published without fair_tenant= has no tenant: under fair dispatch it waits in the "
        "one line of its queue's jobs without a tenant; it takes no tenant slot and no "
        "tenant's cap limits it.",
        hint="Define fair_tenant() on the task's class, set FAIR_JOBS_TENANT_RESOLVER or "
        "FAIR_JOBS_DEFAULT_TENANT, or silence fair_jobs.W006 if every publish passes "
        "fair_tenant=.",
        id="fair_jobs.W006",
    )


def _import_task_modules(app: Any) -> str | None:
    """Import the app's task modules as a worker does at start-up; the error, if any."""
    global _importing
    if _importing:
        return None
    _importing = True
    try:
        app.loader.import_default_modules()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        _importing = False
    return None


def fair_tasks(app: Any) -> list[Any]:
    """The app's registered :class:`~django_fair_jobs.task.FairTask` instances, by name."""
    return sorted((t for t in app.tasks.values() if isinstance(t, FairTask)), key=lambda t: t.name)


def _closest(name: str, known: Sequence[str]) -> str:
    """The known name closest to ``name``, or the list of them."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    if not match:
        return f"the known ones are {', '.join(known)}."
    return f"did you mean {match[0]}?"


@checks.register("fair_jobs")
def check_unknown_names(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Warn about ``FAIR_JOBS_*`` settings and ``fair_*`` task options that the library does
    not know (a typo would otherwise be silently ignored)."""
    from celery import current_app

    _import_task_modules(current_app)  # an import error is check_task_rules' E018
    messages = _setting_name_warnings()
    for task in fair_tasks(current_app):
        messages += _option_name_warnings(task)
    return messages


def _setting_name_warnings() -> list[checks.CheckMessage]:
    """W002 for a ``FAIR_JOBS_*`` name that is no setting."""
    from django.conf import settings

    known = [PREFIX + name for name in SETTING_NAMES]
    sources = [("setting", name) for name in dir(settings) if name.startswith(PREFIX)] + [
        ("environment variable", name) for name in os.environ if name.startswith(PREFIX)
    ]
    return [
        checks.Warning(
            f"The {source} {name} is not a django-fair-jobs setting; {_closest(name, known)}",
            hint="Rename it, or remove it (the settings are listed in the docs' Reference page).",
            id="fair_jobs.W002",
        )
        for source, name in sorted(set(sources))
        if name not in known
    ]


def _option_name_warnings(task: Any) -> list[checks.CheckMessage]:
    """W003 for a ``fair_*`` attribute of ``task`` that is no option."""
    messages: list[checks.CheckMessage] = []
    for klass in type(task).__mro__:
        if klass is FairTask:
            break
        for name in sorted(vars(klass)):
            if name.startswith("fair_") and name not in TASK_OPTIONS:
                messages.append(
                    checks.Warning(
                        f"Task {task.name}: {name} is not a FairTask option; "
                        f"{_closest(name, TASK_OPTIONS)}",
                        hint="Rename it; an unknown fair_* option is ignored.",
                        id="fair_jobs.W003",
                    )
                )
    return messages


def _celery_closes_every_connection() -> bool:
    # Celery 5.6 and later close every connection around each job unless
    # CELERY_DB_REUSE_MAX is set; 5.5 only closed those past CONN_MAX_AGE.
    import celery

    return tuple(celery.VERSION[:2]) >= (5, 6)


@checks.register("fair_jobs")
def check_worker_connections(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Warn when Celery's Django integration would close the library's database connection
    around every job: each job would open a new connection, which costs more than the
    library's own statements."""
    from celery import current_app
    from celery.fixups.django import DjangoFixup
    from django.db import connections, router

    from django_fair_jobs.models import TenantQueueSlot

    if not any(isinstance(f, DjangoFixup) for f in getattr(current_app, "_fixups", ())):
        return []  # not a Django-integrated Celery app: nothing closes connections per job
    alias = router.db_for_write(TenantQueueSlot)
    database = connections[alias].settings_dict
    if database["ENGINE"] == "django.db.backends.sqlite3":
        return []  # opening a SQLite file costs next to nothing
    causes = []
    if _celery_closes_every_connection() and not current_app.conf.get("CELERY_DB_REUSE_MAX"):
        causes.append(
            "CELERY_DB_REUSE_MAX is not set, so Celery closes it before and after each job"
        )
    if database.get("CONN_MAX_AGE", 0) == 0:
        causes.append(f'DATABASES["{alias}"]["CONN_MAX_AGE"] is 0, so it is closed after each job')
    if not causes:
        return []
    return [
        checks.Warning(
            "Celery workers open a new database connection for every job: "
            + "; ".join(causes)
            + ".",
            hint=(
                'Set CELERY_DB_REUSE_MAX = 1000, DATABASES["' + alias + '"]["CONN_MAX_AGE"] = '
                '600 and CONN_HEALTH_CHECKS = True (see the how-to "Keep worker connections '
                'open"), or silence fair_jobs.W004.'
            ),
            id="fair_jobs.W004",
        )
    ]


def fail_fast_on_bad_settings() -> None:
    """Stop a Celery worker at start-up when a ``FAIR_JOBS_*`` setting is invalid; log the
    warnings that concern workers (connections closed per job, shadow mode).

    Celery runs Django's checks but does not stop on them; a worker with, say, a heartbeat
    interval above the timeout would get live workers reaped. ``SystemExit`` is used
    because Celery's signal dispatch logs and swallows ordinary exceptions.
    """
    import sys

    errors = [e for e in [*check_settings(), *check_task_rules()] if e.is_serious()]
    if errors:
        for error in errors:
            print(f"{error.id}: {error.msg} HINT: {error.hint}", file=sys.stderr)
        raise SystemExit("django-fair-jobs: invalid settings; the worker will not start.")
    # Celery runs the checks at start-up too, but shows nothing; these concern the worker.
    for warning in check_worker_connections():
        logger.warning("%s: %s HINT: %s", warning.id, warning.msg, warning.hint)
    if not fair_settings.ENFORCE:
        logger.warning(
            "Shadow mode (FAIR_JOBS_ENFORCE = False): this worker evaluates and records every "
            "rule but defers, parks, reroutes and holds nothing."
        )

"""Typed, lazily read settings for django-fair-jobs.

Every setting is read at access time, in this order: the Django setting
``FAIR_JOBS_<NAME>``, then the environment variable of the same name (parsed with
django-environ), then the default below. Reading at access time, never at import time,
keeps ``override_settings`` working in tests. What the Django settings hold is remembered
until Django's ``setting_changed`` signal (``override_settings``, pytest-django's
``settings``) says otherwise, as Django REST framework's settings do: a job reads several
settings, and looking a missing one up in ``django.conf.settings`` costs an exception each
time. Nothing here writes to ``django.conf.settings``. Validation lives in
:mod:`django_fair_jobs.checks`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal, TypeGuard, TypeVar

import environ
from django.conf import settings as django_settings
from django.core.signals import setting_changed

T = TypeVar("T")

PREFIX = "FAIR_JOBS_"
OnLimit = Literal["park", "retry"]
ON_LIMIT_CHOICES: tuple[str, ...] = ("park", "retry")

MAX_LIMIT = 2_147_483_647
"""The largest limit, threshold or window (seconds) an option or setting may hold: the
largest value of the integer columns the limits are stored in, so that no value that
passes validation can fail in the database later, in a worker."""


def is_limit(value: Any) -> TypeGuard[int]:
    """True if ``value`` can be stored as a limit: a whole number (not a bool) from 0 to
    :data:`MAX_LIMIT`. The one check of tenant limits, queue limits and their settings."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LIMIT


MAX_SLOT_HANDOFF = 5.0
"""The most seconds ``FAIR_JOBS_SLOT_HANDOFF`` may keep a finished job's slot: past that, a
slot held for no running job looks stuck to an operator."""

_env = environ.Env()


def _json_object(raw: str) -> dict[str, Any]:
    """Parse an environment value like ``{"webhooks": 2}`` (JSON)."""
    import json

    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def _boolean(raw: str) -> bool:
    """Parse an environment value the way django-environ does (true/1/yes/on), except that
    an empty value is an error: ``FAIR_JOBS_ENFORCE=`` is more likely a template left blank
    than a request for shadow mode."""
    lowered = raw.lower()
    if lowered in ("true", "1", "yes", "on", "y", "t"):
        return True
    if lowered in ("false", "0", "no", "off", "n", "f"):
        return False
    raise ValueError("expected true or false")


# Named for the error message of Settings._get ("... is not a valid JSON object").
_json_object.__name__ = "JSON object"
_boolean.__name__ = "boolean"


_UNSET = object()
_django_values: dict[str, Any] = {}
"""``FAIR_JOBS_*`` Django settings read so far: the value, or :data:`_UNSET`."""
_django_values_of: list[object] = [None]
"""The settings object (``django.conf.settings._wrapped``) they were read from:
``override_settings`` and pytest-django's ``settings`` put another in its place, even
where they send no ``setting_changed`` (pytest-django's ``del settings.X``)."""


def _django_value(key: str) -> Any:
    """The Django setting ``key``, or :data:`_UNSET`; remembered until a setting changes."""
    wrapped = django_settings._wrapped  # type: ignore[misc]  # the stubs type it as a Settings
    if wrapped is not _django_values_of[0]:
        _django_values.clear()
        _django_values_of[0] = wrapped
    try:
        return _django_values[key]
    except KeyError:
        value = getattr(django_settings, key, _UNSET)
        _django_values[key] = value
        return value


def _forget_django_values(**kwargs: Any) -> None:
    """Django's ``setting_changed`` receiver: read the Django settings afresh."""
    _django_values.clear()


setting_changed.connect(_forget_django_values, dispatch_uid="django_fair_jobs.conf")


class Settings:
    """The library's settings, each a property with its type and default.

    Use the module-level :data:`fair_settings` instance.
    """

    def is_set(self, name: str) -> bool:
        """Whether ``FAIR_JOBS_<name>`` is set, in the Django settings or the environment,
        rather than left to its default."""
        key = PREFIX + name
        return hasattr(django_settings, key) or key in os.environ

    def _get(self, name: str, default: T, parse: Callable[[str], Any]) -> Any:
        key = PREFIX + name
        value = _django_value(key)
        if value is not _UNSET:
            return value
        if key in os.environ:
            # django-environ reads the raw string; the conversion is strict (its own int()
            # and float() drop stray characters, so "1e3" would silently become 13).
            raw = _env.str(key)
            try:
                return parse(raw.strip())
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not a valid {parse.__name__}") from None
        return default

    @property
    def DEFAULT_MAX_JOBS(self) -> int:
        """Jobs one tenant may run at once on one queue, when neither the tenant's slot row
        nor the task (``fair_max_jobs``) says otherwise. Default 1. Setting it also keeps a
        ``FairTask`` without options on tenant slots rather than fair dispatch
        (:meth:`~django_fair_jobs.task.FairTask.fair_dispatching`)."""
        value: int = self._get("DEFAULT_MAX_JOBS", 1, int)
        return value

    @property
    def ON_LIMIT(self) -> str:
        """What a job does when its tenant is at its limit: ``"park"`` (stored in the
        database and re-published as soon as a slot frees) or ``"retry"`` (re-published with
        a jittered countdown). Tasks override it with ``fair_on_limit``. Default ``"park"``."""
        value: str = self._get("ON_LIMIT", "park", str)
        return value

    @property
    def RETRY_COUNTDOWN(self) -> float:
        """Base countdown in seconds for ``fair_on_limit = "retry"``; the actual countdown is
        drawn uniformly from 0.5x to 1.5x of it. Tasks override it with
        ``fair_retry_countdown``. Default 60."""
        value: float = self._get("RETRY_COUNTDOWN", 60.0, float)
        return value

    @property
    def WORKER_TIMEOUT(self) -> float:
        """Seconds without a heartbeat after which a worker process is presumed dead and its
        slots are reaped. Default 60."""
        value: float = self._get("WORKER_TIMEOUT", 60.0, float)
        return value

    @property
    def HEARTBEAT_INTERVAL(self) -> float:
        """Seconds between a worker process's heartbeats; maintenance (reaping dead workers,
        sweeping missed wake-ups) runs at the same pace. At most half of ``WORKER_TIMEOUT``.
        Default 10."""
        value: float = self._get("HEARTBEAT_INTERVAL", 10.0, float)
        return value

    @property
    def TENANT_WARNING_INTERVAL(self) -> float:
        """Minimum seconds between two "job has no tenant" warnings for the same task, so a
        flood of tenant-less jobs does not flood the log. Default 60."""
        value: float = self._get("TENANT_WARNING_INTERVAL", 60.0, float)
        return value

    @property
    def TENANT_RESOLVER(self) -> Any:
        """A callable or its dotted path, called at publish as
        ``resolver(task, args, kwargs)`` when neither ``fair_tenant=`` nor the task's
        ``fair_tenant()`` gives the job a tenant, and returning its tenant or None: a tenant
        from the publisher's context (a contextvar set by middleware, the django-tenants
        schema: ``"django_fair_jobs.tenants.schema_name"``). Default None."""
        return self._get("TENANT_RESOLVER", None, str)

    @property
    def REROUTE_MAX_WINDOW(self) -> int:
        """Longest rerouting window in seconds: a rule's ``per`` may not exceed it, a rule
        without ``per`` uses it, and enqueue counts older than it are pruned (with the rows
        of tenants idle that long). Default 86,400 (one day). Was
        ``MAX_THROTTLING_WINDOW``."""
        value: int = self._get("REROUTE_MAX_WINDOW", 86_400, int)
        return value

    @property
    def REROUTE_SCOPE(self) -> str:
        """What rerouting counts a tenant's enqueues under, for tasks that do not set
        ``fair_reroute_scope``: ``"task"`` (each task apart), ``"queue"`` (all tasks of the
        task's declared queue together) or ``"group:<name>"`` (all tasks naming that
        group). Default ``"task"``. Was ``WINDOW_SCOPE``."""
        value: str = self._get("REROUTE_SCOPE", "task", str)
        return value

    @property
    def QUEUE_LIMITS(self) -> dict[str, int]:
        """Jobs at most running at once per queue across the cluster, e.g.
        ``{"webhooks": 2}``; 0 pauses the queue. Seeds the stored limits of queues that have
        none (runtime changes in the admin or ``fair_jobs_limit`` win). Default ``{}``."""
        value: dict[str, int] = self._get("QUEUE_LIMITS", {}, _json_object)
        return value

    @property
    def QUEUE_LIMITS_PER_WORKER(self) -> dict[str, int]:
        """Jobs at most running at once per queue on one worker node (a ``celery worker``
        instance, whatever its pool and concurrency), e.g. ``{"webhooks": 1}``: the
        ``max_jobs_per_worker`` of the queue's row, ``--per-worker`` of ``fair_jobs_limit``.
        Seeds like ``QUEUE_LIMITS``. Default ``{}``. Was ``QUEUE_PROCESS_LIMITS``."""
        value: dict[str, int] = self._get("QUEUE_LIMITS_PER_WORKER", {}, _json_object)
        return value

    @property
    def PLANNER_TENANT_WEIGHTS(self) -> Any:
        """Default ``tenant_weights`` of a ``fair_plan``: a callable or its dotted path,
        given the tenant ids with jobs due and returning ``{tenant: weight}``. Default None:
        every tenant weighs 1."""
        return self._get("PLANNER_TENANT_WEIGHTS", None, str)

    @property
    def PLANNER_LATENCY_THRESHOLD(self) -> float:
        """Default ``latency_threshold`` (seconds) of a ``fair_plan``: a run promotes nothing
        while the oldest promoted, not yet started job is older than this. Default 60."""
        value: float = self._get("PLANNER_LATENCY_THRESHOLD", 60.0, float)
        return value

    @property
    def METRICS_TENANTS(self) -> int:
        """Most tenants the exporter gives per-tenant gauges (``fair_jobs_tenant_*``), the
        busiest first; ``fair_jobs_tenants_omitted`` counts the rest. Default 1000."""
        value: int = self._get("METRICS_TENANTS", 1000, int)
        return value

    @property
    def METRICS_TENANT_CLASS(self) -> Any:
        """A callable or its dotted path, given a job's tenant (or None) and returning its
        class for the wait histogram's ``tenant_class`` label: a tier or a plan, from a
        small set. Default None: every job is in class ``"all"``."""
        return self._get("METRICS_TENANT_CLASS", None, str)

    @property
    def PLANNER_QUEUE(self) -> str:
        """Default ``planner_queue`` of a ``fair_plan``: the queue of the
        ``django_fair_jobs.plan`` task, for projects that run planners from Celery beat.
        Default ``"default"``."""
        value: str = self._get("PLANNER_QUEUE", "default", str)
        return value

    @property
    def PLANNER_THREADS(self) -> bool:
        """False: worker processes start no planner thread, and the planners run only when
        the ``django_fair_jobs.plan`` task runs (scheduled by Celery beat or
        django-celery-beat). Default True."""
        value: bool = self._get("PLANNER_THREADS", True, _boolean)
        return value

    @property
    def PREPARED_STATEMENTS(self) -> bool:
        """True: on PostgreSQL with psycopg 3, the library's statements are prepared on
        each connection (planned once). Set False behind a transaction pooler that does
        not keep prepared statements (PgBouncer before 1.22, or without
        ``max_prepared_statements``). Default True."""
        value: bool = self._get("PREPARED_STATEMENTS", True, _boolean)
        return value

    @property
    def SLOT_HANDOFF(self) -> float:
        """Seconds a worker process keeps the tenant slot of a job that ended well, to hand
        it to the next job it starts of the same tenant and queue in one statement instead
        of a release and an acquire (PostgreSQL). Meanwhile the slot shows held. 0 turns
        it off. Default 0."""
        value: float = self._get("SLOT_HANDOFF", 0.0, float)
        return value

    @property
    def ASYNC_RELEASE(self) -> bool:
        """True: a tenant slot's release commits without waiting for its WAL flush
        (``synchronous_commit = off`` for that statement alone, PostgreSQL). A crash of the
        database server can then lose the last releases; each process re-sends its
        unconfirmed ones at its next maintenance pass. Default False."""
        value: bool = self._get("ASYNC_RELEASE", False, _boolean)
        return value

    @property
    def PLANNER_LOCK_TTL(self) -> float:
        """Default ``planner_lock_ttl`` (seconds) of a ``fair_plan``: a planner run holds its
        task's lock at most this long. Default 60."""
        value: float = self._get("PLANNER_LOCK_TTL", 60.0, float)
        return value

    @property
    def DEFAULT_TENANT(self) -> str | None:
        """The tenant of a job whose tenant resolves to None (no ``fair_tenant=`` option,
        nothing from ``fair_tenant()`` or the resolver), under every mechanism. Default
        None: such a job has no tenant (under fair dispatch it waits in the one line of
        jobs without a tenant; a planned one in its task's virtual queue of the jobs without
        a tenant, the tenant ``""``)."""
        value: str | None = self._get("DEFAULT_TENANT", None, str)
        return value

    @property
    def DISPATCH_SLACK(self) -> int:
        """Messages fair dispatch may publish to a queue beyond its capacity, per live worker
        node that consumes it: a process that frees finds its next job already delivered,
        at the cost of that many jobs ahead of a newcomer's. Default 1."""
        value: int = self._get("DISPATCH_SLACK", 1, int)
        return value

    @property
    def DISPATCH_CARRY_WAIT(self) -> float:
        """Seconds the end of a dispatched job waits, in its worker process, for the start
        of that process's next job to carry it: one round trip and one commit for both. No
        start within the wait: the process's flusher thread ends it alone. Until its end,
        the job counts in flight. Default 0.015; 0 ends every job at once."""
        value: float = self._get("DISPATCH_CARRY_WAIT", 0.015, float)
        return value

    @property
    def DISPATCH_LOST_AFTER(self) -> float:
        """Seconds a dispatched job may stay published and not started before maintenance
        publishes it again (its message may be lost: a purged queue, a publisher that
        died); a copy that arrives twice runs once. Default 60."""
        value: float = self._get("DISPATCH_LOST_AFTER", 60.0, float)
        return value

    @property
    def DISPATCH_ASYNC_COMMIT(self) -> bool:
        """True: a dispatched job's start and its flushed end commit without waiting for
        their WAL flush (``synchronous_commit = off`` for that statement alone,
        PostgreSQL), so the job's path has no disk wait. Each worker process confirms its
        own at its next heartbeat, with one commit that waits, and makes again what a crash
        of the database server lost; until then such a crash can run a job twice (see the
        deployment how-to). Default False: every commit waits."""
        value: bool = self._get("DISPATCH_ASYNC_COMMIT", False, _boolean)
        return value

    @property
    def DISPATCH_POLL_INTERVAL(self) -> float:
        """Seconds between two looks, by one process of each worker node, for countdowns
        and ETAs of its queues that came due, so that a job with a countdown runs on time
        on an idle queue (on a busy one, the next job's end dispatches it sooner), and for
        jobs waiting while their queue has room (an end that freed the room while an
        enqueue was committing could not see its job). 0: only maintenance looks, every
        ``FAIR_JOBS_HEARTBEAT_INTERVAL``. Default 1."""
        value: float = self._get("DISPATCH_POLL_INTERVAL", 1.0, float)
        return value

    @property
    def LIMIT_PLAIN_TASKS(self) -> bool:
        """True: queue limits also apply to tasks that are not ``FairTask``, by a hook the
        worker installs at start-up (no change to the tasks). Default False: only
        ``FairTask`` jobs are limited and counted."""
        value: bool = self._get("LIMIT_PLAIN_TASKS", False, _boolean)
        return value

    @property
    def ENFORCE(self) -> bool:
        """False: shadow mode. Every rule is evaluated and what it would have done (defer,
        reroute, hold in a virtual queue) is recorded as a :class:`JobDecision` for explain,
        the dashboard and the metrics, but no job is deferred, parked, rerouted or held.
        Default True."""
        value: bool = self._get("ENFORCE", True, _boolean)
        return value

    @property
    def DECISION_RETENTION(self) -> int:
        """Seconds a recorded decision (a reroute, or a shadow-mode decision) is kept for
        explain, the dashboard and the metrics; the maintenance pass prunes older ones.
        Default 86,400 (one day)."""
        value: int = self._get("DECISION_RETENTION", 86_400, int)
        return value

    @property
    def DASHBOARD_REFRESH(self) -> int:
        """Seconds between two reloads of the admin dashboard page; 0 turns reloading off.
        Default 10."""
        value: int = self._get("DASHBOARD_REFRESH", 10, int)
        return value


RECOMMENDED_SQLITE_OPTIONS: dict[str, Any] = {
    "transaction_mode": "IMMEDIATE",
    "timeout": 30,
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}
"""``DATABASES[...]["OPTIONS"]`` for SQLite (development and demos).

WAL, so that readers never block the writer and heartbeats land on time; ``IMMEDIATE``
transactions, so that concurrent writers queue for the lock instead of failing to upgrade it.
"""

fair_settings = Settings()
"""The settings object used everywhere in the library."""

SETTING_NAMES: tuple[str, ...] = tuple(
    name for name, value in vars(Settings).items() if isinstance(value, property)
)
"""Names (without prefix) of every setting, for checks and docs."""

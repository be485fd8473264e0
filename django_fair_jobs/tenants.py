"""Tenant identity: normalization, validation, the rate-limited "no tenant" warning, and
the tenant of a job at publish (``fair_tenant=``, ``fair_tenant()``, then
``FAIR_JOBS_TENANT_RESOLVER``), with the resolver for django-tenants (:func:`schema_name`)."""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_fair_jobs import headers as fair_headers
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.errors import (
    TenantError as TenantError,
)

logger = logging.getLogger("django_fair_jobs.tenants")

TENANT_MAX_LENGTH = 255
"""Longest tenant value accepted; longer values are an error at enqueue."""

LOG_MAX_LENGTH = 100
"""Longest tenant text in a log line or a metrics label: a longer tenant is shown as its
first 91 characters, ``~`` and the first 8 hex digits of its SHA-256 (see
:func:`shorten`)."""


def normalize_tenant(value: Any) -> str | None:
    """Return the tenant as stored: a string, or None for "no tenant".

    ``None`` and empty (or all-whitespace) strings mean no tenant. Other values are
    converted with ``str()`` (ints, UUIDs) and kept exactly, surrounding spaces included.
    :class:`TenantError` is raised for values that cannot be stored: bytes (decode them
    first: ``str(b"x")`` would be ``"b'x'"``), text longer than 255 characters, text
    holding a NUL character (PostgreSQL text cannot store one), and text that is not
    valid Unicode (a lone surrogate).
    """
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        raise TenantError(
            f"Tenant value is {type(value).__name__}, not text. Decode it (or return an id) "
            "from fair_tenant(), or pass a str as fair_tenant=."
        )
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        return None
    if len(text) > TENANT_MAX_LENGTH:
        raise TenantError(
            f"Tenant value is {len(text)} characters long; the limit is {TENANT_MAX_LENGTH}. "
            "Use a shorter identifier (an id or a hash) as the tenant."
        )
    if "\x00" in text:
        raise TenantError(
            f"Tenant value {for_log(text)} holds a NUL character (\\x00), which the database "
            "cannot store. Return an identifier without control characters."
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise TenantError(
            f"Tenant value {for_log(text)} is not valid Unicode (a lone surrogate). Return "
            "an identifier that encodes as UTF-8."
        ) from None
    return text


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def shorten(text: str, limit: int = LOG_MAX_LENGTH) -> str:
    """``text`` itself up to ``limit`` characters; a longer one as its first ``limit - 9``
    characters, ``~`` and the first 8 hex digits of its SHA-256, so that two long values
    that share a prefix stay apart. The metrics' tenant labels use it."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 9]}~{_digest(text)}"


def for_log(value: Any) -> str:
    """A tenant as every log line of the library shows it: quoted, with newlines and other
    control characters escaped as ``repr`` does (so a tenant cannot forge a log line), and
    at most :data:`LOG_MAX_LENGTH` characters between the quotes: a longer one is cut like
    :func:`shorten` does, with the same digest of the tenant as its metrics label.
    ``None`` is shown as ``None``."""
    if value is None:
        return "None"
    text = value if isinstance(value, str) else str(value)
    # Escaping a 10 KB tenant whole would be wasted work: a prefix is all that is shown.
    escaped = repr(text[: LOG_MAX_LENGTH + 1])[1:-1]
    if len(text) <= LOG_MAX_LENGTH and len(escaped) <= LOG_MAX_LENGTH:
        return f"'{escaped}'"
    return f"'{escaped[: LOG_MAX_LENGTH - 9]}~{_digest(text)}'"


_last_warned: dict[str, float] = {}
_warn_lock = threading.Lock()


def _due(key: str) -> bool:
    """True (and remember now) if ``key`` was not logged within the warning interval."""
    now = time.monotonic()
    with _warn_lock:
        last = _last_warned.get(key)
        if last is not None and now - last < fair_settings.TENANT_WARNING_INTERVAL:
            return False
        _last_warned[key] = now
    return True


UNRESOLVED: dict[str, str] = {
    "ran": "ran without a tenant, so without tenant fairness",
    "published": "was published without a tenant, so it is not counted or rerouted by its rules",
    "dispatched": "was published without a tenant: it waits in the one line of the jobs "
    "without a tenant, which takes its turn beside the tenants' lines under no tenant's cap",
    "planned": "was published without a tenant: it waits in the virtual queue of the jobs "
    "without a tenant, which the planner promotes as one more tenant",
}
"""What a job without a tenant does, by where it was seen: run, published under rerouting
rules, held by fair dispatch, or held by the planner."""


def warn_missing_tenant(task_name: str, kind: str = "ran") -> bool:
    """Log that a ``task_name`` job had no tenant where ``kind`` says (a key of
    :data:`UNRESOLVED`), at most once per ``FAIR_JOBS_TENANT_WARNING_INTERVAL`` seconds
    per task and kind. Returns True if logged."""
    if not _due(task_name if kind == "ran" else f"{task_name} {kind}"):
        return False
    logger.warning(
        "Task %s %s. Pass fair_tenant= when publishing it, define fair_tenant() on the "
        "task class, set FAIR_JOBS_TENANT_RESOLVER or set FAIR_JOBS_DEFAULT_TENANT. "
        "(Logged at most once every %s s per task.)",
        task_name,
        UNRESOLVED[kind],
        fair_settings.TENANT_WARNING_INTERVAL,
    )
    return True


def worker_tenant(value: Any, task_name: str) -> str | None:
    """The tenant of a job being run, from its header or ``fair_tenant()``: like
    :func:`normalize_tenant`, but a value it refuses (which only a job published by name,
    with ``send_task``, can carry: ``apply_async`` refuses it at publish) is logged as an
    error, at most once per ``FAIR_JOBS_TENANT_WARNING_INTERVAL`` per task, and the job
    runs without a tenant: failing it would lose it."""
    try:
        return normalize_tenant(value)
    except TenantError as exc:
        if _due(f"{task_name} invalid"):
            logger.error(
                "Task %s: a job's tenant cannot be used (%s); it runs without tenant "
                "fairness. (Logged at most once every %s s per task.)",
                task_name,
                exc,
                fair_settings.TENANT_WARNING_INTERVAL,
            )
        return None


def request_tenant(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The tenant of the job ``task`` runs now: its ``fair_tenant`` header (or request
    attribute), else, for a job published without ``FairTask.apply_async`` (``send_task``
    by name), ``task.fair_tenant(*args, **kwargs)``; checked as a worker checks it."""
    headers = task.request.headers or {}
    if fair_headers.TENANT in headers:
        return worker_tenant(headers[fair_headers.TENANT], task.name)
    value = getattr(task.request, fair_headers.TENANT, None)
    if value is not None:
        return worker_tenant(value, task.name)
    return worker_tenant(task.fair_tenant(*args, **kwargs), task.name) or default_tenant()


Resolver = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
"""A ``FAIR_JOBS_TENANT_RESOLVER``: ``resolver(task, args, kwargs)`` -> a tenant or None."""

RESOLVER_FIX = (
    "Set FAIR_JOBS_TENANT_RESOLVER to the dotted path of a callable "
    "resolver(task, args, kwargs) that returns a tenant or None (for django-tenants: "
    '"django_fair_jobs.tenants.schema_name"), or remove the setting.'
)
"""How to fix a bad ``FAIR_JOBS_TENANT_RESOLVER``: the hint of check ``fair_jobs.E020``."""

_resolver: tuple[Any, Resolver] | None = None


def load_resolver(spec: Any) -> Resolver:
    """``spec`` (a callable or its dotted path) as a resolver; raises
    ``ImproperlyConfigured`` saying what is wrong when it does not import, is not callable
    or cannot be called as ``resolver(task, args, kwargs)``."""
    name = f"FAIR_JOBS_TENANT_RESOLVER = {spec!r}"
    try:
        target = import_string(spec) if isinstance(spec, str) else spec
    except ImportError as exc:
        raise ImproperlyConfigured(f"{name} cannot be imported: {exc}.") from None
    if not callable(target):
        raise ImproperlyConfigured(f"{name} is not callable.")
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return target  # type: ignore[no-any-return]  # a builtin without a signature
    try:
        signature.bind(None, (), {})
    except TypeError:
        raise ImproperlyConfigured(
            f"{name} takes {signature}; it is called as resolver(task, args, kwargs)."
        ) from None
    return target  # type: ignore[no-any-return]


def resolver_problem(spec: Any) -> str | None:
    """What is wrong with ``FAIR_JOBS_TENANT_RESOLVER`` = ``spec`` (None: nothing, or it is
    not set)."""
    if spec is None:
        return None
    try:
        load_resolver(spec)
    except ImproperlyConfigured as exc:
        return str(exc)
    return None


def resolver() -> Resolver | None:
    """The ``FAIR_JOBS_TENANT_RESOLVER`` callable, or None when it is not set. Imported
    once per value of the setting; a bad value raises ``ImproperlyConfigured`` (check
    ``fair_jobs.E020`` reports it at start-up)."""
    global _resolver
    spec = fair_settings.TENANT_RESOLVER
    if spec is None:
        return None
    cached = _resolver
    # != rather than "is not": a dotted path read from the environment is a new string at
    # every read, and would import the callable again at every publish.
    if cached is None or cached[0] != spec:
        cached = _resolver = (spec, load_resolver(spec))
    return cached[1]


def publish_tenant(task: Any, args: Any, kwargs: Any, explicit: Any = None) -> str | None:
    """The tenant a job is published with, normalized (:func:`normalize_tenant`): the
    ``fair_tenant=`` option when one is given (``""`` publishes without a tenant), else
    ``task.fair_tenant(*args, **kwargs)``, else, when that gives none,
    ``FAIR_JOBS_TENANT_RESOLVER(task, args, kwargs)``, else ``FAIR_JOBS_DEFAULT_TENANT``.
    It runs in the publisher, where the
    context the resolver reads is; the tenant then travels in the job's header."""
    if explicit is not None:
        return normalize_tenant(explicit)
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    tenant = normalize_tenant(task.fair_tenant(*args, **kwargs))
    if tenant is not None:
        return tenant
    resolve = resolver()
    if resolve is None:
        return default_tenant()
    try:
        return normalize_tenant(resolve(task, args, kwargs)) or default_tenant()
    except TenantError as exc:
        raise TenantError(
            f"FAIR_JOBS_TENANT_RESOLVER gave {task.name} a bad tenant: {exc}"
        ) from None


def default_tenant() -> str | None:
    """``FAIR_JOBS_DEFAULT_TENANT``, normalized: the tenant of a job whose tenant resolves
    to None (an explicit ``fair_tenant=""`` still publishes without one)."""
    return normalize_tenant(fair_settings.DEFAULT_TENANT)


def schema_name(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """A ``FAIR_JOBS_TENANT_RESOLVER`` for django-tenants: the schema the publisher's
    default database connection is set to (``connection.schema_name``, set by
    django-tenants' middleware for a request, by ``tenant_context()`` or
    ``schema_context()``, and by tenant-schemas-celery for a job), or None in the public
    schema (``PUBLIC_SCHEMA_NAME``) or on a database without schemas."""
    from django.db import connection

    schema = getattr(connection, "schema_name", None)
    if not schema or schema == getattr(django_settings, "PUBLIC_SCHEMA_NAME", "public"):
        return None
    return str(schema)


SCHEMA_HEADER = "_schema_name"
"""The header tenant-schemas-celery's worker reads a job's schema from."""


def with_schema_header(app: Any, headers: dict[str, Any]) -> dict[str, Any]:
    """``headers`` with tenant-schemas-celery's schema header when ``app`` is its
    ``CeleryApp``: the schema this publish runs in, unless the headers carry one already.

    Its ``send_task`` adds the header when a message goes to the broker; a job that waits
    in a row (dispatched, planned) goes there later, from a worker process in whatever
    schema that process is in, so the header must be taken now, at the first publish, and
    stored with the job."""
    # Only where the project imported it: this module never imports tenant-schemas-celery.
    module = sys.modules.get("tenant_schemas_celery.app")
    if module is None or not isinstance(app, module.CeleryApp) or SCHEMA_HEADER in headers:
        return headers
    from django.db import connection

    return {**headers, SCHEMA_HEADER: getattr(connection, "schema_name", None)}

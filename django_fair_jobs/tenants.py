"""Tenant identity: normalization, validation, and the rate-limited "no tenant" warning."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

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

HEADER = fair_headers.TENANT
"""The old name of :data:`django_fair_jobs.headers.TENANT`."""


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
            "Return a shorter identifier (an id or a hash) from fair_tenant()."
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


def warn_missing_tenant(task_name: str, *, published: bool = False) -> bool:
    """Log that a ``task_name`` job ran (or, with ``published``, was published) without a
    tenant, at most once per ``FAIR_JOBS_TENANT_WARNING_INTERVAL`` seconds per task and
    kind. Returns True if logged."""
    if not _due(f"{task_name} published" if published else task_name):
        return False
    what = (
        "was published without a tenant, so it is not counted or rerouted by its rules"
        if published
        else "ran without a tenant, so without tenant fairness"
    )
    logger.warning(
        "Task %s %s. Pass fair_tenant= when publishing it or define fair_tenant() on the "
        "task class. (Logged at most once every %s s per task.)",
        task_name,
        what,
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
    return worker_tenant(task.fair_tenant(*args, **kwargs), task.name)

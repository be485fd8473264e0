"""Tenant identity: normalization, validation, and the rate-limited "no tenant" warning."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django_fair_jobs.conf import fair_settings

logger = logging.getLogger("django_fair_jobs.tenants")

TENANT_MAX_LENGTH = 255
"""Longest tenant value accepted; longer values are an error at enqueue."""

HEADER = "fair_tenant"
"""Message header that carries an explicit tenant (``fair_tenant=`` at publish)."""


class TenantError(ValueError):
    """A tenant value that cannot be stored; raised at enqueue, never in the worker."""


def normalize_tenant(value: Any) -> str | None:
    """Return the tenant as stored: a string, or None for "no tenant".

    ``None`` and empty (or all-whitespace) strings mean no tenant. Other values are
    converted with ``str()`` (ints, UUIDs). Values longer than 255 characters raise
    :class:`TenantError`.
    """
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        return None
    if len(text) > TENANT_MAX_LENGTH:
        raise TenantError(
            f"Tenant value is {len(text)} characters long; the limit is {TENANT_MAX_LENGTH}. "
            "Return a shorter identifier (an id or a hash) from fair_tenant()."
        )
    return text


_last_warned: dict[str, float] = {}
_warn_lock = threading.Lock()


def warn_missing_tenant(task_name: str, *, published: bool = False) -> bool:
    """Log that a ``task_name`` job ran (or, with ``published``, was published) without a
    tenant, at most once per ``FAIR_JOBS_TENANT_WARNING_INTERVAL`` seconds per task and
    kind. Returns True if logged."""
    now = time.monotonic()
    key = f"{task_name} published" if published else task_name
    with _warn_lock:
        last = _last_warned.get(key)
        if last is not None and now - last < fair_settings.TENANT_WARNING_INTERVAL:
            return False
        _last_warned[key] = now
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

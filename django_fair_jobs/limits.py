"""The old name of :mod:`django_fair_jobs.queue_limits`, kept for one release.

``limits`` held queue limits only (tenant limits live in :mod:`django_fair_jobs.slots`), so
the room is named for what it holds. Every name of the new module is still reachable here,
with a :class:`DeprecationWarning` that names the new path. Nothing in the package imports
this module; see the changelog.
"""

from __future__ import annotations

import warnings
from typing import Any

from django_fair_jobs import queue_limits as _new


def __getattr__(name: str) -> Any:
    """Forward ``name`` to :mod:`django_fair_jobs.queue_limits`, with a warning."""
    value = getattr(_new, name)
    warnings.warn(
        f"django_fair_jobs.limits.{name} moved to django_fair_jobs.queue_limits.{name}; "
        "the old path goes away in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return value

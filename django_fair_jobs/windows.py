"""The old name of :mod:`django_fair_jobs.reroute`, kept for one release.

The room reroutes a tenant's jobs to another queue; its sliding windows are how it counts,
so it is named for what it does. Every name of the new module is still reachable here, with
a :class:`DeprecationWarning` that names the new path. Nothing in the package imports this
module; see the changelog.
"""

from __future__ import annotations

import warnings
from typing import Any

from django_fair_jobs import reroute as _new


def __getattr__(name: str) -> Any:
    """Forward ``name`` to :mod:`django_fair_jobs.reroute`, with a warning."""
    value = getattr(_new, name)
    warnings.warn(
        f"django_fair_jobs.windows.{name} moved to django_fair_jobs.reroute.{name}; "
        "the old path goes away in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return value

"""The old home of the worker processes' heartbeat and maintenance, kept for one release.

They moved to :mod:`django_fair_jobs.maintenance` (the threads, the pass and its pacing),
and the process and node identities to :mod:`django_fair_jobs.identity`. Every name is
still reachable here, with a :class:`DeprecationWarning` that names the new path. Nothing in
the package imports this module; see the changelog.
"""

from __future__ import annotations

import warnings
from typing import Any

from django_fair_jobs import identity as _identity
from django_fair_jobs import maintenance as _maintenance
from django_fair_jobs.maintenance import passes as _passes
from django_fair_jobs.maintenance import threads as _threads

_IDENTITY = {
    "consumed_queues",
    "current_node_id",
    "current_process_id",
    "registered_process_id",
    "set_concurrency",
    "start_node",
    "when_gone",
}


def __getattr__(name: str) -> Any:
    """Forward ``name`` to its new home, with a warning."""
    if name in _IDENTITY:
        home = _identity
    else:
        home = next(
            (module for module in (_maintenance, _passes, _threads) if hasattr(module, name)),
            _maintenance,
        )
    value = getattr(home, name)
    warnings.warn(
        f"django_fair_jobs.workers.{name} moved to {home.__name__}.{name}; "
        "the old path goes away in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return value

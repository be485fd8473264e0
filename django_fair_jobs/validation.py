"""Checks of option values shared by more than one mechanism (layer 0: imports no other
module of the package)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from django.utils.module_loading import import_string

MIN_WEIGHT = 1e-6
"""Smallest weight above 0 a tenant is given; a smaller one is raised to it."""

MAX_WEIGHT = 1e6
"""Largest weight a tenant is given; a larger one is lowered to it. Between the two,
passes (sums of ``1 / weight``) stay far from where floating point would stop adding a
small weight's step to them, which would let one tenant take every turn."""

MAX_TASK_ID = 255
"""Longest task id the library stores (the size of the task id columns of leases,
planned jobs and dispatched jobs)."""

TenantWeights = Callable[[list[str]], Mapping[str, Any]]
"""A ``tenant_weights`` callable: tenant ids in, ``{tenant: weight}`` out."""


def weights_callable(spec: Any) -> TenantWeights:
    """``spec`` (a callable or the dotted path of one) as a ``tenant_weights`` callable.

    Raises ImportError if the path does not import, TypeError if it is not callable."""
    target = import_string(spec) if isinstance(spec, str) else spec
    if not callable(target):
        raise TypeError("must be a callable or the dotted path of one")
    return target  # type: ignore[no-any-return]


def weights_problem(spec: Any) -> str | None:
    """What is wrong with a ``tenant_weights`` option (None: nothing, or not given)."""
    if spec is None:
        return None
    try:
        weights_callable(spec)
    except (ImportError, TypeError) as exc:
        return f"tenant_weights {exc}"
    return None


def task_id_problem(task_id: Any) -> str | None:
    """What is wrong with a job's task id for the library (None: nothing, or none given):
    a database column of :data:`MAX_TASK_ID` characters holds it."""
    if task_id is None or len(str(task_id)) <= MAX_TASK_ID:
        return None
    return (
        f"the task id is {len(str(task_id))} characters long; fair tasks store it in "
        f"{MAX_TASK_ID}, so pass a task id of at most {MAX_TASK_ID} characters (for an "
        "idempotency key longer than that, a hash of it)"
    )

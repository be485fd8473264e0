"""django-fair-jobs: make Celery fair between tenants, with PostgreSQL rows as the only
coordination state.

``FairTask`` and ``explain`` are imported lazily so that ``import django_fair_jobs`` works
before Django's app registry is ready (for example in a project's ``celery.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_fair_jobs.explanations import Explanation, explain
    from django_fair_jobs.task import FairTask

__all__ = ["Explanation", "FairTask", "explain"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "FairTask":
        from django_fair_jobs.task import FairTask

        return FairTask
    if name in ("explain", "Explanation"):
        from django_fair_jobs import explanations

        return getattr(explanations, name)
    raise AttributeError(f"module 'django_fair_jobs' has no attribute {name!r}")

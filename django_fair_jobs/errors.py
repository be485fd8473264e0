"""Exceptions the library raises to its callers (layer 0: imports nothing of the package).

The other exceptions still live beside the mechanism that raises them and move here with
the layout in ARCHITECTURE.md; new ones start here."""

from __future__ import annotations


class TaskIdError(ValueError):
    """A task id the library cannot store: longer than
    :data:`~django_fair_jobs.validation.MAX_TASK_ID` characters (a lease, a planned job
    and a dispatched job keep the id in a column of that size). Raised at publish, and in
    the worker for a job sent by name with such an id, which then fails instead of being
    postponed again and again."""

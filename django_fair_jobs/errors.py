"""Every exception the library raises to its callers (layer 0: imports nothing of the
package), so that any layer can raise one and a caller finds them all in one place."""

from __future__ import annotations

from kombu.exceptions import EncodeError


class TaskIdError(ValueError):
    """A task id the library cannot store: longer than
    :data:`~django_fair_jobs.validation.MAX_TASK_ID` characters (a lease, a planned job
    and a dispatched job keep the id in a column of that size). Raised at publish, and in
    the worker for a job sent by name with such an id, which then fails instead of being
    postponed again and again."""


class TenantError(ValueError):
    """A tenant value that cannot be stored; raised at enqueue, never in the worker."""


class FairTaskConfigError(ValueError):
    """A ``fair_*`` task option with a value that cannot work; raised when the task class
    is created (at import, so at worker start-up), never at the first job."""


class FairArgumentsError(EncodeError):
    """A job whose arguments kombu's JSON cannot store (an ``object()``, a ``set``, a
    model instance...), raised at publish before anything is counted or sent: a parked or
    planned job is stored as JSON, whatever the task's serializer, so such a job could
    not be kept. A kombu ``EncodeError``, as Celery's own JSON serializer raises."""


class TenantLimitError(ValueError):
    """A tenant limit or boost that cannot work; the message says how to fix it."""


class RuleError(ValueError):
    """A ``fair_reroute`` rule or a ``fair_reroute_scope`` that cannot work. System
    checks report it at start-up; publishing such a task raises it."""


class PlanError(ValueError):
    """A ``fair_plan`` that cannot work, raised when its planner runs (the job is stored at
    publish), or ``bulk_enqueue`` on a task that neither plans nor dispatches, raised at
    once. An invalid ``fair_plan`` is also system check E015, so a worker refuses to start
    with one."""


class PublishFailedError(Exception):
    """The result of a planned job that failed for good: its publish failed
    :data:`~django_fair_jobs.planner.PUBLISH_ATTEMPTS` times for a reason of its own (the
    message says which)."""


class LimitError(ValueError):
    """A queue limit that cannot be stored (not a whole number from 0 to 2147483647, or no
    queue name)."""


class DispatchError(ValueError):
    """A ``fair_dispatch`` option that cannot work, or a job that cannot wait in line (its
    arguments or options cannot be stored as JSON); raised at import or at publish."""


class NotMigratedError(RuntimeError):
    """The database lacks some of the library's migrations (its tables or functions are
    missing or out of date); the message names them and says to run ``manage.py migrate
    fair_jobs``. Raised at publish, by ``fair_jobs_status``, and at a worker's start-up,
    which it stops."""

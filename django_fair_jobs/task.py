"""``FairTask``: the Celery task base class that makes a task fair between tenants.

Thin glue: at publish it resolves the tenant (into the ``fair_tenant`` header) and lets
:mod:`django_fair_jobs.reroute` count the enqueue and pick the queue; in the worker it
wraps ``run()`` with a slot acquire and release from :mod:`django_fair_jobs.slots`, which
takes the tenant slot and, on a limited queue (:mod:`django_fair_jobs.queue_limits`), the
queue's place together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

from celery.contrib.django.task import DjangoTask

from django_fair_jobs import (
    admission,
    decisions,
    dispatch,
    planner,
    publishing,
    reroute,
    tenants,
)
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.conf import MAX_LIMIT, ON_LIMIT_CHOICES, fair_settings
from django_fair_jobs.errors import (
    FairArgumentsError as FairArgumentsError,
)
from django_fair_jobs.errors import (
    FairTaskConfigError as FairTaskConfigError,
)
from django_fair_jobs.errors import (
    TaskIdError as TaskIdError,
)
from django_fair_jobs.reroute import Rule, RuleError

MECHANISM_OPTIONS = (
    "fair_max_jobs",
    "fair_on_limit",
    "fair_retry_countdown",
    "fair_reroute",
    "fair_reroute_scope",
    "fair_plan",
)
"""Options that choose a mechanism other than fair dispatch: a task that sets one of them
(or ``fair_slots = False``) and not ``fair_dispatch`` is not dispatched
(:meth:`FairTask.fair_dispatching`)."""


def _validate_options(cls: type[FairTask]) -> None:
    name = getattr(cls, "name", None) or cls.__qualname__
    max_jobs = cls.fair_max_jobs
    if max_jobs is not None and (
        isinstance(max_jobs, bool)
        or not isinstance(max_jobs, int)
        or not 1 <= max_jobs <= MAX_LIMIT
    ):
        raise FairTaskConfigError(
            f"{name}: fair_max_jobs must be a whole number from 1 to {MAX_LIMIT} "
            f"(got {max_jobs!r}). "
            "To pause one tenant, set its slot's max_jobs to 0 in the admin."
        )
    on_limit = cls.fair_on_limit
    if on_limit is not None and on_limit not in ON_LIMIT_CHOICES:
        raise FairTaskConfigError(
            f"{name}: fair_on_limit must be one of {', '.join(ON_LIMIT_CHOICES)} "
            f"(got {on_limit!r})."
        )
    wanted = cls.fair_dispatch
    if wanted is not None and not isinstance(wanted, bool | Mapping):
        raise FairTaskConfigError(
            f"{name}: fair_dispatch must be True, False or a dict such as "
            f'{{"tenant_weights": "myapp.weights"}} (got {wanted!r}).'
        )
    if wanted and (cls.fair_plan or cls.fair_reroute):
        raise FairTaskConfigError(
            f"{name}: fair_dispatch replaces fair_plan and fair_reroute (it decides "
            "who runs next when a worker frees); use one or the other. Add fair_max_jobs to "
            "cap a tenant."
        )
    countdown = cls.fair_retry_countdown
    if countdown is not None and (
        isinstance(countdown, bool)
        or not isinstance(countdown, Real)
        or not 0 <= float(countdown) < math.inf
    ):
        raise FairTaskConfigError(
            f"{name}: fair_retry_countdown must be a number of seconds >= 0 (got {countdown!r})."
        )


class FairTask(DjangoTask):  # type: ignore[type-arg]
    """Base class for tasks whose jobs are limited per tenant and per queue.

    Subclass it, or pass ``base=FairTask`` to ``@shared_task``; every ``fair_*`` attribute
    may also be given as a ``@shared_task(...)`` keyword. It extends Celery's
    ``DjangoTask`` (the task class Celery's Django integration gives every task), so
    ``delay_on_commit()`` and ``apply_async_on_commit()`` publish, fairly, once the
    current transaction commits. Publishing works from async code too.
    """

    fair_jobs_task = True
    """Marks a ``FairTask`` for the layers below it
    (:func:`django_fair_jobs.messages.is_fair`), which do not import this class."""

    fair_max_jobs: int | None = None
    """Jobs of one tenant that may run at once on this task's queue. A tenant's slot row
    may override it in the admin. None: ``FAIR_JOBS_DEFAULT_MAX_JOBS``."""

    fair_on_limit: str | None = None
    """``"park"`` or ``"retry"``: what a job does when its tenant is at its limit.
    None: ``FAIR_JOBS_ON_LIMIT``."""

    fair_retry_countdown: float | None = None
    """Base countdown (seconds) of ``fair_on_limit = "retry"``, jittered by +-50%.
    None: ``FAIR_JOBS_RETRY_COUNTDOWN``."""

    fair_slots: bool = True
    """False: no tenant slots for this task (rerouting only). Jobs rerouted by a rule with
    ``max_jobs`` still take a slot, limited by that rule."""

    fair_reroute: Sequence[Mapping[str, Any]] | None = None
    """Rerouting rules, ``[{"queue": ..., "threshold": N, "per": seconds}, ...]``: a tenant
    with more than ``threshold`` enqueues of this task within ``per`` seconds has its next
    jobs published to ``queue`` (the last matching rule wins). See
    :mod:`django_fair_jobs.reroute`."""

    fair_plan: Mapping[str, Any] | None = None
    """The fair planner: ``{"enqueue_interval": seconds, "enqueue_jobs": N, "tenant_weights":
    callable or dotted path, "latency_threshold": seconds, "planner_queue": name,
    "planner_lock_ttl": seconds}``. Jobs wait in their tenant's virtual queue and are
    promoted in weighted rounds; see :mod:`django_fair_jobs.planner`."""

    fair_dispatch: bool | Mapping[str, Any] | None = None
    """Fair dispatch: ``True``, or ``{"tenant_weights": callable or dotted path}``. Jobs
    wait in their tenant's line in the database, and whenever a worker process of the
    queue frees, the next job goes to the tenant with the fewest jobs in flight per weight
    (then the lowest virtual time, then the oldest job). ``fair_max_jobs``, if set, caps
    each tenant. See :mod:`django_fair_jobs.dispatch`. None: the default of
    :meth:`fair_dispatching` (on for a task that sets no other option); False: off."""

    fair_reroute_scope: str | None = None
    """What the rules count under: ``"task"``, ``"queue"`` or ``"group:<name>"``.
    None: ``FAIR_JOBS_REROUTE_SCOPE``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Celery builds a class per decorated function with the decorator's keywords as
        # attributes, so this validates both subclasses and @shared_task(fair_...=...).
        super().__init_subclass__(**kwargs)
        _validate_options(cls)

    @classmethod
    def fair_tenant(cls, *args: Any, **kwargs: Any) -> Any:
        """Return the tenant of a job from the task's arguments (same signature as
        ``run``), or None. Override it; the default says "no tenant"."""
        return None

    def fair_limit(self) -> int:
        """The limit brought to a tenant's slot row that has no override: a rerouting
        rule's ``max_jobs`` for the jobs it rerouted, else the task's."""
        rule_limit = (self.request.headers or {}).get(fair_headers.MAX_JOBS)
        if rule_limit is not None:
            return int(rule_limit)
        return self.fair_max_jobs or fair_settings.DEFAULT_MAX_JOBS

    def fair_dispatching(self) -> bool | Mapping[str, Any]:
        """The ``fair_dispatch`` option in force.

        The task's own if it sets one. Otherwise fair dispatch is the default of a task
        that sets none of the options that choose another mechanism (``fair_max_jobs``,
        ``fair_on_limit``, ``fair_retry_countdown``, ``fair_slots = False``,
        ``fair_reroute``, ``fair_reroute_scope``, ``fair_plan``): such a task is fair
        without a cap that would run each tenant's jobs one at a time. Setting
        ``FAIR_JOBS_DEFAULT_MAX_JOBS`` keeps those tasks on tenant slots with that cap,
        as before fair dispatch was the default."""
        own = self.fair_dispatch
        if own is not None:
            return own
        if not self.fair_slots or any(getattr(self, name) for name in MECHANISM_OPTIONS):
            return False
        return not fair_settings.is_set("DEFAULT_MAX_JOBS")

    def fair_rules(self) -> tuple[Rule, ...]:
        """The validated ``fair_reroute`` rules; raises :class:`RuleError`."""
        raw = self.fair_reroute
        if not raw:
            return ()
        max_window = fair_settings.REROUTE_MAX_WINDOW
        cached = self.__dict__.get("_fair_rules")
        if cached is not None and cached[0] is raw and cached[1] == max_window:
            rules: tuple[Rule, ...] = cached[2]
            return rules
        try:
            rules = reroute.parse_rules(raw, max_window)
        except RuleError as exc:
            raise RuleError(f"{self.name}: {exc}") from None
        self.__dict__["_fair_rules"] = (raw, max_window, rules)
        return rules

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Publish the job with its tenant in the ``fair_tenant`` header, counted by the
        task's rerouting rules and sent to the queue they pick.

        An explicit ``fair_tenant=`` option wins over ``fair_tenant(*args, **kwargs)``; a
        re-publish (retry, wake-up) keeps the headers it already carries, so it is neither
        counted nor rerouted again. Invalid tenants raise
        :class:`~django_fair_jobs.tenants.TenantError` here, at enqueue, and arguments
        that cannot be stored as JSON raise :class:`FairArgumentsError`.

        Called from a thread that runs an event loop (an async view), the publish runs on
        a publisher thread, since it may use the database; the caller waits for it.
        """
        return publishing.off_event_loop(
            lambda: self._fair_apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        )

    def _fair_apply_async(
        self,
        args: Any,
        kwargs: Any,
        task_id: str | None,
        producer: Any,
        link: Any,
        link_error: Any,
        shadow: str | None,
        **options: Any,
    ) -> Any:
        prepared = publishing.prepare(
            self, args, kwargs, task_id, options, link=link, link_error=link_error
        )
        if prepared.held is not None:  # waiting in its tenant's line or virtual queue
            return prepared.held
        return super().apply_async(
            args, kwargs, prepared.task_id, producer, link, link_error, shadow,
            **prepared.options,
        )  # fmt: skip

    def bulk_enqueue(
        self, items: Iterable[tuple[Sequence[Any], Mapping[str, Any]]], **options: Any
    ) -> list[Any]:
        """Store many jobs of a planned task (``fair_plan``) in their tenants' virtual
        queues in one INSERT, or of a ``fair_dispatch`` task in their tenants' lines in one
        round trip: ``items`` are ``(args, kwargs)`` pairs, ``options`` apply to each (no
        ``task_id``). Returns their ``AsyncResult``s."""
        if not self.fair_plan and not self.fair_dispatching():
            raise planner.PlanError(f"{self.name}: bulk_enqueue needs fair_plan or fair_dispatch.")
        return publishing.off_event_loop(lambda: self._fair_bulk_enqueue(items, options))

    def _fair_bulk_enqueue(
        self, items: Iterable[tuple[Sequence[Any], Mapping[str, Any]]], options: dict[str, Any]
    ) -> list[Any]:
        dispatching = self.fair_dispatching()
        if dispatching and decisions.enforcing() and not self.app.conf.task_always_eager:
            if "task_id" in options:
                raise dispatch.DispatchError(
                    f"{self.name}: bulk_enqueue gives each job a task id of its own; remove "
                    "task_id= from its options (apply_async(task_id=...) publishes a job "
                    "with an id you choose)."
                )
            held = [self._fair_dispatch_item(tuple(a), dict(k), options) for a, k in items]
            return publishing.hold_many_for_dispatch(self, held)
        if not decisions.enforcing() or dispatching:
            # Shadow mode: nothing waits in a virtual queue or line; each job is published
            # (and its would-be hold recorded) as apply_async does. So is an eager call.
            return [self.apply_async(args, kwargs, **options) for args, kwargs in items]
        options["headers"] = tenants.with_schema_header(self.app, options.get("headers") or {})
        return planner.bulk_enqueue(
            self, lambda *a, **k: tenants.publish_tenant(self, a, k), items, options
        )

    def _fair_dispatch_item(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any]
    ) -> tuple[str | None, tuple[Any, ...], dict[str, Any], dict[str, Any]]:
        """One job of a dispatched ``bulk_enqueue``, as ``apply_async`` would hold it:
        checked arguments, its tenant (``fair_tenant=`` or the classmethod) in its header."""
        publishing.check_arguments(self, args, kwargs)
        item = dict(options)
        headers = dict(item.get("headers") or {})
        headers.pop(fair_headers.DISPATCH, None)
        tenant = tenants.publish_tenant(self, args, kwargs, item.pop("fair_tenant", None))
        headers[fair_headers.TENANT] = tenant
        item["headers"] = tenants.with_schema_header(self.app, headers)
        return tenant, args, kwargs, item

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the job inside what it holds (its tenant's slot, its queue's place, its
        dispatched row), or defer it: see :func:`django_fair_jobs.admission.holding`."""
        with admission.holding(self, args, kwargs):  # raises Ignore when deferred
            return super().__call__(*args, **kwargs)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, with the job's slot (and queue place) released before the
        retry is published: a retry that starts at once on another process finds the slot
        free instead of held by this run. A dispatched job's retry asked inside the job's
        own ``atomic()`` is stored when the run ends, whatever the block does."""
        admission.release_held(self)
        setattr(self.request, "fair_retrying", True)  # noqa: B010  (Context's stub)
        try:
            return super().retry(*args, **kwargs)
        finally:
            setattr(self.request, "fair_retrying", False)  # noqa: B010


TASK_OPTIONS: tuple[str, ...] = tuple(name for name in vars(FairTask) if name.startswith("fair_"))
"""Every ``fair_*`` name a fair task may set (options and overridable methods); the checks
warn about any other (``fair_jobs.W003``)."""

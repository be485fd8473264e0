"""``FAIR_JOBS_TENANT_RESOLVER``: a job's tenant from the publisher's context when neither
``fair_tenant=`` nor the task's ``fair_tenant()`` gives one, decided at publish and carried
in the job's header like an explicit tenant; and its check (``fair_jobs.E020``)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Iterator
from typing import Any

import pytest
from celery import shared_task
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_fair_jobs import checks, publishing, tenants
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.dispatch.models import DispatchJob
from django_fair_jobs.planner.models import PlannedJob
from django_fair_jobs.task import FairTask
from tests.testapp.tasks import limited1, no_tenant

CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)
"""What a project's middleware would set for the request being served."""

seen: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

RESOLVER = "tests.test_tenant_resolver.from_context"

NOT_CALLABLE = 42
"""A setting pointing here is a dotted path to something that is not a callable."""


def from_context(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """A resolver: the tenant of the request being served, from a contextvar."""
    seen.append((task.name, args, kwargs))
    return CURRENT.get()


def acme(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A resolver that always answers ``"acme"``."""
    return "acme"


def gives_bytes(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """A resolver that returns a value no tenant can be."""
    return b"acme"


def takes_one(task: Any) -> str:
    """Not a resolver: it cannot be called as ``resolver(task, args, kwargs)``."""
    return "acme"


@shared_task(base=FairTask, bind=True, queue="fair", fair_dispatch=True)
def dispatched_anon(self: Any, value: int) -> int:
    """A dispatched task whose arguments name no tenant."""
    return value


@shared_task(
    base=FairTask, bind=True, queue="fair", fair_plan={"enqueue_interval": 60, "enqueue_jobs": 1}
)
def planned_anon(self: Any, value: int) -> int:
    """A planned task whose arguments name no tenant."""
    return value


@pytest.fixture(autouse=True)
def _resolver_set() -> Iterator[None]:
    seen.clear()
    token = CURRENT.set("acme")
    with override_settings(FAIR_JOBS_TENANT_RESOLVER=RESOLVER):
        yield
    CURRENT.reset(token)


def tenant_of(task: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
    """The tenant header a publish of ``task`` gives the job."""
    prepared = publishing.prepare(task, args, {}, None, options)
    return prepared.options["headers"][fair_headers.TENANT]


def test_publish__no_option_no_method__the_resolver_gives_the_tenant() -> None:
    assert tenant_of(no_tenant, (1,), {}) == "acme"
    assert seen == [(no_tenant.name, (1,), {})]


def test_publish__option_method_or_header__win_and_the_resolver_is_not_called() -> None:
    assert tenant_of(no_tenant, (1,), {"fair_tenant": "given"}) == "given"
    assert tenant_of(limited1, ("t1",), {}) == "t1"  # its fair_tenant(): the first argument
    # A re-publish (retry, wake-up, dispatch) keeps the tenant it was published with, even
    # none: the resolver would read the worker's context, not the publisher's.
    assert tenant_of(no_tenant, (1,), {"headers": {fair_headers.TENANT: None}}) is None
    assert seen == []


def test_publish__the_resolver_says_none__no_tenant() -> None:
    CURRENT.set(None)
    assert tenant_of(no_tenant, (1,), {}) is None


def test_publish__resolver_gives_a_bad_value__refused_naming_the_setting() -> None:
    with (
        override_settings(FAIR_JOBS_TENANT_RESOLVER="tests.test_tenant_resolver.gives_bytes"),
        pytest.raises(tenants.TenantError, match="FAIR_JOBS_TENANT_RESOLVER gave"),
    ):
        tenant_of(no_tenant, (1,), {})


def test_publish_from_an_event_loop__the_resolver_reads_the_callers_context() -> None:
    # An async view's publish runs on a publisher thread; the middleware's contextvar must
    # reach it there, as it reaches a sync_to_async call.
    async def view() -> Any:
        CURRENT.set("from-async-view")
        return publishing.off_event_loop(lambda: tenant_of(no_tenant, (1,), {}))

    assert publishing.in_event_loop() is False
    assert asyncio.run(view()) == "from-async-view"


def test_resolver__imported_once_per_value(monkeypatch: pytest.MonkeyPatch) -> None:
    with override_settings():
        from django.conf import settings

        delattr(settings, "FAIR_JOBS_TENANT_RESOLVER")
        # From the environment every read is a new string: still one import for one value.
        monkeypatch.setenv("FAIR_JOBS_TENANT_RESOLVER", RESOLVER)
        tenant_of(no_tenant, (1,), {})
        cached = tenants._resolver
        tenant_of(no_tenant, (1,), {})
        assert tenants._resolver is cached
        assert len(seen) == 2
        monkeypatch.setenv("FAIR_JOBS_TENANT_RESOLVER", "tests.test_tenant_resolver.acme")
        CURRENT.set("not-read")
        assert tenant_of(no_tenant, (1,), {}) == "acme"  # a new value: the new callable


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("tests.no_such_module.resolver", "cannot be imported: No module named"),
        ("tests.test_tenant_resolver.missing", "cannot be imported"),
        ("resolver", "cannot be imported"),
        ("tests.test_tenant_resolver.NOT_CALLABLE", "is not callable"),
        ("tests.test_tenant_resolver.takes_one", "it is called as resolver(task, args, kwargs)"),
    ],
)
def test_check__bad_setting__E020_says_what_is_wrong_and_how_to_fix_it(
    value: str, reason: str
) -> None:
    with override_settings(FAIR_JOBS_TENANT_RESOLVER=value):
        errors = [e for e in checks.check_settings() if e.id == "fair_jobs.E020"]
        assert len(errors) == 1, errors
        assert f"FAIR_JOBS_TENANT_RESOLVER = {value!r}" in errors[0].msg
        assert reason in errors[0].msg
        assert errors[0].hint is not None
        assert "django_fair_jobs.tenants.schema_name" in errors[0].hint
        # A worker refuses to start with it; a publish names the same problem.
        with pytest.raises(SystemExit):
            checks.fail_fast_on_bad_settings()
        with pytest.raises(ImproperlyConfigured, match="TENANT_RESOLVER"):
            tenant_of(no_tenant, (1,), {})


@pytest.mark.parametrize("value", [RESOLVER, "django_fair_jobs.tenants.schema_name", acme, None])
def test_check__good_setting__no_error(value: Any) -> None:
    with override_settings(FAIR_JOBS_TENANT_RESOLVER=value):
        assert [e for e in checks.check_settings() if e.id == "fair_jobs.E020"] == []


def test_schema_name__a_database_without_schemas__no_tenant() -> None:
    # The suite's own connection is not django-tenants': no schema, so no tenant (the
    # django-tenants project's test, tests/deploy/test_django_tenants.py, has schemas).
    assert tenants.schema_name(no_tenant, (), {}) is None


@pytest.mark.django_db(transaction=True)
def test_held_jobs__dispatched_and_planned__stored_with_the_resolvers_tenant() -> None:
    dispatched_anon.delay(1)
    dispatched_anon.bulk_enqueue([((2,), {}), ((3,), {})])
    planned_anon.delay(1)
    planned_anon.bulk_enqueue([((2,), {})])
    assert list(DispatchJob.objects.values_list("tenant", flat=True)) == ["acme"] * 3
    assert list(PlannedJob.objects.values_list("tenant", flat=True)) == ["acme"] * 2

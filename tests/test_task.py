"""FairTask at publish time: tenant resolution, validation and option checks."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import shared_task

from django_fair_jobs import FairTask
from django_fair_jobs.task import FairTaskConfigError
from django_fair_jobs.tenants import TenantError, normalize_tenant, warn_missing_tenant
from tests.testapp import tasks


class Captured(Exception):
    """Raised instead of publishing, carrying what would have been sent."""


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Capture the options Celery's apply_async receives, without a broker."""
    calls: list[dict[str, Any]] = []

    def fake_apply_async(
        self: Any, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any
    ) -> None:
        calls.append({"args": args, "kwargs": kwargs, **options})

    monkeypatch.setattr("celery.app.task.Task.apply_async", fake_apply_async)
    return calls


def test_publish__tenant_from_fair_tenant(sent: list[dict[str, Any]]) -> None:
    tasks.limited3.delay("acme", 0.1)
    assert sent[0]["headers"]["fair_tenant"] == "acme"


def test_publish__explicit_tenant_wins(sent: list[dict[str, Any]]) -> None:
    tasks.limited3.apply_async(("acme", 0.1), fair_tenant="t1")
    tasks.limited3.s("acme", 0.1).set(fair_tenant=42).delay()  # type: ignore[call-arg]
    assert [c["headers"]["fair_tenant"] for c in sent] == ["t1", "42"]
    assert all("fair_tenant" not in c for c in sent)


def test_publish__existing_header_kept_on_republish(sent: list[dict[str, Any]]) -> None:
    tasks.limited3.apply_async(
        ("acme", 0.1), headers={"fair_tenant": "orig", "x": 1, "fair_enqueued_at": 12.5}
    )
    assert sent[0]["headers"] == {"fair_tenant": "orig", "x": 1, "fair_enqueued_at": 12.5}


def test_publish__wake_header_only_from_fair_wake_option(sent: list[dict[str, Any]]) -> None:
    tasks.limited3.apply_async(("acme",), headers={"fair_wake": 3})  # e.g. a retry
    tasks.limited3.apply_async(("acme",), fair_wake=4)  # the wake-up itself
    assert "fair_wake" not in sent[0]["headers"]
    assert sent[1]["headers"]["fair_wake"] == 4


def test_publish__no_tenant__header_none(sent: list[dict[str, Any]]) -> None:
    tasks.no_tenant.delay(1)
    assert sent[0]["headers"]["fair_tenant"] is None


def test_publish__tenant_too_long__error_and_nothing_sent(sent: list[dict[str, Any]]) -> None:
    with pytest.raises(TenantError, match="limit is 255"):
        tasks.limited3.delay("x" * 256)
    with pytest.raises(TenantError):
        tasks.limited3.apply_async(("ok",), fair_tenant="y" * 1000)
    assert sent == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("   ", None),
        (7, "7"),
        ("ünïcode", "ünïcode"),
        ("x" * 255, "x" * 255),
    ],
)
def test_normalize_tenant(value: Any, expected: str | None) -> None:
    assert normalize_tenant(value) == expected


def test_warn_missing_tenant__rate_limited(caplog: pytest.LogCaptureFixture, settings: Any) -> None:
    settings.FAIR_JOBS_TENANT_WARNING_INTERVAL = 3600
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs.tenants"):
        logged = [warn_missing_tenant("tests.rate_limited") for _ in range(1000)]
    assert logged.count(True) == 1
    assert len(caplog.records) == 1


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"fair_max_jobs": 0}, "fair_max_jobs must be a whole number"),
        ({"fair_max_jobs": "2"}, "fair_max_jobs must be a whole number"),
        ({"fair_on_limit": "drop"}, "fair_on_limit must be one of park, retry"),
        ({"fair_retry_countdown": -1}, "fair_retry_countdown must be a number"),
    ],
)
def test_task_options__invalid__error_at_definition(options: dict[str, Any], match: str) -> None:
    def define() -> Any:
        @shared_task(base=FairTask, name=f"tests.bad_{len(options)}", **options)
        def bad() -> None:
            pass

        return bad.fair_max_jobs  # shared_task is lazy: touching it builds the class

    with pytest.raises(FairTaskConfigError, match=match):
        define()


def test_eager__runs_without_slots(settings: Any) -> None:
    assert tasks.no_tenant.apply(args=(4,)).get() == 8

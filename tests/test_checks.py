"""One test per system check id, and the settings' read order."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_fair_jobs.checks import check_settings
from django_fair_jobs.conf import fair_settings


def ids(**overrides: Any) -> list[str]:
    from django.test import override_settings

    with override_settings(**overrides):
        return [m.id for m in check_settings() if m.id]


def test_defaults__pass() -> None:
    assert ids() == []


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_e001__default_max_jobs(value: Any) -> None:
    assert ids(FAIR_JOBS_DEFAULT_MAX_JOBS=value) == ["fair_jobs.E001"]


def test_e002__on_limit() -> None:
    assert ids(FAIR_JOBS_ON_LIMIT="drop") == ["fair_jobs.E002"]


def test_e003__retry_countdown() -> None:
    assert ids(FAIR_JOBS_RETRY_COUNTDOWN=-1) == ["fair_jobs.E003"]


def test_e004__worker_timeout() -> None:
    assert ids(FAIR_JOBS_WORKER_TIMEOUT=0) == ["fair_jobs.E004"]


def test_e005__heartbeat_interval() -> None:
    assert ids(FAIR_JOBS_HEARTBEAT_INTERVAL="10") == ["fair_jobs.E005"]


def test_e006__heartbeat_more_than_half_the_timeout() -> None:
    assert ids(FAIR_JOBS_HEARTBEAT_INTERVAL=31, FAIR_JOBS_WORKER_TIMEOUT=60) == ["fair_jobs.E006"]
    assert ids(FAIR_JOBS_HEARTBEAT_INTERVAL=30, FAIR_JOBS_WORKER_TIMEOUT=60) == []


def test_e007__tenant_warning_interval() -> None:
    assert ids(FAIR_JOBS_TENANT_WARNING_INTERVAL=-5) == ["fair_jobs.E007"]


@pytest.mark.parametrize("raw", ["sixty", "1e3x", "5 min", ""])
def test_e008__unparsable_environment(
    monkeypatch: pytest.MonkeyPatch, settings: Any, raw: str
) -> None:
    del settings.FAIR_JOBS_WORKER_TIMEOUT
    monkeypatch.setenv("FAIR_JOBS_WORKER_TIMEOUT", raw)
    messages = [m for m in check_settings() if m.id]
    assert [m.id for m in messages] == ["fair_jobs.E008"]
    assert repr(raw) in messages[0].msg


def test_environment__parsed_strictly(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    del settings.FAIR_JOBS_WORKER_TIMEOUT
    monkeypatch.setenv("FAIR_JOBS_WORKER_TIMEOUT", " 1e3 ")
    assert fair_settings.WORKER_TIMEOUT == 1000.0


def test_check_command__fails_on_bad_setting(settings: Any) -> None:
    settings.FAIR_JOBS_ON_LIMIT = "drop"
    with pytest.raises(SystemCheckError, match=r"fair_jobs\.E002"):
        call_command("check")


def test_settings__django_setting_beats_environment(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    monkeypatch.setenv("FAIR_JOBS_DEFAULT_MAX_JOBS", "7")
    settings.FAIR_JOBS_DEFAULT_MAX_JOBS = 3
    assert fair_settings.DEFAULT_MAX_JOBS == 3
    del settings.FAIR_JOBS_DEFAULT_MAX_JOBS
    assert fair_settings.DEFAULT_MAX_JOBS == 7
    monkeypatch.delenv("FAIR_JOBS_DEFAULT_MAX_JOBS")
    assert fair_settings.DEFAULT_MAX_JOBS == 1

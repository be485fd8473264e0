"""A dispatched job whose tenant resolves to none is never refused at ``delay()``: such
jobs share one line (the tenant ``""``, which no real tenant can be), under no tenant's
cap, with a warning logged at most once per interval per task; ``FAIR_JOBS_DEFAULT_TENANT``
names a tenant for them instead (issue: operators see the default mode, item 4)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from django.test import override_settings

from django_fair_jobs import tenants
from django_fair_jobs.dispatch.models import DispatchJob, DispatchTenant
from tests.conftest import Worker, wait_for
from tests.dispatch.conftest import set_capacity
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    tenants._last_warned.clear()


@pytest.mark.usefixtures("engine", "collected")
def test_no_tenant__stored_in_the_one_line_without_a_tenant__one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    set_capacity(0)  # nothing dispatched: the jobs stay in their line
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs"):
        results = [tasks.dispatched_no_tenant.delay(i) for i in range(3)]
        tasks.dispatched_no_tenant.apply_async((9,), fair_tenant="")
    rows = DispatchJob.objects.filter(task_id__in=[r.id for r in results])
    assert sorted(rows.values_list("tenant", flat=True)) == ["", "", ""]
    line = DispatchTenant.objects.get(queue="fair", tenant="")
    assert line.waiting == 4
    assert line.cap is None
    warnings = [r.getMessage() for r in caplog.records if "without a tenant" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "dispatched_no_tenant" in warnings[0]
    assert "FAIR_JOBS_DEFAULT_TENANT" in warnings[0]


@pytest.mark.usefixtures("engine", "collected")
def test_no_tenant__a_task_cap_does_not_apply_to_the_shared_line() -> None:
    set_capacity(0)
    tasks.dispatched_no_tenant_capped.delay(1)
    assert DispatchTenant.objects.get(queue="fair", tenant="").cap is None


@pytest.mark.usefixtures("engine", "collected")
@override_settings(FAIR_JOBS_DEFAULT_TENANT="shared")
def test_default_tenant__names_the_line_of_jobs_without_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    set_capacity(0)
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs"):
        result = tasks.dispatched_no_tenant.delay(1)
        tasks.dispatched_capped.delay("acme")
    assert DispatchJob.objects.get(task_id=result.id).tenant == "shared"
    assert DispatchTenant.objects.get(queue="fair", tenant="shared").cap is None
    assert DispatchJob.objects.filter(tenant="acme").count() == 1  # a tenant of its own wins
    assert not [r for r in caplog.records if "without a tenant" in r.getMessage()]


@pytest.mark.workers
def test_no_tenant__dispatched_jobs_run_on_a_real_worker(
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker("w", pool="threads", concurrency=2)
    results = [tasks.dispatched_no_tenant.delay(i) for i in range(6)]
    assert [r.get(timeout=30) for r in results] == [0, 2, 4, 6, 8, 10]
    wait_for(lambda: not DispatchJob.objects.exists(), 20, "the jobs' rows to go")
    assert "Traceback" not in worker.output()
    assert "without a tenant" not in worker.output()  # the publish said so, once

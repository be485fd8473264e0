"""The defaults a new project gets: a ``FairTask`` with no options is dispatched fairly,
and its tenants' jobs run side by side rather than one at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from django_fair_jobs.conf import fair_settings
from django_fair_jobs.dispatch.models import DispatchJob
from tests.conftest import Worker, wait_for
from tests.test_workers import max_overlap, wait_finished
from tests.testapp import tasks
from tests.testapp.models import JobRun

LIBRARY_DEFAULTS = {"FAIR_JOBS_TESTS_LIBRARY_DEFAULTS": "1"}
"""A worker's environment that leaves ``FAIR_JOBS_DEFAULT_MAX_JOBS`` unset (tests/settings)."""


@pytest.fixture
def new_project(settings: Any) -> None:
    """This process's settings as a new project has them: no FAIR_JOBS_DEFAULT_MAX_JOBS."""
    del settings.FAIR_JOBS_DEFAULT_MAX_JOBS
    assert not fair_settings.is_set("DEFAULT_MAX_JOBS")


@pytest.mark.django_db
def test_no_options__dispatched__waits_in_its_tenants_line(new_project: None) -> None:
    # limited1 sets no fair_* option (max_retries is Celery's): the job waits in the
    # database for a free worker process rather than going to the broker.
    result = tasks.limited1.delay("acme")
    job = DispatchJob.objects.get()
    assert (job.task_id, job.tenant, job.queue) == (result.id, "acme", "fair")
    assert tasks.limited1.fair_dispatching() is True


@pytest.mark.django_db
def test_default_max_jobs_set__no_options__tenant_slots_as_before(settings: Any) -> None:
    settings.FAIR_JOBS_DEFAULT_MAX_JOBS = 2
    assert tasks.limited1.fair_dispatching() is False
    tasks.limited1.delay("acme")
    assert not DispatchJob.objects.exists()


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        (tasks.limited3, False),  # fair_max_jobs: tenant slots
        (tasks.dispatched_capped, True),  # fair_dispatch and fair_max_jobs: capped dispatch
        (tasks.dispatched, tasks.DISPATCH),  # its own option, as given
    ],
    ids=["fair_max_jobs", "dispatch_capped", "dispatch_weights"],
)
def test_an_option_that_chooses_a_mechanism__wins_over_the_default(
    new_project: None, task: Any, expected: Any
) -> None:
    assert task.fair_dispatching() == expected


@pytest.mark.parametrize(
    "option",
    [
        {"fair_dispatch": False},
        {"fair_slots": False},
        {"fair_on_limit": "retry"},
        {"fair_retry_countdown": 5},
        {"fair_reroute": [{"queue": "slow", "threshold": 10, "per": 60}]},
        {"fair_reroute_scope": "queue"},
        {"fair_plan": {"enqueue_interval": 1, "enqueue_jobs": 10}},
    ],
    ids=lambda option: next(iter(option)),
)
def test_each_other_mechanism_option__not_dispatched(
    new_project: None, monkeypatch: pytest.MonkeyPatch, option: dict[str, Any]
) -> None:
    task = tasks.limited1
    assert task.fair_dispatching() is True
    for name, value in option.items():
        monkeypatch.setattr(task, name, value)
    assert task.fair_dispatching() is False


@pytest.mark.django_db(transaction=True)
@pytest.mark.workers
def test_no_options__one_tenants_jobs_run_side_by_side(
    new_project: None, start_worker: Callable[..., Worker]
) -> None:
    # Before fair dispatch was the default, these four jobs of one tenant ran one at a
    # time (FAIR_JOBS_DEFAULT_MAX_JOBS = 1) while a second worker process idled.
    start_worker("d", concurrency=2, extra_env=LIBRARY_DEFAULTS)
    ids = [tasks.limited1.delay("acme", 0.6).id for _ in range(4)]
    wait_finished(ids, timeout=60)
    runs = JobRun.objects.filter(task_id__in=ids, finished_at__isnull=False)
    assert max_overlap((r.started_at, r.finished_at) for r in runs if r.finished_at) == 2
    wait_for(lambda: not DispatchJob.objects.exists(), 20, "the dispatch rows to go")

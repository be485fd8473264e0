"""The fair planner with real worker processes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from django_fair_jobs.models import PlannedJob
from tests.conftest import Worker, wait_for
from tests.test_workers import wait_finished
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.workers
def test_planned_jobs__promoted_by_the_workers_and_run(start_worker: Callable[..., Worker]) -> None:
    start_worker("p", concurrency=2, queues="fair")
    ids = [r.id for r in tasks.planned.bulk_enqueue([((f"t{i % 3}",), {}) for i in range(12)])]
    wait_finished(ids, timeout=60)
    wait_for(lambda: not PlannedJob.objects.exists(), 20, "planned rows to be gone at start")
    assert tasks.planned.AsyncResult(ids[0]).get(timeout=10).endswith(":done")

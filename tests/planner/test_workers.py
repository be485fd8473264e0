"""The fair planner with real worker processes."""

from __future__ import annotations

from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

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


@pytest.mark.workers
def test_purged_queue__promoted_jobs_requeued_by_command__run_without_a_shell(
    start_worker: Callable[..., Worker], celery_app: Any
) -> None:
    # Promoted while no worker consumes the queue, then `celery purge`: the rows say
    # promoted, the messages are gone, and the queue's latency holds the planner back.
    ids = [r.id for r in tasks.planned.bulk_enqueue([((f"t{i % 2}",), {}) for i in range(6)])]
    call_command("fair_jobs_plan", tasks.planned.name, stdout=StringIO())
    assert PlannedJob.objects.filter(promoted_at__isnull=False).count() == 6
    with celery_app.connection_for_write() as conn:
        conn.default_channel.queue_purge("fair")
    out = StringIO()
    call_command("fair_jobs_plan", tasks.planned.name, "--requeue-promoted", "0", stdout=out)
    assert "6 promoted job(s) put back in line" in out.getvalue()
    start_worker("p", concurrency=2, queues="fair")
    wait_finished(ids, timeout=60)
    wait_for(lambda: not PlannedJob.objects.exists(), 20, "planned rows to be gone at start")


def test_requeue_promoted__bad_seconds__clear_error() -> None:
    with pytest.raises(CommandError, match="--requeue-promoted wants seconds >= 0"):
        call_command("fair_jobs_plan", "--requeue-promoted", "-5")

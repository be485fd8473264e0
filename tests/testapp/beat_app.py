"""A Celery app for the beat test (tests/deploy/test_beat.py): a project that drives its
planner from Celery beat.

It loads ``django_fair_jobs.plan`` (what a project's ``autodiscover_tasks()`` finds in
the installed app) and one planned task, and none of the suite's other tasks. The test's
processes run with ``FAIR_JOBS_PLANNER_THREADS = False``, so only beat's runs promote.
"""

from __future__ import annotations

import os
from typing import Any

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django.db.models.functions import Now  # noqa: E402  (needs django.setup())

import django_fair_jobs.tasks  # noqa: E402, F401  (registers django_fair_jobs.plan)
from django_fair_jobs import FairTask  # noqa: E402
from tests.testapp.models import JobRun  # noqa: E402

# Not the current app: the test process imports this module beside the suite's own app.
app = Celery("beat_tests", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")

BEAT_INTERVAL = 600.0
"""``enqueue_interval`` of ``beat_planned``: one planner run per ten minutes, the first
of them beat's."""


class TenantFromFirstArg(FairTask):
    """The tenant is the first positional argument."""

    @classmethod
    def fair_tenant(cls, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else None


@app.task(
    base=TenantFromFirstArg,
    bind=True,
    name="tests.beat.planned",
    queue="fair",
    fair_slots=False,
    fair_plan={"enqueue_interval": BEAT_INTERVAL, "enqueue_jobs": 100},
)
def beat_planned(self: Any, tenant: str) -> str:
    """A planned job: it waits in its tenant's virtual queue until a planner run."""
    JobRun.objects.create(
        task_id=self.request.id,
        tenant=tenant,
        queue="fair",
        pid=os.getpid(),
        started_at=Now(),
        finished_at=Now(),
    )
    return f"{tenant}:done"

"""The chaos suite's client process: ``python -m tests.chaos.driver COMMAND`` with the chaos
database and broker in its environment (``DATABASE_URL``, ``CELERY_BROKER_URL``).

- ``publish``: reads ``[{"task", "tenant", "duration", "count", "task_id"?}, ...]`` on stdin,
  publishes each job through the task's ``apply_async`` (so rerouting counts it and the
  planner parks it), and prints the accepted jobs as JSON;
- ``reap SECONDS``: runs ``manage.py fair_jobs_reap`` in a loop, as a second reaper would;
- ``promote``: runs the planner's promotion of ``chaos_planned`` until nothing is due, with
  each publish slowed, and prints its calls of ``planner_store.promote`` as JSON.

A separate process, because the test process's Django and Celery point at the suite's own
database and broker, not at the chaos ones.
"""

from __future__ import annotations

import io
import json
import sys
import time
from typing import Any

from django.core.management import call_command

from django_fair_jobs.planner import store as planner_store


def publish() -> None:
    """Publish the jobs read on stdin; print ``[{"id", "task", "tenant"}, ...]``."""
    from tests.testapp import chaos_tasks

    accepted = []
    for item in json.load(sys.stdin):
        task = getattr(chaos_tasks, item["task"])
        for _ in range(item.get("count", 1)):
            result = task.apply_async(
                (item["tenant"], item["duration"]), task_id=item.get("task_id")
            )
            accepted.append({"id": result.id, "task": item["task"], "tenant": item["tenant"]})
    print(json.dumps(accepted))


def reap(seconds: float) -> None:
    """Run the maintenance pass by hand, back to back, for ``seconds``."""
    deadline = time.monotonic() + seconds
    passes = 0
    while time.monotonic() < deadline:
        # Its report line is not read: a pipe full of them would block the loop.
        call_command("fair_jobs_reap", verbosity=0, stdout=io.StringIO())
        passes += 1
    print(json.dumps({"passes": passes}))


def promote() -> None:
    """Promote ``chaos_planned``'s due jobs as a planner run does (``planner._promote``:
    the weighted allocation, then one claim per tenant), run after run until none is due,
    without the planner lock, so that two of these promote at once. Each publish takes
    0.1 s more, so a claim holds its rows while another claims. Prints ``[{"tenant",
    "ids", "start", "end"}, ...]``, one per claim (wall clock, this machine's)."""
    from django_fair_jobs import planner
    from django_fair_jobs.models import PlannerRun
    from tests.testapp.chaos_tasks import chaos_planned

    plan = planner.parse_plan(chaos_planned.fair_plan or {})
    PlannerRun.objects.get_or_create(task_name=chaos_planned.name)
    publish, claim = planner._publish, planner_store.promote
    calls: list[dict[str, Any]] = []

    def slow_publish(app: Any, row: Any) -> None:
        publish(app, row)
        time.sleep(0.1)

    def recorded(
        task_name: str,
        tenant: str,
        count: int,
        publish: Any,
        **options: Any,
    ) -> list[str]:
        start = time.time()
        ids = claim(task_name, tenant, count, publish, **options)
        calls.append({"tenant": tenant, "ids": ids, "start": start, "end": time.time()})
        return ids

    planner._publish = slow_publish
    planner_store.promote = recorded
    while planner_store.pending(chaos_planned.name):
        if not any(planner._promote(chaos_planned, plan, None).values()):
            time.sleep(0.05)  # the rows left are the other planner's, until it commits
    print(json.dumps(calls))


def main() -> None:
    """Dispatch ``sys.argv[1]``."""
    import tests.celery_app  # noqa: F401  # Django set up, the chaos broker configured

    command = sys.argv[1]
    if command == "publish":
        publish()
    elif command == "reap":
        reap(float(sys.argv[2]))
    elif command == "promote":
        promote()
    else:
        raise SystemExit(f"unknown command {command!r}: publish, reap or promote")


if __name__ == "__main__":
    main()

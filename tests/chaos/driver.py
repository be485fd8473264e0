"""The chaos suite's client process: ``python -m tests.chaos.driver COMMAND`` with the chaos
database and broker in its environment (``DATABASE_URL``, ``CELERY_BROKER_URL``).

- ``publish``: reads ``[{"task", "tenant", "duration", "count", "task_id"?}, ...]`` on stdin,
  publishes each job through the task's ``apply_async`` (so rerouting counts it and the
  planner parks it), and prints the accepted jobs as JSON;
- ``reap SECONDS``: runs ``manage.py fair_jobs_reap`` in a loop, as a second reaper would.

A separate process, because the test process's Django and Celery point at the suite's own
database and broker, not at the chaos ones.
"""

from __future__ import annotations

import json
import sys
import time

from django.core.management import call_command


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
        call_command("fair_jobs_reap", verbosity=0)
        passes += 1
    print(json.dumps({"passes": passes}))


def main() -> None:
    """Dispatch ``sys.argv[1]``."""
    import tests.celery_app  # noqa: F401  # Django set up, the chaos broker configured

    command = sys.argv[1]
    if command == "publish":
        publish()
    elif command == "reap":
        reap(float(sys.argv[2]))
    else:
        raise SystemExit(f"unknown command {command!r}: publish or reap")


if __name__ == "__main__":
    main()

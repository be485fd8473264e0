"""A crash of the PostgreSQL server under ``FAIR_JOBS_DISPATCH_ASYNC_COMMIT``: the starts
and flushed ends that did not wait for the disk are lost with the WAL still in memory,
the lost-message repair does not publish a job whose start was lost before its process
confirms it, and the process's maintenance thread makes every one of them again. A server
of the test's own; the machine's shared server is never touched."""

from __future__ import annotations

import json

import pytest

from tests.chaos.pgserver import ThrowawayPostgres
from tests.slots.test_async_release import crash, crashable_pg, start_script

__all__ = ["crashable_pg"]  # the fixture, shared with the slots' crash test

# A script run against the test's own server, as a worker process: 15 jobs dispatched; job
# 0 started with a commit that waits, jobs 1 to 9 without, jobs 10 to 14 started with
# commits that wait and ended by one flush that does not. Once the test has crashed and
# restarted the server it reports what the crash left, what the lost-message repair would
# publish again, and what is left once its maintenance thread has confirmed.
CRASH_SCRIPT = """
import json, sys, time
import django
django.setup()
from celery import current_app
from django.db import connection
from django.test import override_settings
from django_fair_jobs import admission, dispatch, identity
from django_fair_jobs.admission import flusher
from django_fair_jobs.admission.ends import LEDGER
from django_fair_jobs.dispatch.models import DispatchJob, DispatchQueue
from django_fair_jobs.dispatch.store import Store
from tests.testapp import tasks

pid = identity.current_process_id("crash@h")  # as a worker's, its threads started
DispatchQueue.objects.update_or_create(queue="q", defaults={"capacity": 20})
jobs = [
    dispatch.Job(queue="q", tenant=f"t{i}", task_name="t", task_id=f"job{i}", message="{}",
                 not_before=None, weight=None, cap=None)
    for i in range(15)
]
ids = sorted(r.job_id for r in dispatch.enqueue_many(jobs))
assert len(ids) == 15
time.sleep(8)  # the jobs were dispatched long before the crash (the repair's clock)
with override_settings(FAIR_JOBS_DISPATCH_ASYNC_COMMIT=False):
    for job_id in [ids[0], *ids[10:]]:
        admission._start_dispatched(tasks.dispatched, job_id, pid)
for job_id in ids[1:10]:
    admission._start_dispatched(tasks.dispatched, job_id, pid)
flusher.flush([(job_id, pid, current_app) for job_id in ids[10:]])
print(json.dumps({"starts": len(LEDGER.unconfirmed_starts),
                  "ends": len(LEDGER.unconfirmed_ends)}), flush=True)
sys.stdin.readline()  # the server crashed and came back
connection.close()

def state():
    rows = dict(DispatchJob.objects.values_list("id", "state"))
    return {"running": sum(rows.get(i) == 3 for i in ids),
            "dispatched": sum(rows.get(i) == 2 for i in ids),
            "gone": sum(i not in rows for i in ids)}

after_crash = state()
republished = len(Store("default").lost(6.0))  # the jobs were dispatched 10 s ago
deadline = time.monotonic() + 120
while (LEDGER.unconfirmed_starts or LEDGER.unconfirmed_ends) and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({"after_crash": after_crash, "republished": republished,
                  "after_confirm": state(),
                  "left": len(LEDGER.unconfirmed_starts) + len(LEDGER.unconfirmed_ends)}),
      flush=True)
"""


@pytest.mark.workers
def test_crash_of_the_server__lost_starts_and_ends__made_again_by_the_process(
    crashable_pg: ThrowawayPostgres,
) -> None:
    # The maintenance thread's first pass comes after the crash, not before: it would
    # confirm the commits and the crash lose nothing.
    script = start_script(
        crashable_pg, CRASH_SCRIPT,
        FAIR_JOBS_HEARTBEAT_INTERVAL="20", FAIR_JOBS_DISPATCH_ASYNC_COMMIT="true",
    )  # fmt: skip
    assert script.stdin is not None and script.stdout is not None
    try:
        assert json.loads(script.stdout.readline()) == {"starts": 9, "ends": 5}
        crash(crashable_pg, script)
        report = json.loads(script.stdout.readline())
    finally:
        script.kill()
        script.wait()
    after = report["after_crash"]
    # The durable starts survived; the asynchronous starts and ends after them were lost
    # with the WAL the crash took: started jobs show dispatched, ended jobs running.
    assert after["dispatched"] + after["running"] + after["gone"] == 15
    assert after["dispatched"] + after["gone"] < 14, "nothing was lost: the crash proved nothing"
    # Dispatched 10 s before, with 6 s to start: without the server's start on its clock,
    # the repair would have published each job whose start was lost again.
    assert report["republished"] == 0
    # The maintenance thread made each of them again: ten running here, five ended.
    assert report["after_confirm"] == {"running": 10, "dispatched": 0, "gone": 5}
    assert report["left"] == 0

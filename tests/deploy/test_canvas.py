"""Celery canvas (group, chord, chain, link_error) and ``autoretry_for`` with real worker
processes, a real Redis broker and result backend, and the real database.

Each test runs twice: under fair dispatch (jobs wait in their tenant's line, in rows, and
are published later) and under tenant slots that park (a job over its tenant's limit is
parked and woken). Every task has a tenant limit of 1, so one tenant's canvas members
wait for each other: the tests check that waiting never breaks what canvas relies on.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult, GroupResult

from django_fair_jobs.dispatch.models import WAITING, DispatchJob, DispatchTenant
from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot
from tests.conftest import Worker, wait_for
from tests.test_workers import max_overlap
from tests.testapp import canvas_tasks
from tests.testapp.models import JobRun

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]

FAST = {"FAIR_JOBS_HEARTBEAT_INTERVAL": "0.5", "FAIR_JOBS_WORKER_TIMEOUT": "3"}
"""Worker settings that make maintenance run every half second."""


@dataclass(frozen=True)
class Mode:
    """One way a tenant's jobs wait: the tasks of that form and how to see a job wait."""

    work: Any
    fail: Any
    collect: Any
    errback: Any
    flaky: Any
    waits: Callable[[str], int]
    """How many of a tenant's jobs wait (parked, or in the tenant's line)."""
    settled: Callable[[], bool]
    """Nothing waits or runs any more, and every counter is back to zero."""


def _dispatch_settled() -> bool:
    return (
        not DispatchJob.objects.exists()
        and not DispatchTenant.objects.filter(in_flight__gt=0).exists()
        and not DispatchTenant.objects.filter(waiting__gt=0).exists()
        and not SlotLease.objects.exists()
        and not TenantQueueSlot.objects.filter(current_jobs__gt=0).exists()
    )


def _slots_settled() -> bool:
    return (
        not ParkedJob.objects.exists()
        and not SlotLease.objects.exists()
        and not TenantQueueSlot.objects.filter(current_jobs__gt=0).exists()
        and not TenantQueueSlot.objects.filter(parked_jobs__gt=0).exists()
    )


MODES = {
    "dispatch": Mode(
        work=canvas_tasks.dispatch_work,
        fail=canvas_tasks.dispatch_fail,
        collect=canvas_tasks.dispatch_collect,
        errback=canvas_tasks.dispatch_errback,
        flaky=canvas_tasks.dispatch_flaky,
        waits=lambda tenant: DispatchJob.objects.filter(tenant=tenant, state=WAITING).count(),
        settled=_dispatch_settled,
    ),
    "slots": Mode(
        work=canvas_tasks.slot_work,
        fail=canvas_tasks.slot_fail,
        collect=canvas_tasks.slot_collect,
        errback=canvas_tasks.slot_errback,
        flaky=canvas_tasks.slot_flaky,
        waits=lambda tenant: ParkedJob.objects.filter(slot__tenant=tenant).count(),
        settled=_slots_settled,
    ),
}


@pytest.fixture(params=sorted(MODES))
def mode(request: pytest.FixtureRequest) -> Mode:
    """Fair dispatch, then tenant slots that park."""
    return MODES[request.param]


def runs(label_prefix: str) -> list[JobRun]:
    """The finished runs whose label starts with ``label_prefix``, by start."""
    return list(
        JobRun.objects.filter(queue__startswith=label_prefix, finished_at__isnull=False).order_by(
            "started_at", "pk"
        )
    )


def spans(rows: list[JobRun]) -> list[tuple[datetime, datetime]]:
    return [(r.started_at, r.finished_at) for r in rows if r.finished_at is not None]


def test_group_and_chord__each_member_once__callback_once_after_all_with_every_result(
    start_worker: Callable[..., Worker], mode: Mode
) -> None:
    worker = start_worker("canvas", concurrency=2, extra_env=FAST)

    # A group of one tenant's jobs: they run one at a time (the tenant's limit), each
    # once, and the group's result is complete.
    members = [mode.work.s(tenant="g", label=f"g{i}", duration=0.2) for i in range(4)]
    grouped = group(members).apply_async()
    assert isinstance(grouped, GroupResult)
    results = grouped.get(timeout=60)
    assert sorted(r["path"][0] for r in results) == ["g0", "g1", "g2", "g3"]
    assert grouped.completed_count() == 4
    assert {r["group"] for r in results} == {grouped.id}  # group_id survived the wait
    assert sorted(r.queue for r in runs("g")) == ["g0", "g1", "g2", "g3"], worker.output()
    assert max_overlap(spans(runs("g"))) == 1  # they did wait for each other

    # A chord whose header is one tenant's jobs, at its limit: members wait (parked, or in
    # line), and a waiting member must neither count as done nor fire the callback.
    header = [mode.work.s(tenant="c", label=f"h{i}", duration=0.2) for i in range(4)]
    result: AsyncResult[Any] = chord(header)(mode.collect.s(tenant="c"))
    header_result = result.parent
    assert isinstance(header_result, GroupResult)
    wait_for(lambda: mode.waits("c") > 0, 30, "a header member to wait for its tenant")
    collected = result.get(timeout=60)
    assert sorted(r["path"][0] for r in collected) == ["h0", "h1", "h2", "h3"]
    assert {r["group"] for r in collected} == {header_result.id}
    wait_for(mode.settled, 30, "rows and counters to settle")
    callbacks = runs("callback")
    assert len(callbacks) == 1, worker.output()
    header_runs = runs("h")
    assert sorted(r.queue for r in header_runs) == ["h0", "h1", "h2", "h3"]
    assert max_overlap(spans(header_runs)) == 1
    # Fired after every header member ran, not at the first member's end or park.
    assert all(callbacks[0].started_at >= r.finished_at for r in header_runs)


def test_chain_with_a_waiting_step__link_error__autoretry_with_backoff_and_jitter(
    start_worker: Callable[..., Worker], mode: Mode
) -> None:
    worker = start_worker("canvas", concurrency=2, extra_env=FAST)
    gate = f"gate-{uuid.uuid4()}"

    # Tenant b is at its limit until the gate opens.
    blocker = mode.work.delay(tenant="b", label="blocker", gate=gate)
    wait_for(lambda: JobRun.objects.filter(task_id=blocker.id).exists(), 30, "the blocker")

    # A chain whose second step is tenant b's: it waits; the rest of the chain runs after
    # it, in order, each step given the previous one's result.
    chained = chain(
        mode.work.s(tenant="a", label="1"),
        mode.work.s(tenant="b", label="2"),
        mode.work.s(tenant="a", label="3"),
    ).delay()
    # A failing job of tenant b with an errback: it waits too, then fails once.
    failing = mode.fail.apply_async(kwargs={"tenant": "b"}, link_error=mode.errback.s(tenant="b"))
    wait_for(lambda: mode.waits("b") == 2, 30, "the chain's step 2 and the failing job to wait")
    assert not JobRun.objects.filter(queue="3").exists()  # the chain stops at its step 2
    canvas_tasks.open_gate(gate)

    last = chained.get(timeout=60)
    assert last["path"] == ["1", "2", "3"]
    step2_result = chained.parent
    assert isinstance(step2_result, AsyncResult)
    first = step2_result.parent
    assert isinstance(first, AsyncResult)
    assert last["parent"] == step2_result.id  # parent and root ids survived the wait
    assert last["root"] == first.id
    step2 = JobRun.objects.get(queue="2")
    assert step2.started_at >= JobRun.objects.get(task_id=blocker.id).finished_at  # type: ignore[operator]

    with pytest.raises(RuntimeError, match="boom"):
        failing.get(timeout=60)
    wait_for(
        lambda: JobRun.objects.filter(task_id=failing.id, queue="errback").exists(),
        30,
        "the errback to run",
    )

    # autoretry_for with retry_backoff and retry_jitter: fails twice, then succeeds on its
    # third attempt; each retry competes for its tenant's slot like any job.
    flaky = mode.flaky.delay(f"flaky-{uuid.uuid4()}", tenant="r")
    assert flaky.get(timeout=60) == canvas_tasks.FLAKY_FAILURES + 1
    attempts = JobRun.objects.filter(task_id=flaky.id).order_by("started_at")
    assert [a.retries for a in attempts] == [0, 1, 2]

    wait_for(mode.settled, 30, "rows and counters to settle")
    # Each ran once: no step, errback or attempt twice (a second copy after a wake-up).
    assert sorted(JobRun.objects.values_list("queue", flat=True)) == sorted(
        ["blocker", "1", "2", "3", "fail", "errback", "attempt 1", "attempt 2", "attempt 3"]
    ), worker.output()

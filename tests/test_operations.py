"""Operations: explain, boosts, shadow mode, status, the health check, maintenance of the
decision log, and the settings' checks, against the real database (and, for shadow mode,
a real worker)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
import redis
from celery import signals
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from django.utils import timezone
from kombu.utils.json import dumps

from django_fair_jobs import (
    Explanation,
    admission,
    broker,
    decisions,
    explain,
    explanations,
    identity,
    maintenance,
    planner,
    queue_limits,
    slots,
    status,
)
from django_fair_jobs import headers as fair_headers
from django_fair_jobs.checks import check_settings
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.db import database_now
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.leases.types import Grant
from django_fair_jobs.models import (
    JobDecision,
    LimitChange,
    Maintenance,
    ParkedJob,
    PlannedJob,
    PlannerTenant,
    QueueLimit,
    SlotLease,
    TenantQueueSlot,
    WorkerProcess,
)
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.slots import store as slot_store
from tests.conftest import ROOT, Worker, wait_for
from tests.test_workers import max_overlap, wait_finished
from tests.testapp import tasks
from tests.testapp.models import JobRun

pytestmark = pytest.mark.django_db(transaction=True)

NODE = uuid.uuid4()
OLD = "2000-01-01T00:00:00Z"


@pytest.fixture(autouse=True)
def _empty_broker(broker_env: dict[str, str]) -> Iterator[None]:
    """Wake-ups and reroutes publish for real: start from an empty broker, and leave the
    planner's weights as they were."""
    tasks.PLAN_WEIGHTS.clear()
    yield
    tasks.PLAN_WEIGHTS.clear()


@pytest.fixture
def process() -> uuid.UUID:
    pid = uuid.uuid4()
    identity.register_process(
        process_id=pid, node="n1@host", hostname="host", pid=4242, node_id=NODE
    )
    return pid


def signature(task_id: str, tenant: str = "acme") -> str:
    """What a parked row stores: a real signature, so that a wake-up publishes for real."""
    return str(dumps(dict(tasks.limited1.signature((tenant, 0), task_id=task_id))))


def acquire(process: uuid.UUID, task_id: str, tenant: str = "acme", limit: int = 1) -> Grant:
    got = slot_store.try_acquire(
        tenant=tenant, queue="q", task_id=task_id, limit=limit, process_id=process, timeout=60
    )
    assert got.grant is not None, got.status
    return got.grant


def park(task_id: str, tenant: str = "acme", limit: int = 1) -> None:
    outcome = slot_store.try_park(
        tenant=tenant, queue="q", task_id=task_id, task_name=tasks.limited1.name, limit=limit,
        signature=signature(task_id, tenant),
    )  # fmt: skip
    assert outcome == "parked"


def command(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def history(tenant: str = "acme") -> list[tuple[str, str, str, str]]:
    return [
        (c.source, c.old_value, c.new_value, c.note)
        for c in LimitChange.objects.filter(tenant=tenant).order_by("id")
    ]


# -- explain ---------------------------------------------------------------------------------


def test_explain__running__node_and_the_slot_it_holds(process: uuid.UUID) -> None:
    acquire(process, "run-1", limit=2)
    found = explain("run-1")
    assert found.state == "running"
    assert (found.details["node"], found.details["hostname"], found.details["pid"]) == (
        "n1@host", "host", 4242,
    )  # fmt: skip
    assert found.details["holding"] == [{"tenant_slot": "acme on q", "running": 1, "limit": 2}]
    assert found.details["running_seconds"] is not None
    assert found.summary.startswith("Running on n1@host since ")
    assert "presumed dead" not in found.summary
    # Its worker falls silent: explain says so.
    WorkerProcess.objects.filter(pk=process).update(last_heartbeat_at=OLD)
    assert "presumed dead" in explain("run-1").summary


def test_explain__running_on_a_limited_queue__holds_its_place_and_its_tenant_slot(
    process: uuid.UUID,
) -> None:
    queue_limits.set_limits("hooks", max_jobs=2)
    got = queue_store.try_acquire(
        queue="hooks", tenant="acme", limit=3, task_id="h1", process_id=process, node_id=NODE
    )
    assert got.status == "held"
    found = explain("h1")
    assert found.state == "running"
    assert found.details["holding"] == [
        {"tenant_slot": "acme on hooks", "running": 1, "limit": 3},
        {"queue": "hooks", "running": 1, "max_jobs": 2, "max_jobs_per_worker": None},
    ]


def test_explain__reserved_after_a_wake__woken_once_its_reservation_is_gone(
    process: uuid.UUID,
) -> None:
    first = acquire(process, "j1")
    park("j2")
    admission.release(first)  # wakes j2: its slot is reserved and it is re-published
    reserved = explain("j2")
    assert reserved.state == "reserved"
    assert reserved.details["holding"] == [{"tenant_slot": "acme on q", "running": 1, "limit": 1}]
    assert reserved.details["reserved_seconds"] is not None
    # The re-published copy is lost: its reservation expires and is reaped; the parked
    # row stays woken until the sweep puts it back in line.
    SlotLease.objects.filter(task_id="j2").update(acquired_at=OLD)
    assert lease_store.reap(timeout=60).leases == 1
    woken = explain("j2")
    assert woken.state == "woken"
    assert woken.details["woken_at"] is not None
    assert woken.details["task"] == tasks.limited1.name


def test_explain__parked_behind_a_tenant_slot__reason_place_in_line_and_holders(
    process: uuid.UUID,
) -> None:
    acquire(process, "j1")
    park("j2")
    park("j3")
    second, third = explain("j2"), explain("j3")
    assert second.state == third.state == "parked"
    entry = second.details["tenant_slot"]
    assert entry == {
        "position": 1,
        "held_by": ["j1"],
        "running": 1,
        "tenant": "acme",
        "queue": "q",
        "limit": 1,
        "reason": "tenant 'acme' runs 1 of its limit 1 on q",
    }
    assert "queue_limit" not in second.details
    assert third.details["tenant_slot"]["position"] == 2
    assert "it is number 2 in line" in third.summary
    # The place is counted up to explanations.AHEAD_COUNTED, so that its cost is flat.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(explanations, "AHEAD_COUNTED", 1)  # j3 has exactly 1 ahead
        assert explain("j3").details["tenant_slot"]["position"] == 2
        patch.setattr(explanations, "AHEAD_COUNTED", 0)
        assert explain("j3").details["tenant_slot"]["position"] == "more than 0"
    assert second.details["waiting_seconds"] is not None
    slots.set_tenant_limit("acme", "q", 0)
    paused = explain("j3").details["tenant_slot"]
    assert paused["reason"] == "tenant 'acme' is paused on q (limit 0)"
    assert paused["limit"] == 0


def test_explain__parked_job__limit_shown_is_the_one_that_holds_it_back(
    process: uuid.UUID,
) -> None:
    """A tenant's slot row on a queue is shared by its tasks; a job waits for its own
    task's limit (it is woken only below it), whatever limit another task brought since."""
    acquire(process, "j1", limit=1)
    park("j2", limit=1)
    acquire(process, "big", limit=3)  # another task of the tenant, limit 3: it runs
    assert TenantQueueSlot.objects.get().current_jobs == 2
    entry = explain("j2").details["tenant_slot"]
    assert entry["limit"] == 1, entry["reason"]
    assert entry["reason"] == "tenant 'acme' runs 2 of its limit 1 on q"


def test_explain__parked_behind_a_queue_limit(process: uuid.UUID) -> None:
    queue_limits.set_limits("hooks", max_jobs=1)
    held = queue_store.try_acquire(
        queue="hooks", tenant=None, limit=5, task_id="h1", process_id=process, node_id=NODE
    )
    assert held.status == "held"
    outcome = queue_store.try_park(
        queue="hooks", tenant=None, limit=5, task_id="h2", task_name="t",
        signature=signature("h2"), node_id=NODE,
    )  # fmt: skip
    assert outcome == "parked"
    found = explain("h2")
    assert found.state == "parked"
    assert "tenant_slot" not in found.details
    assert found.details["queue_limit"] == {
        "position": 1,
        "held_by": ["h1"],
        "running": 1,
        "queue": "hooks",
        "max_jobs": 1,
        "max_jobs_per_worker": None,
        "reason": "queue hooks is at a limit (1 running, max_jobs 1, max_jobs_per_worker None)",
    }
    assert explain("h1").details["holding"] == [
        {"queue": "hooks", "running": 1, "max_jobs": 1, "max_jobs_per_worker": None}
    ]
    queue_limits.set_limits("hooks", max_jobs=0)
    assert explain("h2").details["queue_limit"]["reason"] == "queue hooks is paused (limit 0)"
    queue_limits.set_limits("hooks", max_jobs=2)  # room: h2 is woken (no place is reserved)
    woken = explain("h2")
    assert woken.state == "woken" and woken.details["woken_at"] is not None


def test_explain__woken_without_a_reservation__does_not_claim_one(process: uuid.UUID) -> None:
    """A job woken from a queue's line has no place reserved (the queue's wake reserves
    none, and a reaped reservation is gone): explain must not say it has one."""
    queue_limits.set_limits("hooks", max_jobs=0)
    outcome = queue_store.try_park(
        queue="hooks", tenant=None, limit=5, task_id="h1", task_name="t",
        signature=signature("h1"), node_id=NODE,
    )  # fmt: skip
    assert outcome == "parked"
    queue_limits.set_limits("hooks", max_jobs=1)
    found = explain("h1")
    assert found.state == "woken"
    assert not SlotLease.objects.filter(task_id="h1").exists()
    assert "reserved" not in found.summary, found.summary


def test_explain__queue_line_job_whose_tenant_has_room__blames_only_the_queue(
    process: uuid.UUID,
) -> None:
    """A job parked in a full queue's line while its tenant has room (0 of 5 running) is
    held back by the queue alone: its tenant slot is no reason it waits."""
    queue_limits.set_limits("hooks", max_jobs=1)
    # acme ran a job on the queue before: its slot row exists, with nothing running.
    earlier = queue_store.try_acquire(
        queue="hooks", tenant="acme", limit=5, task_id="a1", process_id=process, node_id=NODE
    )
    assert earlier.grant is not None
    assert queue_store.release(earlier.grant) is not None
    held = queue_store.try_acquire(
        queue="hooks", tenant="other", limit=5, task_id="h1", process_id=process, node_id=NODE
    )
    assert held.status == "held"
    outcome = queue_store.try_park(
        queue="hooks", tenant="acme", limit=5, task_id="h2", task_name="t",
        signature=signature("h2"), node_id=NODE,
    )  # fmt: skip
    assert outcome == "parked"
    found = explain("h2")
    assert found.state == "parked"
    assert found.details["queue_limit"]["reason"].startswith("queue hooks is at a limit")
    assert "tenant_slot" not in found.details, found.summary
    assert "tenant 'acme'" not in found.summary


def test_explain__pending_promoted_and_backpressure() -> None:
    tasks.PLAN_WEIGHTS["acme"] = 3
    old = tasks.planned.apply_async(("old",))
    report = planner.run(tasks.planned, due_only=False)
    assert report is not None and report.promoted == 1
    promoted = explain(old.id)
    assert promoted.state == "promoted"
    assert promoted.details["promoted_at"] is not None and promoted.details["queue"] == "fair"
    first = tasks.planned.apply_async(("acme",))
    second = tasks.planned.apply_async(("acme",))
    other = tasks.planned.apply_async(("zed",))
    found = explain(second.id)
    assert found.state == "pending"
    assert found.details["position_in_tenant_queue"] == 2
    assert explain(first.id).details["position_in_tenant_queue"] == 1
    assert found.details["tenant"] == "acme" and found.details["queue"] == "fair"
    assert found.details["tenant_weight"] == 3.0
    assert explain(other.id).details["tenant_weight"] == 1.0
    assert found.details["latency_threshold"] == 30
    assert found.details["backpressure"] is False
    assert found.details["last_promoted"] == 1 and found.details["promoted_not_started"] == 1
    assert "number 2" in found.summary and "holds back" not in found.summary
    # The promoted job has waited on the broker for long (above the threshold, not yet
    # presumed lost): the planner holds back.
    PlannedJob.objects.filter(task_id=old.id).update(
        promoted_at=timezone.now() - timedelta(minutes=10)
    )
    held = explain(second.id)
    assert held.details["backpressure"] is True
    assert held.details["queue_latency_seconds"] > 30
    assert "holds back" in held.summary
    PlannerTenant.objects.update_or_create(
        task_name=tasks.planned.name, tenant="acme", defaults={"paused": True}
    )
    paused = explain(second.id)
    assert paused.details["tenant_paused"] is True and "paused" in paused.summary


def test_explain__rerouted__rule_queue_and_count(broker_env: dict[str, str]) -> None:
    results = [tasks.rerouted.delay("acme") for _ in range(3)]
    # Within its rule nothing held it: it is found in the broker.
    first = explain(results[0].id)
    assert (first.state, first.details) == (
        "queued", {"queue": "fair", "ahead": 0, "consumed": False},
    )  # fmt: skip
    found = explain(results[2].id)
    assert found.state == "rerouted"
    assert found.details["to_queue"] == "fair_slow"
    assert found.details["count"] == 3
    assert (found.details["threshold"], found.details["per"], found.details["rule"]) == (2, 60, 1)
    assert (found.details["queue"], found.details["ahead"]) == ("fair_slow", 0)
    (decision,) = found.decisions
    assert (decision["mechanism"], decision["action"], decision["enforced"]) == (
        "reroute", "rerouted", True,
    )  # fmt: skip
    assert decision["tenant"] == "acme" and decision["queue"] == "fair"


def test_explain__unknown(broker_env: dict[str, str]) -> None:
    found = explain("no-such-job")
    assert (found.state, found.decisions) == ("unknown", [])
    # The queues are empty: it says so, not "not found in the oldest 0 message(s)".
    assert found.details["broker"].startswith("no message waits in ")
    assert "holds nothing" in found.summary and "until it ends" in found.summary


def test_explain__slots_job_in_the_broker__queue_and_messages_ahead(
    broker_env: dict[str, str],
) -> None:
    jobs = [tasks.limited3.delay(f"t{i}") for i in range(3)]
    found = explain(jobs[2].id)
    assert (found.state, found.details) == (
        "queued", {"queue": "fair", "ahead": 2, "consumed": False},
    )  # fmt: skip
    assert "on queue fair, 2 message(s) ahead" in found.summary
    assert explain(jobs[0].id).details["ahead"] == 0
    # Priorities: kombu's Redis transport delivers every message of priority 0 (the
    # default) before one of priority 9.
    urgent = tasks.limited3.apply_async(("t9",), priority=0)
    late = tasks.limited3.apply_async(("t8",), priority=9)
    assert explain(urgent.id).details["ahead"] == 3
    assert explain(late.id).details["ahead"] == 4


def test_explain__a_job_on_a_queue_only_its_publisher_knows__found__nobody_consumes_it(
    broker_env: dict[str, str],
) -> None:
    # Published by another process (a web request) to a queue no worker consumes yet and
    # this process's app never named: kombu's bindings on the broker name it.
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (
        "import django; django.setup()\n"
        "from tests.celery_app import app\n"
        "print(app.send_task('tests.testapp.tasks.limited3', ('acme',), "
        "queue='reports_nobody_reads').id)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=broker_env, capture_output=True,
        text=True, timeout=60, check=True,
    )  # fmt: skip
    found = explain(done.stdout.strip().splitlines()[-1])
    assert found.state == "queued"
    assert found.details == {"queue": "reports_nobody_reads", "ahead": 0, "consumed": False}
    assert "No live worker consumes reports_nobody_reads" in found.summary
    assert "-Q reports_nobody_reads" in found.summary


def test_broker_search__bounded__and_a_broker_that_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery import Celery

    from tests.celery_app import app

    redis.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()
    ids = [tasks.limited3.delay(f"t{i}").id for i in range(3)]
    within = broker.find(app, ids[1], ["default", "fair"], limit=2)
    assert (within.searchable, within.queue, within.ahead, within.read) == (True, "fair", 1, 2)
    beyond = broker.find(app, ids[2], ["default", "fair"], limit=2)
    assert (beyond.queue, beyond.read) == (None, 2)
    # The environment's CELERY_BROKER_URL would win over the app's own broker.
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    memory = Celery("memory", broker="memory://")
    assert broker.find(memory, ids[0], ["fair"]) == broker.Search(False, "memory", ("fair",))
    found = explain_with(memory, ids[0])
    assert found.state == "unknown"
    assert found.details["broker"] == (
        "memory: not searched (it cannot be read without taking messages)"
    )


def test_explain__broker_down__answers_from_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery

    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)  # it would win over the app's
    down = Celery("down", broker="redis://127.0.0.1:1/0")  # nothing listens on port 1
    found = explain_with(down, "no-such-job")
    assert (found.state, found.details) == ("unknown", {"broker": "not reachable"})


def explain_with(app: Any, task_id: str) -> Any:
    """Explain ``task_id`` with ``app`` as the current app."""
    app.set_current()
    try:
        return explain(task_id)
    finally:
        from tests.celery_app import app as tests_app

        tests_app.set_current()


def test_explain__ended__the_result_backends_state() -> None:
    from tests.celery_app import app

    task_id = str(uuid.uuid4())
    app.backend.mark_as_done(task_id, 42)
    found = explain(task_id)
    assert (found.state, found.details) == ("finished", {"result_state": "SUCCESS"})
    app.backend.forget(task_id)
    assert explain(task_id).state == "unknown"


def test_explain_command__json_and_text(process: uuid.UUID) -> None:
    acquire(process, "j1")
    park("j2")
    rerouted = [tasks.rerouted.delay("acme").id for _ in range(3)][-1]
    data = json.loads(command("fair_jobs_explain", "j2", "--json"))
    assert data["state"] == explain("j2").state == "parked"
    assert data["task_id"] == "j2"
    assert data["details"]["tenant_slot"]["held_by"] == ["j1"]
    pending = tasks.planned.apply_async(("acme",)).id
    both = json.loads(command("fair_jobs_explain", "j1", rerouted, pending, "--json"))
    assert [d["state"] for d in both] == ["running", "rerouted", "pending"]
    assert both[2]["details"]["position_in_tenant_queue"] == 1
    assert both[1]["decisions"][0]["detail"]["to_queue"] == "fair_slow"
    text = command("fair_jobs_explain", "j2", "no-such-job")
    assert "j2: parked" in text and "no-such-job: unknown" in text
    assert "number 1 in line" in text


# -- shadow mode -----------------------------------------------------------------------------


@pytest.fixture
def routing_keys() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """(routing key, headers) of every message published during the test."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def capture(routing_key: str = "", headers: Any = None, **kwargs: Any) -> None:
        seen.append((routing_key, dict(headers or {})))

    signals.before_task_publish.connect(capture, weak=False)
    yield seen
    signals.before_task_publish.disconnect(capture)


def test_shadow__reroute_recorded_not_done(routing_keys: list[tuple[str, dict[str, Any]]]) -> None:
    with override_settings(FAIR_JOBS_ENFORCE=False):
        ids = [tasks.rerouted.delay("acme").id for _ in range(3)]
    assert [key for key, _ in routing_keys] == ["fair", "fair", "fair"]
    decision = JobDecision.objects.get()
    assert decision.task_id == ids[2]
    assert (decision.mechanism, decision.action, decision.enforced) == ("reroute", "reroute", False)
    assert decision.detail["to_queue"] == "fair_slow" and decision.queue == "fair"
    found = explain(ids[2])
    assert found.state == "shadow"
    assert [d["enforced"] for d in found.decisions] == [False]
    assert "(shadow mode: not done)" in str(found)


def test_shadow__planned_job_published_at_once__hold_recorded(
    routing_keys: list[tuple[str, dict[str, Any]]],
) -> None:
    with override_settings(FAIR_JOBS_ENFORCE=False):
        result = tasks.planned.apply_async(("acme",))
        bulk = tasks.planned.bulk_enqueue([(("acme",), {}), (("zed",), {})])
    assert not PlannedJob.objects.exists()
    assert [key for key, _ in routing_keys] == ["fair"] * 3
    assert all(fair_headers.PLAN in headers for _, headers in routing_keys)
    held = JobDecision.objects.order_by("id")
    assert [d.task_id for d in held] == [result.id, *(r.id for r in bulk)]
    assert {(d.mechanism, d.action, d.enforced, d.queue) for d in held} == {
        ("planner", "hold", False, "fair")
    }
    assert [d.tenant for d in held] == ["acme", "acme", "zed"]
    assert explain(result.id).state == "shadow"


def test_enforce__read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # How the worker of the next test is switched to shadow mode.
    assert fair_settings.ENFORCE is True and decisions.enforcing()
    monkeypatch.setenv("FAIR_JOBS_ENFORCE", "false")
    assert fair_settings.ENFORCE is False and not decisions.enforcing()


@pytest.mark.workers
def test_shadow__real_worker__nothing_deferred_parked_rerouted_or_held__all_recorded(
    start_worker: Callable[..., Worker],
) -> None:
    queue_limits.set_limits("limited", max_jobs=1)
    worker = start_worker(
        "shadow", concurrency=3, queues="fair,fair_slow,limited",
        extra_env={"FAIR_JOBS_ENFORCE": "false"},
    )  # fmt: skip
    # An operator reading the worker's log learns that it enforces nothing.
    assert "Shadow mode (FAIR_JOBS_ENFORCE = False)" in worker.output()
    with override_settings(FAIR_JOBS_ENFORCE=False):
        crowd = [tasks.limited1.delay("acme", 0.8).id for _ in range(3)]  # limit 1
        wait_finished(crowd, timeout=60)
        greedy = [tasks.rerouted.delay("bob").id for _ in range(3)]  # threshold 2
        held = tasks.planned.delay("carol").id
        queued = [tasks.fair_limited.delay(t, 0.8).id for t in ("dan", "eve")]  # queue max 1
        wait_finished([*greedy, held, *queued], timeout=60)
    everything = [*crowd, *greedy, held, *queued]
    runs = list(JobRun.objects.values_list("task_id", flat=True))
    assert sorted(runs) == sorted(everything)  # each ran, once
    assert not ParkedJob.objects.exists() and not PlannedJob.objects.exists()
    # Tenant slot: the jobs ran beside each other; each beyond the limit was recorded.
    acme_runs = [
        (s, e)
        for s, e in JobRun.objects.filter(task_id__in=crowd).values_list(
            "started_at", "finished_at"
        )
        if e is not None
    ]
    overlap = max_overlap(acme_runs)
    assert overlap >= 2, "the tenant's limit was enforced in shadow mode"
    deferred = JobDecision.objects.filter(mechanism="slots")
    assert set(deferred.values_list("action", "enforced", "tenant", "queue")) == {
        ("defer", False, "acme", "fair")
    }
    assert deferred.count() >= overlap - 1
    assert set(deferred.values_list("task_id", flat=True)) <= set(crowd)
    # Queue limit: the same.
    queue_runs = [
        (s, e)
        for s, e in JobRun.objects.filter(task_id__in=queued).values_list(
            "started_at", "finished_at"
        )
        if e is not None
    ]
    assert max_overlap(queue_runs) == 2, "the queue's limit was enforced in shadow mode"
    queue_deferred = JobDecision.objects.filter(mechanism="queue_limit")
    assert set(queue_deferred.values_list("action", "enforced", "queue")) == {
        ("defer", False, "limited")
    }
    # Reroute: the job stayed on its queue; the rule's decision was recorded.
    assert (
        sorted(JobRun.objects.filter(task_id__in=greedy).values_list("queue", flat=True))
        == ["fair"] * 3
    )
    reroute = JobDecision.objects.get(mechanism="reroute")
    assert (reroute.task_id, reroute.action, reroute.enforced) == (greedy[2], "reroute", False)
    # Planner: published at once, its hold recorded.
    hold = JobDecision.objects.get(mechanism="planner")
    assert (hold.task_id, hold.action, hold.enforced) == (held, "hold", False)
    # Nothing was counted as a deferral, and every slot came back.
    wait_for(lambda: not SlotLease.objects.exists(), 20, "leases to be released")
    assert (
        list(TenantQueueSlot.objects.values_list("current_jobs", "parked_jobs"))
        == [(0, 0)] * TenantQueueSlot.objects.count()
    )
    assert not TenantQueueSlot.objects.filter(deferred_total__gt=0).exists()
    assert QueueLimit.objects.get(queue="limited").deferred_total == 0
    # Explain of a job recorded in shadow mode lists its decisions.
    some = deferred.values_list("task_id", flat=True).first()
    assert some is not None
    found = explain(some)
    assert found.state == "shadow" and found.decisions[0]["action"] == "defer"


# -- boosts and tenant limits ----------------------------------------------------------------


def test_boost__raises_the_limit_wakes_parked_jobs_records_history_and_ends_by_itself(
    process: uuid.UUID,
) -> None:
    acquire(process, "j1")
    park("j2")
    slots.set_tenant_limit("numbered", "q", 3)
    until = database_now() + timedelta(seconds=2)
    row = slots.boost("acme", "q", 2, until, user="ops")
    assert (row.max_jobs, row.boost_until, row.boost_restore) == (2, until, None)
    slots.boost("numbered", "q", 5, until)
    # The boost lets j2 start: it was woken, its slot reserved, and re-published.
    assert ParkedJob.objects.get(task_id="j2").woken_at is not None
    assert SlotLease.objects.filter(task_id="j2", process__isnull=True).exists()
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 2
    assert explain("j2").state == "reserved"
    note = f"boost until {until.isoformat()}"
    assert history() == [("python", "", "2", note)]
    assert LimitChange.objects.get(tenant="acme").user == "ops"
    # Nothing ends before its time.
    assert maintenance.run_maintenance(timeout=3600).boosts_ended == 0
    assert TenantQueueSlot.objects.get(tenant="acme").max_jobs == 2
    ended = wait_for(
        lambda: maintenance.run_maintenance(timeout=3600).boosts_ended, 10, "the boosts to end"
    )
    assert ended == 2
    acme, numbered = (TenantQueueSlot.objects.get(tenant=t) for t in ("acme", "numbered"))
    assert (acme.max_jobs, acme.boost_until, acme.boost_restore) == (None, None, None)
    assert (numbered.max_jobs, numbered.boost_until, numbered.boost_restore) == (3, None, None)
    assert history()[-1] == ("maintenance", "2", "", "boost ended")
    assert history("numbered")[-1] == ("maintenance", "5", "3", "boost ended")
    assert maintenance.run_maintenance(timeout=3600).boosts_ended == 0


def test_boost__of_a_boosted_tenant__keeps_the_override_to_put_back() -> None:
    slots.set_tenant_limit("acme", "q", 3)
    later = database_now() + timedelta(hours=1)
    slots.boost("acme", "q", 5, later)
    row = slots.boost("acme", "q", 8, later + timedelta(hours=1))
    assert (row.max_jobs, row.boost_restore) == (8, 3)
    assert TenantQueueSlot.objects.get().boost_restore == 3


def test_boost__past_naive_or_bad_limit__refused(process: uuid.UUID) -> None:
    with pytest.raises(slots.TenantLimitError, match="future"):
        slots.boost("acme", "q", 2, database_now() - timedelta(seconds=5))
    with pytest.raises(slots.TenantLimitError, match="aware"):
        slots.boost("acme", "q", 2, datetime.now() + timedelta(hours=1))
    with pytest.raises(slots.TenantLimitError, match="whole number"):
        slots.boost("acme", "q", -1, database_now() + timedelta(hours=1))
    with pytest.raises(slots.TenantLimitError, match="whole number"):
        slots.set_tenant_limit("acme", "q", True)
    assert not TenantQueueSlot.objects.exists() and not LimitChange.objects.exists()


def test_set_tenant_limit__ends_a_boost_early() -> None:
    slots.boost("acme", "q", 4, database_now() + timedelta(hours=1))
    row = slots.set_tenant_limit("acme", "q", 2, user="ops", source="admin")
    assert (row.max_jobs, row.boost_until, row.boost_restore) == (2, None, None)
    stored = TenantQueueSlot.objects.get()
    assert (stored.max_jobs, stored.boost_until, stored.boost_restore) == (2, None, None)
    assert history()[-1] == ("admin", "4", "2", "boost ended early")
    assert maintenance.run_maintenance(timeout=3600).boosts_ended == 0
    assert TenantQueueSlot.objects.get().max_jobs == 2


def test_limit_command__tenant_max_jobs_default_and_boost() -> None:
    out = command("fair_jobs_limit", "q", "--tenant", "acme", "--max-jobs", "4")
    assert "acme on q: max_jobs 4" in out
    assert TenantQueueSlot.objects.get().max_jobs == 4
    out = command("fair_jobs_limit", "q", "--tenant", "acme", "--max-jobs", "default")
    assert "the task's default" in out
    assert TenantQueueSlot.objects.get().max_jobs is None
    before = database_now()
    out = command("fair_jobs_limit", "q", "--tenant", "acme", "--boost", "6", "--for", "60")
    assert "boosted until" in out
    row = TenantQueueSlot.objects.get()
    assert row.max_jobs == 6 and row.boost_until is not None
    assert timedelta(seconds=55) < row.boost_until - before < timedelta(seconds=65)
    until = (database_now() + timedelta(hours=2)).replace(microsecond=0)
    command(
        "fair_jobs_limit", "q", "--tenant", "acme", "--boost", "7", "--until", until.isoformat()
    )
    assert TenantQueueSlot.objects.get().boost_until == until
    shown = command("fair_jobs_limit", "q", "--tenant", "acme")
    assert "max_jobs 7" in shown and "boosted until" in shown
    changes = history()
    assert [change[:3] for change in changes] == [
        ("command", "", "4"), ("command", "4", ""), ("command", "", "6"), ("command", "6", "7"),
    ]  # fmt: skip
    assert [change[3] for change in changes[:2]] == ["", ""]
    assert changes[3][3] == f"boost until {until.isoformat()}"
    assert command("fair_jobs_limit", "q", "--tenant", "nobody").startswith("nobody on q: no slot")


@pytest.mark.parametrize(
    "args",
    [
        ["q", "--tenant", "acme", "--max-jobs", "8", "--for", "3600"],
        ["q", "--tenant", "acme", "--max-jobs", "8", "--until", "2099-01-01T00:00+00:00"],
        ["q", "--tenant", "acme", "--per-worker", "0"],
        ["q", "--tenant", "acme", "--clear"],
    ],
)
def test_limit_command__options_that_do_not_apply_to_a_tenant__refused(args: list[str]) -> None:
    """An option the tenant path would ignore is refused, not dropped: "--max-jobs 8 --for
    3600" must not raise the limit for good, nor "--per-worker 0" leave the queue running."""
    with pytest.raises(CommandError):
        call_command("fair_jobs_limit", *args, stdout=StringIO())
    assert not LimitChange.objects.exists()
    assert not QueueLimit.objects.exists()
    assert not TenantQueueSlot.objects.filter(max_jobs__isnull=False).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["q", "--tenant", "acme", "--max-jobs", "-2"], "whole number from 0"),
        (["q", "--tenant", "acme", "--max-jobs", "lots"], "whole number from 0"),
        (["q", "--tenant", "acme", "--boost", "3"], "--for SECONDS or --until"),
        (["q", "--tenant", "acme", "--boost", "x", "--for", "5"], "whole number from 0"),
        (["q", "--tenant", "acme", "--boost", "3", "--for", "-5"], "must end in the future"),
        (["q", "--tenant", "acme", "--boost", "3", "--until", "soon"], "ISO time"),
        (
            ["q", "--tenant", "acme", "--boost", "3", "--until", "2099-01-01T00:00"],
            "with its time zone",
        ),
        (["q", "--tenant", "acme", "--boost", "3", "--max-jobs", "2"], "cannot be combined"),
        (["--tenant", "acme", "--max-jobs", "2"], "Name the QUEUE"),
        (["q", "--boost", "2", "--for", "5"], "needs --tenant"),
    ],
)
def test_limit_command__bad_tenant_values__helpful_command_error(
    args: list[str], message: str
) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("fair_jobs_limit", *args, stdout=StringIO())
    assert not LimitChange.objects.exists()
    assert not TenantQueueSlot.objects.filter(max_jobs__isnull=False).exists()


# -- status ----------------------------------------------------------------------------------


def test_jain_index() -> None:
    assert status.jain_index([1, 1, 1]) == 1.0
    assert status.jain_index([1, 0, 0]) == pytest.approx(1 / 3, abs=1e-4)
    assert status.jain_index([]) is None
    assert status.jain_index([0, 0]) == 1.0
    assert status.jain_index([3, 1]) == pytest.approx(16 / 20, abs=1e-4)


def test_status_command__json_tenants_queues_nodes_fairness_totals(process: uuid.UUID) -> None:
    acquire(process, "a1", limit=2)
    until = database_now() + timedelta(hours=1)
    slots.boost("acme", "q", 4, until)
    acquire(process, "s1", tenant="slow")
    park("s2", tenant="slow")
    ParkedJob.objects.filter(task_id="s2").update(parked_at=database_now() - timedelta(seconds=100))
    queue_limits.set_limits("hooks", max_jobs=2, max_jobs_per_worker=1)
    decisions.record(task_id="r1", task_name="t", tenant="acme", queue="q",
                     mechanism="reroute", action="rerouted")  # fmt: skip
    data = json.loads(command("fair_jobs_status", "--json"))
    assert data["enforce"] is True
    by_tenant = {t["tenant"]: t for t in data["tenants"]}
    assert sorted(by_tenant) == ["acme", "slow"]
    (acme_slot,) = by_tenant["acme"]["queues"]
    assert acme_slot == {
        "queue": "q", "running": 1, "waiting": 0, "limit": 4, "limit_source": "boost",
        "override": 4, "paused": False, "queue_paused": False, "parked": 0,
        "deferred_total": 0, "boosted_until": until.isoformat(), "holds": None,
    }  # fmt: skip
    assert by_tenant["acme"]["reroutes_last_hour"] == 1
    slow = by_tenant["slow"]
    assert (slow["running"], slow["parked"], slow["pending"]) == (1, 1, 0)
    assert slow["queues"][0]["limit"] == 1 and slow["queues"][0]["deferred_total"] == 1
    assert slow["oldest_wait_seconds"] >= 100
    (queue,) = data["queues"]
    assert (queue["queue"], queue["max_jobs"], queue["max_jobs_per_worker"]) == ("hooks", 2, 1)
    (node,) = data["nodes"]
    assert (node["node"], node["hostname"], node["processes"], node["alive"]) == (
        "n1@host", "host", 1, True,
    )  # fmt: skip
    assert node["node_id"] == str(NODE)
    # acme waits 0 s, slow ~100 s: Jain's index of [0, x] is 1/2.
    assert data["fairness"] == {"jain_index": 0.5, "small_tenants": 2}
    totals = data["totals"]
    assert totals["leases_reaped_total"] == 0
    assert totals["tenant_deferrals_total"] == 1 and totals["queue_deferrals_total"] == 0
    assert totals["decisions_last_hour"] == [
        {"mechanism": "reroute", "action": "rerouted", "enforced": True, "n": 1}
    ]
    text = command("fair_jobs_status")
    assert "SHADOW MODE" not in text
    assert "acme: running q 1/4 (boosted until" in text
    assert "n1@host (host): 1 process(es)" in text and "alive" in text
    assert "fairness: Jain's index 0.500 over 2 small tenant(s)" in text
    with override_settings(FAIR_JOBS_ENFORCE=False):
        shadow = command("fair_jobs_status")
        assert json.loads(command("fair_jobs_status", "--json"))["enforce"] is False
    assert "SHADOW MODE" in shadow.splitlines()[0]


def test_status__nothing_going_on() -> None:
    data = status.snapshot()
    assert data["tenants"] == [] and data["queues"] == [] and data["nodes"] == []
    assert data["fairness"] == {"jain_index": None, "small_tenants": 0}
    text = status.as_text(data)
    assert "tenants: none active" in text and "nodes: no worker has registered" in text


def test_status__first_tenants_in_rank_order__fairness_and_count_over_all(
    process: uuid.UUID,
) -> None:
    acquire(process, "r1", tenant="runner", limit=2)
    acquire(process, "r2", tenant="runner", limit=2)
    for tenant, n, age_s in (("old", 1, 300), ("deep", 4, 30)):
        acquire(process, f"{tenant}-run", tenant=tenant)
        for i in range(n):
            park(f"{tenant}-{i}", tenant=tenant)
        ParkedJob.objects.filter(slot__tenant=tenant).update(
            parked_at=database_now() - timedelta(seconds=age_s)
        )
    everyone = status.snapshot()
    assert [t["tenant"] for t in everyone["tenants"]] == ["deep", "old", "runner"]
    by_wait = status.snapshot(first=2, rank="wait")
    assert [t["tenant"] for t in by_wait["tenants"]] == ["old", "deep"]
    assert by_wait["tenants"][0]["queues"][0]["queue"] == "q"
    by_backlog = status.snapshot(first=1, rank="backlog")
    assert [t["tenant"] for t in by_backlog["tenants"]] == ["deep"]
    assert by_backlog["tenants"][0]["parked"] == 4
    # The count and the index are over every active tenant, not the page shown.
    assert everyone["tenants_active"] == by_wait["tenants_active"] == 3
    assert everyone["fairness"] == status.fairness(everyone["tenants"])
    for page in (by_wait, by_backlog):
        assert page["fairness"]["small_tenants"] == everyone["fairness"]["small_tenants"] == 3
        # Each snapshot reads the waits at its own instant: the index moves with the clock.
        assert page["fairness"]["jain_index"] == pytest.approx(
            everyone["fairness"]["jain_index"], abs=0.01
        )
    with pytest.raises(ValueError, match="rank must be one of name, wait, backlog"):
        status.snapshot(rank="size")


# -- health check ----------------------------------------------------------------------------


def test_healthcheck__all_ok() -> None:
    lines = command("fair_jobs_healthcheck").splitlines()
    assert [line.split(" ")[:2] for line in lines] == [
        ["database", "OK"], ["migrations", "OK"], ["settings", "OK"], ["heartbeats", "OK"],
    ]  # fmt: skip
    assert lines[3] == "heartbeats OK (0 live node(s))"


def test_healthcheck__require_workers__fails_without_a_live_node_passes_with_one() -> None:
    out = StringIO()
    with pytest.raises(CommandError, match="health check failed: heartbeats"):
        call_command("fair_jobs_healthcheck", "--require-workers", stdout=out)
    assert "heartbeats FAILED: no worker node" in out.getvalue()
    assert "database OK" in out.getvalue()
    pid = uuid.uuid4()
    identity.register_process(process_id=pid, node="n@h", hostname="h", pid=1)
    assert "heartbeats OK (1 live node(s))" in command("fair_jobs_healthcheck", "--require-workers")
    WorkerProcess.objects.filter(pk=pid).update(last_heartbeat_at=OLD)
    with pytest.raises(CommandError):
        call_command("fair_jobs_healthcheck", "--require-workers", stdout=out)
    assert "1 presumed dead" in command("fair_jobs_healthcheck")


def test_healthcheck__bad_setting__settings_failed() -> None:
    out = StringIO()
    with (
        override_settings(FAIR_JOBS_DEFAULT_MAX_JOBS=0),
        pytest.raises(CommandError, match="health check failed: settings"),
    ):
        call_command("fair_jobs_healthcheck", stdout=out)
    text = out.getvalue()
    assert "settings FAILED: fair_jobs.E001" in text
    assert "database OK" in text and "heartbeats OK" in text


def test_healthcheck__exit_status_from_the_shell(broker_env: dict[str, str]) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "django", "fair_jobs_healthcheck", *args],
            cwd=ROOT, env=broker_env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    ok = run()
    assert ok.returncode == 0, ok.stderr
    failed = run("--require-workers")
    assert failed.returncode != 0
    assert "heartbeats FAILED" in failed.stdout and "health check failed" in failed.stderr


# -- maintenance -----------------------------------------------------------------------------


def test_maintenance__prunes_decisions_past_the_retention() -> None:
    for task_id in ("old", "new"):
        decisions.record(task_id=task_id, task_name="t", tenant="acme", queue="q",
                         mechanism="reroute", action="rerouted")  # fmt: skip
    JobDecision.objects.filter(task_id="old").update(
        at=database_now() - timedelta(seconds=86_400 + 60)
    )
    report = maintenance.run_maintenance()
    assert report.decisions_pruned == 1
    assert list(JobDecision.objects.values_list("task_id", flat=True)) == ["new"]
    with override_settings(FAIR_JOBS_DECISION_RETENTION=3600):
        JobDecision.objects.update(at=database_now() - timedelta(hours=2))
        assert decisions.prune() == 1
    assert not JobDecision.objects.exists()


def test_maintenance__counts_reaped_leases(process: uuid.UUID) -> None:
    dead = uuid.uuid4()
    identity.register_process(process_id=dead, node="dead@h", hostname="h", pid=2)
    acquire(dead, "d1")
    acquire(dead, "d2", tenant="other")
    acquire(process, "live", tenant="third")
    WorkerProcess.objects.filter(pk=dead).update(last_heartbeat_at=OLD)
    SlotLease.objects.filter(process_id=dead).update(acquired_at=OLD)
    assert maintenance.run_maintenance().leases_reaped == 2
    assert Maintenance.objects.get(name="reaped").leases_reaped_total == 2
    assert list(SlotLease.objects.values_list("task_id", flat=True)) == ["live"]
    again = uuid.uuid4()
    identity.register_process(process_id=again, node="dead@h", hostname="h", pid=3)
    acquire(again, "d3")
    WorkerProcess.objects.filter(pk=again).update(last_heartbeat_at=OLD)
    SlotLease.objects.filter(process_id=again).update(acquired_at=OLD)
    assert maintenance.run_maintenance().leases_reaped == 1
    assert Maintenance.objects.get(name="reaped").leases_reaped_total == 3
    assert status.snapshot()["totals"]["leases_reaped_total"] == 3


# -- system checks ---------------------------------------------------------------------------


def check_ids(**overrides: Any) -> list[str]:
    with override_settings(**overrides):
        return [m.id for m in check_settings() if m.id]


@pytest.mark.parametrize(
    "overrides",
    [
        {"FAIR_JOBS_ENFORCE": "no"},
        {"FAIR_JOBS_ENFORCE": 0},
        {"FAIR_JOBS_DECISION_RETENTION": 3599},
        {"FAIR_JOBS_DECISION_RETENTION": 86_400.0},
        {"FAIR_JOBS_DECISION_RETENTION": True},
        {"FAIR_JOBS_DASHBOARD_REFRESH": -1},
        {"FAIR_JOBS_DASHBOARD_REFRESH": 2.5},
        {"FAIR_JOBS_DASHBOARD_REFRESH": "10"},
    ],
)
def test_check_e017__bad_operations_settings(overrides: dict[str, Any]) -> None:
    assert check_ids(**overrides) == ["fair_jobs.E017"]


def test_check_e017__good_values_pass() -> None:
    assert (
        check_ids(
            FAIR_JOBS_ENFORCE=False,
            FAIR_JOBS_DECISION_RETENTION=3600,
            FAIR_JOBS_DASHBOARD_REFRESH=0,
        )
        == []
    )


def test_explanation__as_dict_and_text() -> None:
    found = Explanation("x", "parked", "Parked.", {"holding": [], "n": None})
    assert found.as_dict() == {
        "task_id": "x", "state": "parked", "summary": "Parked.",
        "details": {"holding": [], "n": None}, "decisions": [],
    }  # fmt: skip
    assert str(found) == "x: parked\n  Parked.\n  holding: -\n  n: -"

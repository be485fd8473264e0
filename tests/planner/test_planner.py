"""The fair planner: allocation, virtual queues and promotion against the real database."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import headers as fair_headers
from django_fair_jobs import planner
from django_fair_jobs.models import PlannedJob, PlannerRun, PlannerTenant
from django_fair_jobs.planner import store as planner_store
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]

PLAN: dict[str, Any] = dict(tasks.planned.fair_plan or {})


@pytest.fixture(autouse=True)
def weights(broker_env: dict[str, str]) -> Iterator[dict[str, float]]:
    tasks.PLAN_WEIGHTS.clear()
    yield tasks.PLAN_WEIGHTS
    tasks.PLAN_WEIGHTS.clear()


def run_planner() -> planner.RunReport:
    report = planner.run(tasks.planned, due_only=False)
    assert report is not None
    return report


def promoted_by_tenant() -> Counter[str]:
    return Counter(
        PlannedJob.objects.filter(promoted_at__isnull=False).values_list("tenant", flat=True)
    )


def test_allocate__shares_converge_to_weights_with_memory_across_runs() -> None:
    passes: dict[str, float] = {}
    vtime, total = 0.0, Counter[str]()
    for _ in range(10):  # budgets of 100, smaller than any backlog
        out = planner.allocate({"a": 1000, "b": 1000, "c": 1000}, {"a": 1, "b": 3, "c": 6},
                               passes, vtime, 100)  # fmt: skip
        passes, vtime = out.passes, out.virtual_time
        total.update(out.counts)
    assert abs(total["a"] - 100) <= 1 and abs(total["b"] - 300) <= 1 and abs(total["c"] - 600) <= 1


def test_allocate__weight_one_among_hundreds__waits_at_most_the_documented_bound() -> None:
    weights = {f"big{i}": 100.0 for i in range(10)} | {"small": 1.0}
    pending = {tenant: 10_000 for tenant in weights}
    bound = planner.wait_bound(1.0, list(weights.values()), 10)
    passes: dict[str, float] = {}
    vtime = 0.0
    # The big tenants ran for a long time before the small one's job came due.
    for _ in range(50):
        out = planner.allocate({t: n for t, n in pending.items() if t != "small"}, weights,
                               passes, vtime, 10)  # fmt: skip
        passes, vtime = out.passes, out.virtual_time
    waited = 0
    while True:
        waited += 1
        out = planner.allocate(pending, weights, passes, vtime, 10)
        passes, vtime = out.passes, out.virtual_time
        if out.counts.get("small"):
            break
        assert waited < bound, f"the small tenant waited more than {bound} runs"
    assert 1 <= waited <= bound


def test_planned_shares__one_three_six__within_five_percent(weights: dict[str, float]) -> None:
    weights.update({"a": 1, "b": 3, "c": 6})
    for tenant in ("a", "b", "c"):
        tasks.planned.bulk_enqueue([((tenant,), {}) for _ in range(1000)])
    for _ in range(10):  # 10 runs of 100 while every tenant is backlogged
        run_planner()
    shares = promoted_by_tenant()
    assert sum(shares.values()) == 1000
    for tenant, share in (("a", 100), ("b", 300), ("c", 600)):
        assert abs(shares[tenant] - share) <= share * 0.05, shares
    # Memory: the passes are stored, not recomputed per run.
    assert PlannerTenant.objects.filter(task_name=tasks.planned.name).count() == 3


def test_budget__never_more_than_enqueue_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks.planned, "fair_plan", {**PLAN, "enqueue_jobs": 1})
    tasks.planned.delay("a")
    tasks.planned.delay("b")
    assert run_planner().promoted == 1
    assert PlannedJob.objects.filter(promoted_at__isnull=True).count() == 1


def test_weights__zero_and_missing_never_promoted__all_zero_promotes_nothing(
    weights: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    weights.update({"zero": 0})
    for tenant in ("zero", "one"):
        tasks.planned.delay(tenant)
    assert run_planner().counts == {"one": 1}
    assert PlannedJob.objects.get(tenant="zero").promoted_at is None
    monkeypatch.setattr(tasks, "plan_weights", lambda tenants: {})
    monkeypatch.setattr(tasks.planned, "fair_plan", {**PLAN, "tenant_weights": lambda t: {}})
    assert run_planner().promoted == 0  # nobody has a weight: nothing is promoted
    assert PlannedJob.objects.get(tenant="zero").promoted_at is None


def test_weights_callable__receives_only_tenants_with_jobs_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[list[str]] = []

    def spy(tenants: list[str]) -> dict[str, float]:
        seen.append(sorted(tenants))
        return {t: 1 for t in tenants}

    monkeypatch.setattr(tasks.planned, "fair_plan", {**PLAN, "tenant_weights": spy})
    tasks.planned.delay("due")
    tasks.planned.apply_async(("later",), countdown=3600)
    run_planner()
    assert seen == [["due"]]


def test_intercepted_job__keeps_task_id_and_options__nothing_on_the_broker_until_promoted(
    celery_app: Any,
) -> None:
    from celery.signals import before_task_publish

    sent: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any], routing_key: str, **kw: Any) -> None:
        sent.append({"id": headers["id"], "queue": routing_key, "headers": headers})

    before_task_publish.connect(capture, weak=False)
    try:
        result = tasks.planned.apply_async(
            ("acme",), task_id="planned-1", queue="other", priority=5, headers={"x": 1}
        )
        assert result.id == "planned-1" and result.state == "PENDING"
        assert sent == []
        row = PlannedJob.objects.get(task_id="planned-1")
        assert (row.tenant, row.queue) == ("acme", "other")
        run_planner()
    finally:
        before_task_publish.disconnect(capture)
    ((message,),) = [sent]
    assert message["id"] == "planned-1" and message["queue"] == "other"
    assert message["headers"]["x"] == 1 and message["headers"][fair_headers.PLAN] == 1
    assert PlannedJob.objects.get(task_id="planned-1").promoted_at is not None


def test_countdown__not_promoted_before_it_is_due() -> None:
    tasks.planned.apply_async(("acme",), countdown=3600)
    assert run_planner().promoted == 0
    PlannedJob.objects.update(not_before=PlannedJob.objects.get().enqueued_at)
    assert run_planner().promoted == 1


def test_bulk_enqueue__one_insert() -> None:
    with CaptureQueriesContext(connection) as queries:
        results = tasks.planned.bulk_enqueue(
            [(("a",), {}), (("b",), {"duration": 0}), (("a",), {})]
        )
    inserts = [q for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1
    assert sorted(PlannedJob.objects.values_list("task_id", flat=True)) == sorted(
        r.id for r in results
    )


def test_no_tenant__never_refused__its_own_virtual_queue__or_the_default_tenant(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from django_fair_jobs import tenants

    tenants._last_warned.clear()
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs"):
        tasks.planned.delay(None)
        tasks.planned.delay(None)
    assert list(PlannedJob.objects.values_list("tenant", flat=True)) == ["", ""]
    said = [r.getMessage() for r in caplog.records if "without a tenant" in r.getMessage()]
    assert len(said) == 1 and "FAIR_JOBS_DEFAULT_TENANT" in said[0]
    assert run_planner().counts == {"": 2}  # promoted as one more tenant
    settings.FAIR_JOBS_DEFAULT_TENANT = "shared"
    tasks.planned.delay(None)
    assert PlannedJob.objects.filter(promoted_at__isnull=True).get().tenant == "shared"


@pytest.mark.parametrize(("age", "promotes"), [(30.0, True), (30.001, False)])
def test_backpressure__strictly_above_the_threshold_skips(
    age: float, promotes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_fair_jobs import db

    tasks.planned.delay("old")
    run_planner()  # promoted, never started: the queue's latency grows
    promoted_at = PlannedJob.objects.get().promoted_at
    assert promoted_at is not None
    monkeypatch.setattr(
        db, "database_now", lambda alias="default": promoted_at + timedelta(seconds=age)
    )
    tasks.planned.delay("new")
    report = run_planner()
    assert report.latency == pytest.approx(age) and report.depth == 1
    assert report.skipped_for_backpressure is not promotes
    assert report.promoted == (1 if promotes else 0)


def test_crash_between_publish_and_mark__the_next_run_publishes_them_again() -> None:
    for _ in range(3):
        tasks.planned.delay("acme")
    published: list[str] = []

    def flaky(row: PlannedJob) -> None:
        published.append(row.task_id)
        if len(published) == 2:
            raise ConnectionError("broker gone mid-run")

    with pytest.raises(ConnectionError):
        planner_store.promote(tasks.planned.name, "acme", 3, flaky)
    assert PlannedJob.objects.filter(promoted_at__isnull=True).count() == 3  # nothing lost
    again = planner_store.promote(tasks.planned.name, "acme", 3, lambda row: None)
    assert again[:2] == published  # the same task ids: the duplicate is detectable


def test_two_planners_at_once__never_duplicate_or_lose_a_job() -> None:
    for _ in range(40):
        tasks.planned.delay("acme")
    promoted: list[list[str]] = [[], []]
    barrier = threading.Barrier(2)

    def planner_run(slot: int) -> None:
        barrier.wait()
        for _ in range(5):
            promoted[slot] += planner_store.promote(
                tasks.planned.name, "acme", 10, lambda row: time.sleep(0.005)
            )
        connection.close()

    threads = [threading.Thread(target=planner_run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = promoted[0] + promoted[1]
    assert len(everything) == len(set(everything)) == 40


def test_planner_lock__one_run_at_a_time() -> None:
    tasks.planned.delay("acme")
    token = planner_store.claim_run(tasks.planned.name, interval=0, lock_ttl=60)
    assert token is not None
    assert planner.run(tasks.planned) is None  # the lock is held
    planner_store.finish_run(tasks.planned.name, token)
    assert planner.run(tasks.planned) is not None


def test_retry_of_a_promoted_job__not_planned_again() -> None:
    # A promoted job's re-publish (retry, wake-up) carries the header: straight through.
    result = tasks.planned.apply_async(("acme",), headers={fair_headers.PLAN: 1})
    assert not PlannedJob.objects.filter(task_id=result.id).exists()


def test_paused_tenant__kept_but_not_promoted() -> None:
    tasks.planned.delay("held")
    tasks.planned.delay("free")
    PlannerTenant.objects.create(task_name=tasks.planned.name, tenant="held", paused=True)
    assert run_planner().counts == {"free": 1}


def test_command_and_status(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    tasks.planned.delay("acme")
    tasks.planned.delay("acme")
    call_command("fair_jobs_status", "--json")
    data = json.loads(capsys.readouterr().out)
    # Other planned tasks of the suite (the chaos workload's) are listed too, with nothing due.
    (plan,) = [p for p in data["planners"] if p["task"] == tasks.planned.name]
    assert plan["tenants"][0]["tenant"] == "acme" and plan["tenants"][0]["pending"] == 2
    assert plan["tenants"][0]["oldest_pending_seconds"] is not None
    call_command("fair_jobs_plan", tasks.planned.name)
    assert "promoted 2 job(s)" in capsys.readouterr().out
    assert PlannerRun.objects.get().last_promoted == 2


def test_status__first_tenants__longest_waits__the_rest_counted() -> None:
    from django_fair_jobs.db import database_now

    for tenant, n, age_s in (("calm", 1, 10), ("deep", 3, 60), ("old", 1, 600)):
        for _ in range(n):
            tasks.planned.delay(tenant)
        PlannedJob.objects.filter(tenant=tenant).update(
            enqueued_at=database_now() - timedelta(seconds=age_s)
        )
    PlannerTenant.objects.create(task_name=tasks.planned.name, tenant="old", paused=True)
    (page,) = [p for p in planner.status(first=2) if p["task"] == tasks.planned.name]
    assert [t["tenant"] for t in page["tenants"]] == ["old", "deep"]
    assert page["tenants"][0]["paused"] is True and page["tenants"][1]["pending"] == 3
    assert page["tenants_total"] == 3
    (whole,) = [p for p in planner.status() if p["task"] == tasks.planned.name]
    assert [t["tenant"] for t in whole["tenants"]] == ["calm", "deep", "old"]
    assert whole["tenants_total"] == 3 and whole["tenants"][2]["paused"] is True


def test_allocate__publishes_in_the_order_the_draw_served() -> None:
    # The greedy tenant was served last (its pass is one step past the virtual time): the
    # newcomer, entering at the virtual time, is served first and its jobs go out first.
    out = planner.allocate({"greedy": 100, "new": 2}, {"greedy": 1, "new": 1},
                           {"greedy": 51.0}, 50.0, 10)  # fmt: skip
    assert out.order == ("new", "greedy") and out.counts == {"new": 2, "greedy": 8}


def test_plan_without_enqueue_interval__one_run_a_second() -> None:
    # A long interval delays every job on idle workers by up to that long; the default
    # keeps that wait under a second.
    plan = planner.parse_plan({"enqueue_jobs": 10})
    assert plan.enqueue_interval == planner.plans.DEFAULT_ENQUEUE_INTERVAL == 1.0
    assert planner.parse_plan({"enqueue_jobs": 10, "enqueue_interval": 30}).enqueue_interval == 30

"""Sliding-window rerouting: the FT timeline on the counting statement, publish-time
routing and its exclusions, exact counts under concurrency, pruning; each on both of the
store's paths (the ``engine`` fixture). Real workers are in ``test_workers.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import signals
from django.db import connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import FairTask
from django_fair_jobs.checks import check_task_rules
from django_fair_jobs.headers import WINDOW as HEADER
from django_fair_jobs.models import JobDecision, RerouteCount, TenantWindow, WindowBucket
from django_fair_jobs.reroute import RuleError, parse_rules, prune
from django_fair_jobs.reroute import store as reroute_store
from django_fair_jobs.reroute.store import Recorded
from tests.conftest import runs_sql
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
DAY, HOUR = 86_400, 3_600


def record(
    tenant: str,
    at: datetime,
    rules: list[tuple[int, int, str]],
    key: str = "task:t",
) -> Recorded:
    return reroute_store.record(key=key, tenant=tenant, task_name="t", rules=rules, at=at)


def picked(recorded: Recorded, rules: list[tuple[int, int, str]]) -> str:
    return "default" if recorded.rule is None else rules[recorded.rule][2]


# -- the counting statement, on fixed timestamps -------------------------------------------


def test_ft09__first_n_stay__job_n_plus_one_is_rerouted() -> None:
    rules = [(60, 3, "slow")]
    queues = [picked(record("acme", T0, rules), rules) for _ in range(5)]
    assert queues == ["default", "default", "default", "slow", "slow"]


def test_ft17__decay_timeline__last_matching_rule_wins() -> None:
    rules = [(DAY, 1, "semislow"), (HOUR, 1, "supaslow")]
    first, second = record("foo", T0, rules), record("foo", T0, rules)
    assert (picked(first, rules), first.counts) == ("default", (1, 1))
    assert (picked(second, rules), second.counts) == ("supaslow", (2, 2))
    # FT-15: another tenant is independent.
    assert picked(record("bar", T0, rules), rules) == "default"
    later = T0 + timedelta(hours=1, seconds=1)
    third = record("foo", later, rules)
    assert (picked(third, rules), third.counts) == ("semislow", (3, 1))
    fourth = record("foo", later + timedelta(days=1, seconds=1), rules)
    assert (picked(fourth, rules), fourth.counts) == ("default", (1, 1))


def test_window__whole_seconds_both_ends_included() -> None:
    rules = [(10, 100, "slow")]
    record("acme", T0, rules)
    assert record("acme", T0 + timedelta(seconds=10.9), rules).counts == (2,)
    assert record("acme", T0 + timedelta(seconds=11), rules).counts == (2,)
    assert record("acme", T0 + timedelta(seconds=22), rules).counts == (1,)


def test_window__counting_keys_are_independent() -> None:
    rules = [(60, 1, "slow")]
    assert record("acme", T0, rules, key="task:a").counts == (1,)
    assert record("acme", T0, rules, key="task:b").counts == (1,)
    assert record("acme", T0, rules, key="task:a").counts == (2,)


def test_window__clock_going_back_counts_in_the_latest_second() -> None:
    rules = [(5, 100, "slow")]
    record("acme", T0 + timedelta(seconds=10), rules)
    assert record("acme", T0, rules).counts == (2,)
    window = TenantWindow.objects.get(tenant="acme")
    assert window.last_second == int((T0 + timedelta(seconds=10)).timestamp())


def test_reroutes__counted_per_tenant_task_and_queue() -> None:
    rules = [(60, 1, "slow")]
    for _ in range(4):
        record("acme", T0, rules)
    row = RerouteCount.objects.get()
    assert (row.tenant, row.task_name, row.queue, row.total) == ("acme", "t", "slow", 3)


@override_settings(FAIR_JOBS_REROUTE_MAX_WINDOW=100)
def test_prune__old_buckets_go__one_anchor_kept__counts_unchanged() -> None:
    rules = [(100, 1000, "slow")]
    # Enqueues every 10 s from 305 s ago to 15 s ago; the cutoff is 100 s ago (200 + 5).
    base = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=305)
    for offset in range(0, 300, 10):
        record("acme", base + timedelta(seconds=offset), rules)
    record("other", base, rules)  # an idle tenant, pruned whole
    assert prune() == 1
    first = int(base.timestamp())
    kept = sorted(WindowBucket.objects.values_list("second", flat=True))
    # The anchor (the newest bucket before the cutoff), then the ones after it.
    assert kept == [first + offset for offset in range(200, 300, 10)]
    # A window of the maximum length still counts exactly: offsets 210..290 and now.
    assert reroute_store.record(key="task:t", tenant="acme", task_name="t", rules=rules).counts == (
        10,
    )


def test_prune__idle_tenant_leaves_nothing_behind() -> None:
    rules = [(60, 0, "slow")]
    record("idle", datetime.now(UTC) - timedelta(days=2), rules)
    record("active", datetime.now(UTC), rules)
    assert RerouteCount.objects.count() == 2
    RerouteCount.objects.filter(tenant="idle").update(last_at=T0)
    assert prune() == 1
    assert list(TenantWindow.objects.values_list("tenant", flat=True)) == ["active"]
    assert not WindowBucket.objects.filter(window__tenant="idle").exists()
    assert list(RerouteCount.objects.values_list("tenant", flat=True)) == ["active"]


def test_concurrent_enqueues__every_count_exact() -> None:
    """16 threads x 25 enqueues for one tenant in one second: the answers are exactly
    1..400, each once, so no enqueue was lost or seen twice."""
    rules = [(DAY, 10_000, "slow")]
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def enqueue() -> None:
        try:
            for _ in range(25):
                n = record("hot", T0, rules).counts[0]
                with lock:
                    seen.append(n)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=enqueue) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert sorted(seen) == list(range(1, 401))
    assert TenantWindow.objects.get(tenant="hot").total == 400


def test_record__statements_do_not_grow_with_the_window__one_on_postgresql() -> None:
    rules = [(60, 10**6, "a"), (3600, 10**6, "b"), (DAY, 10**6, "c")]
    for second in range(5):
        record("acme", T0 + timedelta(seconds=second), rules)
    with CaptureQueriesContext(connection) as first:
        record("acme", T0 + timedelta(seconds=5), rules)
    for second in range(6, 600):
        record("acme", T0 + timedelta(seconds=second), rules)
    with CaptureQueriesContext(connection) as later:
        record("acme", T0 + timedelta(seconds=600), rules)
    assert len(later) == len(first)
    if runs_sql():
        assert len(first) == 1


# -- rules and scopes -----------------------------------------------------------------------


def test_rules__per_defaults_to_max_window_and_accepts_timedelta() -> None:
    rules = parse_rules(
        [{"queue": "a", "threshold": 1}, {"queue": "b", "threshold": 2, "per": timedelta(hours=1)}],
        DAY,
    )
    assert [(r.queue, r.threshold, r.per) for r in rules] == [("a", 1, DAY), ("b", 2, HOUR)]


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"queue": "a", "threshold": 1, "pre": 5}, "unknown keys pre"),
        ({"queue": "a", "threshold": 0}, "threshold must be"),
        ({"queue": "a", "threshold": 1, "per": 0}, "per must be"),
        ({"queue": "a", "threshold": 1, "per": 1.5}, "per must be"),
        ({"queue": "a", "threshold": 1, "per": DAY + 1}, "above FAIR_JOBS_REROUTE_MAX_WINDOW"),
        ({"threshold": 1}, "queue must be"),
        ({"queue": "a", "threshold": 1, "max_jobs": 0}, "max_jobs must be"),
    ],
)
def test_rules__invalid_rule_is_a_clear_error(rule: dict[str, Any], message: str) -> None:
    with pytest.raises(RuleError, match=message):
        parse_rules([rule], DAY)


@pytest.fixture
def adhoc_task(celery_app: Any) -> Iterator[Callable[..., Any]]:
    """Register throwaway fair tasks on the test app; they are removed afterwards."""
    names: list[str] = []

    def make(name: str, **options: Any) -> Any:
        names.append(name)

        def run(self: Any, tenant: str) -> None:
            return None

        return celery_app.task(base=FairTask, bind=True, name=name, **options)(run)

    yield make
    for name in names:
        celery_app.tasks.pop(name, None)


def check_ids(name: str) -> list[str]:
    # W006 (no way to find the tenant) is not what these tasks are about.
    return [
        m.id for m in check_task_rules() if name in m.msg and m.id not in (None, "fair_jobs.W006")
    ]


def test_checks__bad_rules_scope_and_unknown_queue(adhoc_task: Callable[..., Any]) -> None:
    adhoc_task("bad.rule", fair_reroute=[{"queue": "fair", "threshold": -1}])
    adhoc_task("bad.scope", fair_reroute=[], fair_reroute_scope="tenant")
    adhoc_task("bad.queue", fair_reroute=[{"queue": "nowhere", "threshold": 1}])
    adhoc_task("good.one", queue="fair", fair_reroute=[{"queue": "fair", "threshold": 1}])
    assert check_ids("bad.rule") == ["fair_jobs.E011"]
    assert check_ids("bad.scope") == ["fair_jobs.E012"]
    assert check_ids("bad.queue") == ["fair_jobs.W001"]
    assert check_ids("good.one") == []
    with override_settings(FAIR_JOBS_REROUTE_MAX_WINDOW=30):
        adhoc_task("long.window", fair_reroute=[{"queue": "fair", "threshold": 1, "per": 60}])
        assert check_ids("long.window") == ["fair_jobs.E011"]


def test_publish__invalid_rules_raise_at_enqueue(adhoc_task: Callable[..., Any]) -> None:
    task = adhoc_task("bad.publish", fair_reroute=[{"queue": "x", "threshold": 0}])
    with pytest.raises(RuleError, match=r"bad\.publish: rule 1: threshold"):
        task.delay("acme")


# -- publishing through FairTask, on the real broker ---------------------------------------


@pytest.fixture
def published(broker_env: dict[str, str]) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """(routing key, headers) of every message published during the test."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def capture(routing_key: str = "", headers: Any = None, **kwargs: Any) -> None:
        seen.append((routing_key, dict(headers or {})))

    signals.before_task_publish.connect(capture, weak=False)
    yield seen
    signals.before_task_publish.disconnect(capture)


def queues_of(published: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [routing_key for routing_key, _ in published]


def window_total(tenant: str) -> int:
    return sum(TenantWindow.objects.filter(tenant=tenant).values_list("total", flat=True))


def test_publish__third_job_in_a_minute_goes_to_the_slow_queue(
    published: list[tuple[str, dict[str, Any]]],
) -> None:
    for _ in range(4):
        tasks.rerouted.delay("acme")
    tasks.rerouted.delay("other")
    assert queues_of(published) == ["fair", "fair", "fair_slow", "fair_slow", "fair"]
    assert [h[HEADER] for _, h in published[:3]] == [
        {"counts": [1], "rule": None},
        {"counts": [2], "rule": None},
        {"counts": [3], "rule": 0},
    ]
    assert RerouteCount.objects.get(tenant="acme").total == 2


@pytest.mark.parametrize("enforce", [True, False])
def test_publish__rerouted_job__one_statement_counts_it_and_records_its_decision(
    published: list[tuple[str, dict[str, Any]]], enforce: bool
) -> None:
    for _ in range(2):
        tasks.rerouted.delay("acme")
    with override_settings(FAIR_JOBS_ENFORCE=enforce), CaptureQueriesContext(connection) as sql:
        result = tasks.rerouted.delay("acme")
    assert queues_of(published)[-1] == ("fair_slow" if enforce else "fair")
    decision = JobDecision.objects.get(task_id=result.id)
    assert (decision.mechanism, decision.action, decision.enforced, decision.queue) == (
        "reroute", "rerouted" if enforce else "reroute", enforce, "fair",
    )  # fmt: skip
    assert (decision.tenant, decision.task_name) == ("acme", tasks.rerouted.name)
    assert decision.detail == {
        "rule": 1, "to_queue": "fair_slow", "per": 60, "threshold": 2, "count": 3,
    }  # fmt: skip
    assert JobDecision.objects.count() == 1  # the first two stayed: no decision
    if runs_sql():
        # The count, the reroute's tally and the decision: one round trip.
        assert len(sql) == 1, [q["sql"][:80] for q in sql]


def test_publish__signatures_and_explicit_tenant_pass_through(
    published: list[tuple[str, dict[str, Any]]],
) -> None:
    tasks.rerouted.s("x").set(fair_tenant="acme").delay()  # type: ignore[call-arg]
    tasks.rerouted.signature(("y",), fair_tenant="acme").apply_async()
    tasks.rerouted.apply_async(("z",), fair_tenant="acme")
    assert queues_of(published) == ["fair", "fair", "fair_slow"]
    assert window_total("acme") == 3


def test_publish__caller_chosen_queue_is_neither_counted_nor_rerouted(
    published: list[tuple[str, dict[str, Any]]],
) -> None:
    for _ in range(3):
        tasks.rerouted.apply_async(("acme",), queue="other")
    assert queues_of(published) == ["other"] * 3
    assert window_total("acme") == 0
    # Naming the declared queue itself is not an override: counted as usual.
    for _ in range(3):
        tasks.rerouted.apply_async(("acme",), queue="fair")
    assert queues_of(published)[3:] == ["fair", "fair", "fair_slow"]


def test_publish__counted_job_republished_is_not_counted_again(
    published: list[tuple[str, dict[str, Any]]],
) -> None:
    result = tasks.rerouted.delay("acme")
    headers = published[0][1]
    # What a retry or a woken parked job does: the same id, with the headers it had.
    tasks.rerouted.apply_async(("acme",), task_id=result.id, headers=headers)
    tasks.rerouted.apply_async(("acme",), task_id=result.id, headers=headers)
    assert window_total("acme") == 1
    assert queues_of(published) == ["fair"] * 3


def test_publish__no_tenant__not_counted__warned_once(
    published: list[tuple[str, dict[str, Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    from django_fair_jobs import tenants

    tenants._last_warned.clear()
    with caplog.at_level("WARNING", logger="django_fair_jobs.tenants"):
        for _ in range(5):
            tasks.rerouted.delay(None, 0)
    assert queues_of(published) == ["fair"] * 5
    assert not TenantWindow.objects.exists()
    assert caplog.text.count("not counted or rerouted") == 1


def test_publish__queue_scope_counts_tasks_together(
    published: list[tuple[str, dict[str, Any]]],
) -> None:
    with override_settings(FAIR_JOBS_REROUTE_SCOPE="queue"):
        tasks.rerouted.delay("acme")
        tasks.rerouted_capped.delay("acme")
        tasks.rerouted.delay("acme")
    assert queues_of(published) == ["fair", "fair", "fair_slow"]
    assert list(TenantWindow.objects.values_list("key", "total")) == [("queue:fair", 3)]


def test_publish__inside_a_transaction__count_commits_at_once_on_postgresql(
    published: list[tuple[str, dict[str, Any]]],
) -> None:
    """Celery publishes at once, not at commit; on PostgreSQL the count commits at once
    too, and the tenant's row is not held locked until the caller's transaction ends.
    SQLite (development) keeps the caller's transaction: the count rolls back with it."""
    postgres = runs_sql()

    def publish_elsewhere() -> None:
        tasks.rerouted.delay("acme")
        connections.close_all()

    def publish_and_roll_back() -> None:
        with transaction.atomic():
            tasks.rerouted.delay("acme")
            if postgres:
                other = threading.Thread(target=publish_elsewhere)
                other.start()
                other.join(10)
                assert not other.is_alive(), "a second publisher was blocked"
            raise ZeroDivisionError  # roll the caller's transaction back

    with pytest.raises(ZeroDivisionError):
        publish_and_roll_back()
    assert window_total("acme") == (2 if postgres else 0)
    assert len(published) == (2 if postgres else 1)

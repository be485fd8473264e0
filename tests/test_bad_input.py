"""Bad input: rule configurations, tenant values, weights functions, admin forms and job
arguments that cannot be stored. Each gets a clear error (at publish, at start-up or in
the form) or a documented safe behaviour; none crashes a worker or the planner, and no
job is lost. The table of what happens to each is in docs/reliability.md ("Bad input").
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery.exceptions import Ignore
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from kombu.exceptions import EncodeError

from django_fair_jobs import planner
from django_fair_jobs.checks import check_settings, check_task_rules, fail_fast_on_bad_settings
from django_fair_jobs.conf import MAX_LIMIT
from django_fair_jobs.dispatch.models import DispatchJob
from django_fair_jobs.errors import TaskIdError
from django_fair_jobs.models import (
    LimitChange,
    ParkedJob,
    PlannedJob,
    PlannerTenant,
    QueueLimit,
    SlotLease,
    TenantQueueSlot,
    TenantWindow,
)
from django_fair_jobs.reroute import RuleError, parse_rules, rule_errors
from django_fair_jobs.slots import store as slot_store
from django_fair_jobs.task import FairArgumentsError
from django_fair_jobs.tenants import TenantError, normalize_tenant
from tests.conftest import run_as_worker
from tests.testapp import tasks
from tests.testapp.models import JobRun

FAST = hsettings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
"""Modest property runs: the suite stays fast on PostgreSQL and SQLite."""

PLAN: dict[str, Any] = dict(tasks.planned.fair_plan or {})
SLOTS = "/admin/fair_jobs/tenantqueueslot/"
QUEUES = "/admin/fair_jobs/queuelimit/"
NO_LEASES = {
    "leases-TOTAL_FORMS": "0",
    "leases-INITIAL_FORMS": "0",
    "leases-MIN_NUM_FORMS": "0",
    "leases-MAX_NUM_FORMS": "1000",
}


def broker_depth(queue: str = "fair") -> int:
    """Messages waiting in ``queue`` on the test broker (Redis keeps a queue in a list)."""
    return int(redis.Redis.from_url(django_settings.CELERY_BROKER_URL).llen(queue))


@pytest.fixture
def process(in_process_worker: uuid.UUID) -> uuid.UUID:
    """The registered worker process of in-process job runs (see ``in_process_worker``)."""
    return in_process_worker


# Rule configurations (fair_reroute) --------------------------------------------

BAD_RULES: list[tuple[Any, str]] = [
    ("fair_slow", "must be a list of rules"),
    ({"queue": "fair_slow", "threshold": 1}, "must be a list of rules"),
    ([["fair_slow", 1]], "not a dict"),
    ([{"threshold": 1}], "queue must be a queue name"),
    ([{"queue": "  ", "threshold": 1}], "queue must be a queue name"),
    ([{"queue": 7, "threshold": 1}], "queue must be a queue name"),
    ([{"queue": "q" * 256, "threshold": 1}], "at most 255 characters"),
    ([{"queue": "a\x00b", "threshold": 1}], "without NUL"),
    ([{"queue": "fair_slow"}], "threshold must be a whole number"),
    ([{"queue": "fair_slow", "threshold": 0}], "threshold must be a whole number"),
    ([{"queue": "fair_slow", "threshold": -5}], "threshold must be a whole number"),
    ([{"queue": "fair_slow", "threshold": 2.5}], "threshold must be a whole number"),
    ([{"queue": "fair_slow", "threshold": "10"}], "threshold must be a whole number"),
    ([{"queue": "fair_slow", "threshold": True}], "threshold must be a whole number"),
    ([{"queue": "fair_slow", "threshold": MAX_LIMIT + 1}], "threshold must be a whole number"),
    ([{"queue": "fair_slow", "threshold": 1, "per": 0}], "per must be"),
    ([{"queue": "fair_slow", "threshold": 1, "per": -60}], "per must be"),
    ([{"queue": "fair_slow", "threshold": 1, "per": 1.5}], "per must be"),
    ([{"queue": "fair_slow", "threshold": 1, "per": "60"}], "per must be"),
    ([{"queue": "fair_slow", "threshold": 1, "per": math.nan}], "per must be"),
    ([{"queue": "fair_slow", "threshold": 1, "per": math.inf}], "per must be"),
    ([{"queue": "fair_slow", "threshold": 1, "per": -math.inf}], "per must be"),
    ([{"queue": "fair_slow", "threshold": 1, "per": timedelta(seconds=-1)}], "per must be"),
    ([{"queue": "fair_slow", "threshold": 1, "per": 10**12}], "above FAIR_JOBS_REROUTE_MAX_WINDOW"),
    (
        [{"queue": "fair_slow", "threshold": 1, "per": timedelta.max}],
        "above FAIR_JOBS_REROUTE_MAX_WINDOW",
    ),
    ([{"queue": "fair_slow", "threshold": 1, "max_jobs": 0}], "max_jobs must be a whole number"),
    ([{"queue": "fair_slow", "threshold": 1, "max_jobs": -1}], "max_jobs must be a whole"),
    ([{"queue": "fair_slow", "threshold": 1, "max_jobs": 10**10}], "max_jobs must be a whole"),
    ([{"queue": "fair_slow", "threshold": 1, "limit": 3}], "unknown keys limit"),
    ([{"queue": "fair_slow", "threshold": 1, 42: 3}], "unknown keys 42"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("rules", "message"), BAD_RULES)
def test_bad_rules__error_at_publish_and_at_start_up__nothing_counted_or_sent(
    rules: Any, message: str, broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks.rerouted, "fair_reroute", rules)
    with pytest.raises(RuleError, match=message) as raised:
        tasks.rerouted.delay("acme")
    assert str(raised.value).startswith(f"{tasks.rerouted.name}: ")  # names the task
    assert broker_depth() == 0 and not TenantWindow.objects.exists()
    errors = [e for e in check_task_rules() if e.id == "fair_jobs.E011"]
    assert errors and all(tasks.rerouted.name in e.msg for e in errors)
    assert any(message.split()[0] in e.msg for e in errors)
    assert all(len(e.msg) < 500 for e in errors)  # a 10 KB value is quoted cut short
    # A worker refuses to start with them, rather than failing jobs later.
    with pytest.raises(SystemExit):
        fail_fast_on_bad_settings()


def test_rule_error_quotes_a_huge_value_cut_short() -> None:
    (problem,) = rule_errors([{"queue": "x" * 10_000, "threshold": 1}], 86400)
    assert len(problem) < 300


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20)
    | st.timedeltas(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
RULE_KEYS = st.sampled_from(["queue", "threshold", "per", "max_jobs", "extra"])
RULEISH = st.one_of(
    JSONISH,
    st.lists(st.dictionaries(RULE_KEYS, JSONISH, max_size=5), max_size=3),
)


@FAST
@given(raw=RULEISH, max_window=st.integers(min_value=1, max_value=MAX_LIMIT))
def test_property__any_rules__validation_never_raises__accepted_rules_are_in_bounds(
    raw: Any, max_window: int
) -> None:
    problems = rule_errors(raw, max_window)
    if problems:
        with pytest.raises(RuleError):
            parse_rules(raw, max_window)
        return
    for rule in parse_rules(raw, max_window):
        assert 1 <= rule.threshold <= MAX_LIMIT
        assert 1 <= rule.per <= max_window
        assert rule.max_jobs is None or 1 <= rule.max_jobs <= MAX_LIMIT
        assert rule.queue.strip() and len(rule.queue) <= 255


@pytest.mark.django_db(transaction=True)
def test_largest_accepted_window_and_threshold__counted_in_the_database(
    broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    # The bounds validation lets through must work in the SQL too (bigint arithmetic).
    settings.FAIR_JOBS_REROUTE_MAX_WINDOW = MAX_LIMIT
    huge = [{"queue": "fair_slow", "threshold": MAX_LIMIT, "per": MAX_LIMIT, "max_jobs": MAX_LIMIT}]
    monkeypatch.setattr(tasks.rerouted, "fair_reroute", huge)
    tasks.rerouted.delay("acme")
    tasks.rerouted.delay("acme")
    assert broker_depth("fair") == 2  # not rerouted: 2 is far below the threshold
    assert TenantWindow.objects.get(tenant="acme").total == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("REROUTE_MAX_WINDOW", MAX_LIMIT + 1),
        ("REROUTE_MAX_WINDOW", 0),
        ("DEFAULT_MAX_JOBS", 10**12),
        ("RETRY_COUNTDOWN", math.inf),
        ("RETRY_COUNTDOWN", math.nan),
        ("WORKER_TIMEOUT", math.inf),
        ("HEARTBEAT_INTERVAL", -1),
        ("QUEUE_LIMITS", {"hooks": 10**12}),
        ("QUEUE_LIMITS", {"hooks": -1}),
        ("PLANNER_LOCK_TTL", math.inf),
    ],
)
def test_settings_out_of_range__system_check_error(name: str, value: Any, settings: Any) -> None:
    setattr(settings, f"FAIR_JOBS_{name}", value)
    assert any(f"FAIR_JOBS_{name}" in e.msg for e in check_settings() if e.is_serious())


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({**PLAN, "enqueue_interval": math.inf}, "enqueue_interval must be"),
        ({**PLAN, "enqueue_interval": math.nan}, "enqueue_interval must be"),
        ({**PLAN, "enqueue_interval": -1}, "enqueue_interval must be"),
        ({**PLAN, "enqueue_jobs": 0}, "enqueue_jobs must be"),
        ({**PLAN, "planner_lock_ttl": math.inf}, "planner_lock_ttl must be"),
        ({**PLAN, "latency_threshold": math.nan}, "latency_threshold must be"),
        ({**PLAN, "tenant_weights": "no.such.module.weights"}, "tenant_weights"),
        ({**PLAN, "tenant_weights": 3}, "tenant_weights must be a callable"),
        ({**PLAN, "weights": {}}, "unknown key"),
        ({"enqueue_interval": 1}, "enqueue_jobs is required"),
    ],
)
def test_bad_plan__error_at_start_up_and_at_publish(
    plan: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks.planned, "fair_plan", plan)
    assert any(message in e.msg for e in check_task_rules() if e.id == "fair_jobs.E015")
    with pytest.raises(planner.PlanError, match=message):
        planner.parse_plan(plan)


@pytest.mark.parametrize(
    "options",
    [
        {"fair_max_jobs": MAX_LIMIT + 1},
        {"fair_max_jobs": -1},
        {"fair_retry_countdown": math.inf},
        {"fair_retry_countdown": math.nan},
    ],
)
def test_task_options_out_of_range__error_at_definition(options: dict[str, Any]) -> None:
    from celery import shared_task

    from django_fair_jobs import FairTask
    from django_fair_jobs.task import FairTaskConfigError

    with pytest.raises(FairTaskConfigError, match="must be"):

        @shared_task(base=FairTask, name=f"tests.bad_input.{uuid.uuid4().hex}", **options)
        def never(x: int) -> int:  # pragma: no cover - never defined
            return x


# Tenant values -------------------------------------------------------------------------

STORED_AS_IS = [
    ("acme", "acme"),
    (42, "42"),
    (uuid.UUID(int=7), str(uuid.UUID(int=7))),
    (" acme ", " acme "),  # kept exactly: " acme " and "acme" are two tenants
    ("ACME", "ACME"),  # case kept: compared exactly
    ("caf\u00e9", "caf\u00e9"),  # composed and decomposed e-acute are two tenants
    ("cafe\u0301", "cafe\u0301"),
    ("\U0001f680\U0001f9d1\u200d\U0001f4bb", "\U0001f680\U0001f9d1\u200d\U0001f4bb"),
    ("\u05e9\u05dc\u05d5\u05dd \u202eevil", "\u05e9\u05dc\u05d5\u05dd \u202eevil"),
    ("line\nbreak\ttab", "line\nbreak\ttab"),
    ("x" * 255, "x" * 255),
]
NO_TENANT = [None, "", "   ", "\t\n"]
REFUSED = [
    ("x" * 256, "limit is 255"),
    ("x" * 10_240, "limit is 255"),
    ("a\x00b", "NUL"),
    ("\x00", "NUL"),
    ("bad\ud800", "not valid Unicode"),
    (b"acme", "not text"),
    (bytearray(b"acme"), "not text"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("value", "stored"), STORED_AS_IS)
def test_tenant__stored_exactly__in_the_header_and_the_slot_row(
    value: Any, stored: str, process: uuid.UUID, broker_env: dict[str, str]
) -> None:
    tasks.limited1.apply_async(("ignored",), fair_tenant=value)
    (message,) = redis.Redis.from_url(django_settings.CELERY_BROKER_URL).lrange("fair", 0, -1)
    assert json.loads(message)["headers"]["fair_tenant"] == stored
    grant = slot_store.try_acquire(
        tenant=stored, queue="fair", task_id="t1", limit=1, process_id=process, timeout=60
    ).grant
    assert grant is not None and grant.slot_id is not None
    assert TenantQueueSlot.objects.get(pk=grant.slot_id).tenant == stored


@pytest.mark.django_db
@pytest.mark.parametrize("value", NO_TENANT)
def test_tenant__none_or_blank__no_tenant__published_and_run_unthrottled_with_a_warning(
    value: Any, process: uuid.UUID, broker_env: dict[str, str], caplog: pytest.LogCaptureFixture,
    settings: Any,
) -> None:  # fmt: skip
    settings.FAIR_JOBS_TENANT_WARNING_INTERVAL = 0
    tasks.limited1.delay(value)  # fair_tenant() returns it
    (message,) = redis.Redis.from_url(django_settings.CELERY_BROKER_URL).lrange("fair", 0, -1)
    assert json.loads(message)["headers"]["fair_tenant"] is None
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs.tenants"):
        result = run_as_worker(
            tasks.limited1, ("acme", 0), task_id=f"blank-{value!r}", headers={"fair_tenant": value}
        )
    assert result == "acme:done"
    assert "without a tenant" in caplog.text
    assert not TenantQueueSlot.objects.exists()  # no slot: unthrottled


@pytest.mark.django_db
@pytest.mark.parametrize(("value", "message"), REFUSED)
def test_tenant__refused_at_publish__nothing_sent_or_counted(
    value: Any, message: str, broker_env: dict[str, str]
) -> None:
    with pytest.raises(TenantError, match=message):
        tasks.limited1.apply_async(("ok",), fair_tenant=value)
    # The same value from fair_tenant(): as an argument, a bytearray is also refused as
    # one JSON cannot store; either error comes before anything is counted or stored.
    refused = (TenantError, FairArgumentsError)
    with pytest.raises(refused):
        tasks.limited1.delay(value)
    with pytest.raises(refused):
        tasks.rerouted.delay(value)
    with pytest.raises(refused):
        tasks.planned.delay(value)
    assert broker_depth() == 0
    assert not TenantWindow.objects.exists() and not PlannedJob.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(("value", "message"), REFUSED)
def test_tenant__refused_value_reaching_a_worker__job_runs_without_tenant__short_error_log(
    value: Any,
    message: str,
    process: uuid.UUID,
    caplog: pytest.LogCaptureFixture,
    settings: Any,
) -> None:
    # Only send_task by name can carry one (apply_async refuses it). Failing the job
    # would lose it; it runs without tenant fairness and the log says why, briefly.
    settings.FAIR_JOBS_TENANT_WARNING_INTERVAL = 0
    with caplog.at_level(logging.ERROR, logger="django_fair_jobs.tenants"):
        result = run_as_worker(
            tasks.limited1, ("acme", 0), task_id="by-name", headers={"fair_tenant": value}
        )
    assert result == "acme:done" and JobRun.objects.filter(task_id="by-name").exists()
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert message.split()[0] in record.getMessage() and len(record.getMessage()) < 300


TENANT_TEXT = st.one_of(
    # Every code point, surrogates and NUL included.
    st.text(st.characters(codec=None, exclude_categories=()), max_size=40),
    st.text(max_size=300),
    st.integers(),
    st.uuids(),
)


@pytest.mark.django_db
@FAST
@given(value=TENANT_TEXT)
def test_property__any_tenant__refused_or_stored_and_read_back_exactly(
    value: Any, process: uuid.UUID
) -> None:
    try:
        tenant = normalize_tenant(value)
    except TenantError:
        return  # refused at publish: the documented error
    if tenant is None:
        assert not str(value).strip()
        return
    assert tenant == str(value)
    acquired = slot_store.try_acquire(
        tenant=tenant, queue="q", task_id=uuid.uuid4().hex, limit=MAX_LIMIT,
        process_id=process, timeout=60,
    )  # fmt: skip
    assert acquired.grant is not None and acquired.grant.slot_id is not None
    assert TenantQueueSlot.objects.get(pk=acquired.grant.slot_id).tenant == tenant
    assert slot_store.release(acquired.grant) is not None


# tenant_weights ------------------------------------------------------------------------


@pytest.fixture
def planned(
    broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., None]]:
    """Set the planned task's weights function; three tenants have a job due."""
    tasks.PLAN_WEIGHTS.clear()

    def use(weights: Any, **plan: Any) -> None:
        monkeypatch.setattr(tasks.planned, "fair_plan", {**PLAN, "tenant_weights": weights, **plan})

    for tenant in ("a", "b", "c"):
        tasks.planned.delay(tenant)
    yield use
    tasks.PLAN_WEIGHTS.clear()


def _raises(tenants: list[str]) -> dict[str, float]:
    raise RuntimeError("weights service down")


WEIGHTS: list[tuple[str, Callable[[list[str]], Any], str]] = [
    ("raises", _raises, "failed; every tenant weighs 1"),
    ("returns None", lambda t: None, "not a dict"),
    ("returns a list", lambda t: [1, 2, 3], "not a dict"),
    ("returns a number", lambda t: 3, "not a dict"),
    ("a string weight", lambda t: {x: "2" for x in t}, "not a finite number"),
    ("None weights", lambda t: {x: None for x in t}, "not a finite number"),
    ("bool weights", lambda t: {x: True for x in t}, "not a finite number"),
    ("negative", lambda t: {x: -1 for x in t}, "not a finite number"),
    ("NaN", lambda t: {x: math.nan for x in t}, "not a finite number"),
    ("infinity", lambda t: {x: math.inf for x in t}, "not a finite number"),
    ("tiny", lambda t: {x: 1e-300 for x in t}, "outside"),
    ("huge", lambda t: {x: 1e300 for x in t}, "outside"),
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("case", "weights", "logged"), WEIGHTS, ids=[w[0] for w in WEIGHTS])
def test_bad_weights__run_completes__every_job_promoted__warning_logged(
    case: str,
    weights: Callable[[list[str]], Any],
    logged: str,
    planned: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    planned(weights)
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs.planner"):
        report = planner.run(tasks.planned, due_only=False)
    assert report is not None and report.promoted == 3, case
    assert logged in caplog.text
    assert not PlannedJob.objects.filter(promoted_at__isnull=True).exists()
    passes = PlannerTenant.objects.values_list("pass_value", flat=True)
    assert all(math.isfinite(p) for p in passes)


@pytest.mark.django_db(transaction=True)
def test_slow_weights__warned_when_longer_than_the_interval__run_still_completes(
    planned: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    def slow(tenants: list[str]) -> dict[str, float]:
        time.sleep(0.3)
        return {t: 1 for t in tenants}

    planned(slow, enqueue_interval=0.1)
    with caplog.at_level(logging.WARNING, logger="django_fair_jobs.planner"):
        report = planner.run(tasks.planned, due_only=False)
    assert report is not None and report.promoted == 3
    assert "took 0.3" in caplog.text and "longer than the enqueue interval" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_weights_failing_every_run__later_runs_still_promote(planned: Callable[..., None]) -> None:
    planned(_raises)
    assert [planner.run(tasks.planned, due_only=False) is not None for _ in range(2)] == [True] * 2
    tasks.planned.delay("d")
    report = planner.run(tasks.planned, due_only=False)
    assert report is not None and report.counts == {"d": 1}


WEIGHT_VALUES = st.one_of(
    st.floats(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.none(),
    st.booleans(),
    st.text(max_size=5),
    st.timedeltas(),
    st.just(object()),
)


@FAST
@given(
    values=st.dictionaries(st.sampled_from("abcdef"), WEIGHT_VALUES, min_size=1),
    pending=st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 50), min_size=1),
    budget=st.integers(1, 100),
)
def test_property__any_weights__finite_and_bounded__allocation_work_conserving(
    values: dict[str, Any], pending: dict[str, int], budget: int
) -> None:
    plan = planner.parse_plan({**PLAN, "tenant_weights": lambda tenants: values})
    got = planner.weights(plan, sorted(pending))
    for weight in got.values():
        assert weight == 0 or planner.MIN_WEIGHT <= weight <= planner.MAX_WEIGHT
    allocation = planner.allocate(pending, got, {}, 0.0, budget)
    runnable = sum(n for t, n in pending.items() if got.get(t, 0) > 0)
    assert sum(allocation.counts.values()) == min(budget, runnable)
    assert all(math.isfinite(p) for p in allocation.passes.values())


# Admin forms ---------------------------------------------------------------------------


@pytest.fixture
def ops(client: Client) -> Client:
    """A superuser: form validation is what stops bad values, not permissions."""
    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    return client


BAD_LIMITS = ["-1", "abc", "1.5", "1e3", str(MAX_LIMIT + 1), "9" * 30, "\x00"]


@pytest.mark.django_db
@pytest.mark.parametrize("value", BAD_LIMITS)
def test_admin_slot_max_jobs__bad_value__form_error__nothing_changed(
    ops: Client, value: str
) -> None:
    from django_fair_jobs import slots

    row = slots.set_tenant_limit("acme", "fair", 2)
    changes = LimitChange.objects.count()
    page = ops.post(f"{SLOTS}{row.pk}/change/", {"max_jobs": value, **NO_LEASES})
    assert page.status_code == 200 and b"errorlist" in page.content
    listed = ops.post(SLOTS, {
        "form-TOTAL_FORMS": "1", "form-INITIAL_FORMS": "1", "form-0-id": str(row.pk),
        "form-0-max_jobs": value, "_save": "Save",
    })  # fmt: skip
    assert listed.status_code == 200 and b"errorlist" in listed.content
    assert TenantQueueSlot.objects.get(pk=row.pk).max_jobs == 2
    assert LimitChange.objects.count() == changes


@pytest.mark.django_db
@pytest.mark.parametrize("value", BAD_LIMITS)
def test_admin_boost__bad_value__form_error__nothing_changed(ops: Client, value: str) -> None:
    from django_fair_jobs import slots

    row = slots.set_tenant_limit("acme", "fair", 2)
    changes = LimitChange.objects.count()
    page = ops.post(f"{SLOTS}{row.pk}/change/", {
        "max_jobs": "2", "boost_max_jobs": value, "boost_until_time": "2999-01-01 00:00:00",
        **NO_LEASES,
    })  # fmt: skip
    assert page.status_code == 200 and b"errorlist" in page.content
    fresh = TenantQueueSlot.objects.get(pk=row.pk)
    assert (fresh.max_jobs, fresh.boost_until) == (2, None)
    assert LimitChange.objects.count() == changes


@pytest.mark.django_db
@pytest.mark.parametrize("value", BAD_LIMITS)
@pytest.mark.parametrize("field", ["max_jobs", "max_jobs_per_worker"])
def test_admin_queue_limits__bad_value__form_error__nothing_changed(
    ops: Client, value: str, field: str
) -> None:
    from django_fair_jobs import queue_limits

    row = queue_limits.set_limits("hooks", max_jobs=3, max_jobs_per_worker=1)
    changes = LimitChange.objects.count()
    good = {"max_jobs": "3", "max_jobs_per_worker": "1"}
    page = ops.post(f"{QUEUES}{row.pk}/change/", {**good, field: value})
    assert page.status_code == 200 and b"errorlist" in page.content
    listed = ops.post(QUEUES, {
        "form-TOTAL_FORMS": "1", "form-INITIAL_FORMS": "1", "form-0-id": str(row.pk),
        **{f"form-0-{k}": v for k, v in {**good, field: value}.items()}, "_save": "Save",
    })  # fmt: skip
    assert listed.status_code == 200 and b"errorlist" in listed.content
    fresh = QueueLimit.objects.get(pk=row.pk)
    assert (fresh.max_jobs, fresh.max_jobs_per_worker) == (3, 1)
    assert LimitChange.objects.count() == changes


@pytest.mark.django_db
@pytest.mark.parametrize("tenant", ["", "   ", "x" * 256, "a\x00b"])
def test_admin_add_slot__bad_tenant__form_error__no_row(ops: Client, tenant: str) -> None:
    page = ops.post(
        f"{SLOTS}add/", {"tenant": tenant, "queue": "fair", "max_jobs": "1", **NO_LEASES}
    )
    assert page.status_code == 200 and b"errorlist" in page.content
    assert not TenantQueueSlot.objects.exists() and not LimitChange.objects.exists()


@pytest.mark.django_db
def test_fair_jobs_limit_command__bad_numbers__command_error__nothing_changed() -> None:
    from django.core.management.base import CommandError

    for argv in (["--max-jobs", "-1"], ["--max-jobs", "abc"], ["--per-worker", "1.5"]):
        with pytest.raises(CommandError):
            call_command("fair_jobs_limit", "hooks", *argv)
    assert not QueueLimit.objects.exists()


# Arguments that cannot be stored as JSON --------------------------------------------------


class Unstorable:
    """An argument kombu's JSON cannot encode."""


def _circular() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


UNSTORABLE: list[tuple[str, Callable[[], Any]]] = [
    ("object", Unstorable),
    ("set", lambda: {1, 2}),
    ("frozenset", lambda: frozenset({"a"})),
    ("function", lambda: print),
    ("circular list", _circular),
    ("complex", lambda: 1j),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("case", "make"), UNSTORABLE, ids=[u[0] for u in UNSTORABLE])
@pytest.mark.parametrize("task_name", ["limited1", "rerouted", "planned"])
def test_unstorable_arguments__clear_error_at_publish__nothing_sent_counted_or_stored(
    case: str, make: Callable[[], Any], task_name: str, broker_env: dict[str, str]
) -> None:
    task = getattr(tasks, task_name)
    with pytest.raises(FairArgumentsError, match=task.name) as raised:
        task.apply_async(("acme", make()))
    assert isinstance(raised.value, EncodeError)  # what Celery's JSON serializer raises
    assert "cannot be stored as JSON" in str(raised.value)
    with pytest.raises(FairArgumentsError):
        task.apply_async(("acme",), {"duration": make()})
    assert broker_depth() == 0
    assert not TenantWindow.objects.exists() and not PlannedJob.objects.exists()


@pytest.mark.django_db
def test_unstorable_arguments__bulk_enqueue__error__no_job_stored() -> None:
    items: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("a",), {}),
        (("b", {1, 2}), {}),
        (("c",), {}),
    ]
    with pytest.raises(FairArgumentsError, match=tasks.planned.name):
        tasks.planned.bulk_enqueue(items)
    assert not PlannedJob.objects.exists()


@pytest.mark.django_db
def test_unstorable_headers_of_a_planned_job__error_at_publish__not_in_the_planner() -> None:
    with pytest.raises(FairArgumentsError, match="virtual queue"):
        tasks.planned.apply_async(("acme",), headers={"trace": Unstorable()})
    assert not PlannedJob.objects.exists()


@pytest.mark.django_db
def test_storable_arguments_of_other_types__kept_through_the_virtual_queue(
    broker_env: dict[str, str],
) -> None:
    # What kombu's JSON does encode (bytes, UUIDs, datetimes, decimals) round-trips.
    import datetime
    import decimal

    odd = [
        b"\x00\xffraw",
        uuid.UUID(int=5),
        datetime.datetime(2030, 1, 2, 3, 4, 5),
        decimal.Decimal("1.25"),
    ]
    result = tasks.planned.apply_async(("acme", odd))
    stored = json.loads(PlannedJob.objects.get(task_id=result.id).signature)
    assert stored["task"] == tasks.planned.name
    from kombu.utils.json import loads

    assert loads(PlannedJob.objects.get(task_id=result.id).signature)["args"][1] == odd


@pytest.fixture
def pickle_app(celery_app: Any) -> Iterator[Any]:
    """The test app publishing with the pickle serializer."""
    conf = celery_app.conf
    saved = (conf.task_serializer, list(conf.accept_content))
    conf.task_serializer = "pickle"
    conf.accept_content = ["json", "pickle"]
    yield celery_app
    conf.task_serializer, conf.accept_content = saved


@pytest.mark.django_db
def test_pickle_serializer__unstorable_arguments_refused_all_the_same(
    pickle_app: Any, broker_env: dict[str, str]
) -> None:
    # Pickle could carry a set to the worker, but a parked job is stored as JSON: refused
    # at publish, not lost when its tenant is at its limit.
    with pytest.raises(FairArgumentsError):
        tasks.limited1.apply_async(("acme", {1, 2}))
    assert broker_depth() == 0


@pytest.mark.django_db(transaction=True)  # the wake-up is published at commit
def test_pickle_serializer__parked_job_stored_as_json_and_woken_whole(
    pickle_app: Any, process: uuid.UUID, broker_env: dict[str, str]
) -> None:
    from django_fair_jobs import admission

    holder = slot_store.try_acquire(
        tenant="acme", queue="fair", task_id="holder", limit=1, process_id=process, timeout=60
    ).grant
    assert holder is not None
    with pytest.raises(Ignore):  # parked, acknowledged without running
        run_as_worker(
            tasks.limited1, ("acme", 0), task_id="parked", headers={"fair_tenant": "acme"}
        )
    row = ParkedJob.objects.get(task_id="parked")
    stored = json.loads(row.signature)  # plain JSON text, whatever the task serializer
    assert stored["args"] == ["acme", 0] and stored["options"]["task_id"] == "parked"
    admission.release(holder)  # wakes it: re-published through the (pickle) app
    assert broker_depth() == 1
    assert not JobRun.objects.exists()  # parked, not run and not lost


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("on_limit", ["park", "retry"])
def test_defer__arguments_json_cannot_store__job_waits_through_the_broker(
    on_limit: str,
    monkeypatch: pytest.MonkeyPatch,
    broker_env: dict[str, str],
    process: uuid.UUID,
) -> None:
    # Published by name with the pickle serializer (FairTask's own publish would refuse a
    # set): the tenant is full, the job cannot be parked as JSON, so it is re-published
    # with a countdown instead of failing.
    slot_store.try_acquire(
        tenant="acme", queue="fair", task_id="holder", limit=1, process_id=process, timeout=60
    )
    task = tasks.limited1
    monkeypatch.setattr(task, "serializer", "pickle")
    # Celery caches a task's publish options (the serializer among them) at its first
    # publish: drop the cache so that this test's serializer is the one used.
    monkeypatch.setattr(task, "_exec_options", None)
    monkeypatch.setattr(task, "fair_on_limit", on_limit)
    task.push_request(
        id="by-name",
        headers={"fair_tenant": "acme"},
        delivery_info={"routing_key": "fair"},
        hostname="bad@host",
        is_eager=False,
    )
    try:
        with pytest.raises(Ignore):
            task("acme", {1, 2})
    finally:
        task.pop_request()
    assert not ParkedJob.objects.exists()
    assert broker_depth() == 1
    raw = redis.Redis.from_url(django_settings.CELERY_BROKER_URL).lindex("fair", 0)
    assert isinstance(raw, bytes)
    message = json.loads(raw)
    assert message["headers"]["id"] == "by-name"
    assert message["content-type"] == "application/x-python-serialize"


@pytest.mark.django_db
@pytest.mark.parametrize("option", ["--max-jobs", "--per-worker"])
def test_limit_command__queue_limit_above_the_column__clear_error__nothing_changed(
    option: str,
) -> None:
    # Above what the column holds, a limit used to pass the check and fail in the
    # database with its own error.
    with pytest.raises(CommandError, match="2147483647"):
        call_command("fair_jobs_limit", "hooks", option, str(2**31))
    assert not QueueLimit.objects.exists() and not LimitChange.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("field", ["max_jobs", "max_jobs_per_worker"])
def test_set_limits__above_the_column__limit_error__nothing_changed(field: str) -> None:
    from django_fair_jobs import queue_limits

    too_many: dict[str, Any] = {field: 2**31}
    with pytest.raises(queue_limits.LimitError, match="2147483647"):
        queue_limits.set_limits("hooks", **too_many)
    assert not QueueLimit.objects.exists() and not LimitChange.objects.exists()
    largest: dict[str, Any] = {field: 2**31 - 1}  # the largest that fits
    assert queue_limits.set_limits("hooks", **largest).pk


@pytest.mark.django_db
def test_limit_command__tenant_max_jobs_above_the_column__clear_error() -> None:
    with pytest.raises(CommandError, match="2147483647"):
        call_command("fair_jobs_limit", "fair", "--tenant", "a", "--max-jobs", str(10**12))
    assert not TenantQueueSlot.objects.exists()


# Task ids (a lease, a planned job and a dispatched job store them in 255 characters) ---

LONG_TASK_ID = "k" * 256


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("task", [tasks.limited1, tasks.planned, tasks.dispatched])
def test_task_id_over_255__refused_at_publish__nothing_sent_or_stored(
    task: Any, broker_env: dict[str, str]
) -> None:
    with pytest.raises(TaskIdError, match="at most 255 characters"):
        task.apply_async(("acme",), task_id=LONG_TASK_ID)
    task.apply_async(("acme",), task_id="k" * 255)  # the longest id that fits
    assert broker_depth() + PlannedJob.objects.count() + DispatchJob.objects.count() == 1
    assert not DispatchJob.objects.filter(task_id=LONG_TASK_ID).exists()


@pytest.mark.django_db
def test_task_id_over_255_reaching_a_worker__fails_clearly__not_postponed_forever(
    process: uuid.UUID, broker_env: dict[str, str]
) -> None:
    # Only send_task by name can carry one. Without a slot row the job cannot be
    # admitted; postponing it would repeat forever, so it fails, saying why.
    with pytest.raises(TaskIdError, match="at most 255 characters"):
        run_as_worker(tasks.limited1, ("acme", 0), task_id=LONG_TASK_ID, headers={})
    assert broker_depth() == 0
    assert not JobRun.objects.exists() and not SlotLease.objects.exists()


@pytest.mark.django_db
def test_permanent_database_error_at_admission__fails__not_postponed(
    process: uuid.UUID, broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A value the database refuses (DataError) will be refused at every attempt:
    # only errors of an unreachable database are worth waiting out through the broker.
    from django.db import DataError

    from django_fair_jobs import admission

    def refuse(**_: Any) -> Any:
        raise DataError("value too long for type character varying(255)")

    monkeypatch.setattr(admission, "acquire", refuse)
    with pytest.raises(DataError):
        run_as_worker(tasks.limited1, ("acme", 0), task_id="data-error", headers={})
    assert broker_depth() == 0 and not JobRun.objects.exists()

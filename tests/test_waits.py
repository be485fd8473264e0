"""The wait histogram: waits counted at start, flushed to their rows, exposed as
``fair_jobs_wait_seconds`` and parsed back against known jobs."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from django_fair_jobs import headers, waits
from django_fair_jobs.checks import check_settings
from django_fair_jobs.dispatch.models import DispatchJob
from django_fair_jobs.metrics import METRICS, FairJobsCollector
from django_fair_jobs.models import WaitBucket
from django_fair_jobs.waits import store
from tests.conftest import Worker, wait_for
from tests.test_workers import wait_finished
from tests.testapp import tasks

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fresh_counts() -> Iterator[None]:
    """This process's counts and classes start empty."""
    waits._pending.clear()
    waits._classes.clear()
    yield
    waits._pending.clear()
    waits._classes.clear()


def histogram_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of fair_jobs_wait_seconds: {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "fair_jobs_wait_seconds"
        for s in family.samples
    }


def scrape_text() -> str:
    registry = CollectorRegistry()
    registry.register(FairJobsCollector())
    return generate_latest(registry).decode()


def test_wait_of__from_the_later_of_enqueue_and_eta() -> None:
    assert waits.wait_of(100.0, None, 103.5) == 3.5
    assert waits.wait_of(100.0, "1970-01-01T00:01:50+00:00", 113.0) == 3.0  # ETA 110
    assert waits.wait_of(100.0, "not a time", 101.0) == 1.0
    assert waits.wait_of(105.0, None, 100.0) == 0.0  # clocks apart: never negative
    assert waits.wait_of(None, None, 1.0) is None
    assert waits.wait_of("soon", None, 1.0) is None
    assert waits.wait_of(float("nan"), None, 1.0) is None


def test_observe__no_statement__flush__one_statement_into_the_right_buckets() -> None:
    now = time.time()
    with CaptureQueriesContext(connection) as queries:
        waits.observe("q", "acme", now - 3)  # 2.5 < 3 <= 5
        waits.observe("q", "acme", now - 3)
        waits.observe("q", "zeta", now - 7200)  # past the last bound: +Inf
    assert queries.captured_queries == []
    assert waits.pending() == 3
    with CaptureQueriesContext(connection) as queries:
        assert waits.flush() == 3
    assert len(queries.captured_queries) == 1
    assert waits.pending() == 0
    counts, total = waits.histogram()[("q", "all")]
    assert counts[waits.BUCKETS.index(5.0)] == 2
    assert counts[-1] == 1 and sum(counts) == 3
    assert total == pytest.approx(7206, abs=1)


def test_flush__adds_to_the_rows__two_processes_counts_sum() -> None:
    # Each wait is taken just before its observe: a slow first flush (a loaded CI
    # machine) must not push the later waits past the first bucket's 0.1 s.
    waits.observe("q", None, time.time() - 0.01)
    waits.flush()
    waits.observe("q", None, time.time() - 0.01)
    waits.observe("q", None, time.time() - 0.01)
    waits.flush()
    assert WaitBucket.objects.get(queue="q", bucket=0).count == 3


def test_flush__database_error__counts_kept_for_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    waits.observe("q", None, time.time() - 1.5)

    def down(counts: Any) -> None:
        raise RuntimeError("database down")

    monkeypatch.setattr(store, "add", down)
    with pytest.raises(RuntimeError):
        waits.flush()
    assert waits.pending() == 1
    monkeypatch.undo()
    assert waits.flush() == 1
    assert not waits._pending


def classify(tenant: str | None) -> str:
    if tenant == "boom":
        raise ValueError("no class")
    return "premium" if (tenant or "").startswith("p") else str(tenant)


def test_tenant_class__the_settings_callable__bounded(settings: Any) -> None:
    assert waits.tenant_class("acme") == waits.ALL
    settings.FAIR_JOBS_METRICS_TENANT_CLASS = "tests.test_waits.classify"
    assert waits.tenant_class("pear") == "premium"
    assert waits.tenant_class("boom") == waits.OTHER
    for n in range(waits.MAX_CLASSES + 5):
        waits.tenant_class(f"t{n}")
    assert waits.tenant_class("t1") == "t1"  # among the first classes
    assert waits.tenant_class(f"t{waits.MAX_CLASSES + 3}") == waits.OTHER
    assert len(waits._classes) == waits.MAX_CLASSES


def test_tenant_class_setting__invalid__check_error(settings: Any) -> None:
    settings.FAIR_JOBS_METRICS_TENANT_CLASS = "no.such.module.classify"
    errors = [e for e in check_settings() if e.id == "fair_jobs.E017"]
    assert any("FAIR_JOBS_METRICS_TENANT_CLASS" in e.msg for e in errors)


def test_exposition__cumulative_buckets_count_and_sum(settings: Any) -> None:
    settings.FAIR_JOBS_METRICS_TENANT_CLASS = "tests.test_waits.classify"
    now = time.time()
    for seconds in (0.05, 0.3, 0.3, 20.0):
        waits.observe("imports", "pear", now - seconds)
    waits.observe("imports", "t1", now - 0.05)
    waits.flush()
    samples = histogram_samples(scrape_text())

    def bucket(le: str, cls: str = "premium") -> float:
        key = (("le", le), ("queue", "imports"), ("tenant_class", cls))
        return samples[("fair_jobs_wait_seconds_bucket", key)]

    assert [bucket(le) for le in ("0.1", "0.25", "0.5", "10", "30", "+Inf")] == [
        1, 1, 3, 3, 4, 4,
    ]  # fmt: skip
    labels = (("queue", "imports"), ("tenant_class", "premium"))
    assert samples[("fair_jobs_wait_seconds_count", labels)] == 4
    assert samples[("fair_jobs_wait_seconds_sum", labels)] == pytest.approx(20.65, abs=0.05)
    assert bucket("+Inf", "t1") == 1


def test_enqueue__stamps_the_time__a_re_publish_keeps_it(published: list[int]) -> None:
    before = time.time()
    job = tasks.dispatched.delay("acme")
    row = DispatchJob.objects.get(task_id=job.id)
    stamped = json.loads(row.message)["headers"][headers.ENQUEUED_AT]
    assert before <= stamped <= time.time()


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from django_fair_jobs import dispatch

    out: list[int] = []
    monkeypatch.setattr(dispatch, "publish", lambda app, ready: out.extend(r.job_id for r in ready))
    return out


@pytest.mark.workers
def test_real_workers__every_start_counted_once__queue_gauges(
    start_worker: Callable[..., Worker],
) -> None:
    # Known jobs: 6 dispatched and 4 with tenant slots, one of them retried (counted once).
    worker = start_worker("w", concurrency=2, extra_env={"FAIR_JOBS_HEARTBEAT_INTERVAL": "0.5"})
    ids = [tasks.dispatched.delay(f"t{i % 3}").id for i in range(6)]
    ids += [tasks.limited3.delay("acme").id for _ in range(3)]
    ids.append(tasks.dispatched_retrying.delay("r").id)
    wait_finished(ids, timeout=60)

    def counted() -> float:
        samples = histogram_samples(scrape_text())
        return sum(v for (name, _), v in samples.items() if name.endswith("_count"))

    wait_for(lambda: counted() >= 10, 20, "the workers to flush their counts")
    worker.stop()  # its shutdown flushes whatever is left: nothing more may appear
    assert counted() == 10
    text = scrape_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    capacity = {s.labels["queue"]: s.value for s in families["fair_jobs_queue_capacity"].samples}
    assert "fair" in capacity
    depth = {s.labels["queue"]: s.value for s in families["fair_jobs_queue_waiting"].samples}
    assert depth.get("fair") == 0


def test_grafana_dashboard__every_query_names_exported_metrics() -> None:
    names = {s.name for s in METRICS} | {
        f"fair_jobs_wait_seconds_{suffix}" for suffix in ("bucket", "count", "sum")
    }
    dashboard = json.loads((ROOT / "docs/grafana/django-fair-jobs.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    used = {m for e in exprs for m in re.findall(r"\bfair_jobs_[a-z_]+", e)}
    assert used and used <= names, used - names
    assert any("histogram_quantile(0.95" in e for e in exprs)


def test_alert_rules__shipped_file_is_the_documented_one__names_exported() -> None:
    doc = (ROOT / "docs/metrics.md").read_text()
    section = doc[doc.index("## Example alert rules") :]
    start = section.index("```yaml\n") + len("```yaml\n")
    block = section[start : section.index("\n```", start)]
    shipped = (ROOT / "docs/grafana/alerts.yml").read_text()
    assert block.strip() in shipped
    names = {s.name for s in METRICS} | {"fair_jobs_wait_seconds_bucket"}
    used = set(re.findall(r"\bfair_jobs_[a-z_]+", block))
    assert used <= names, used - names
    assert "FairJobsWaitP95High" in block

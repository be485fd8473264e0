"""What an operator sees during a real dispatched flood, on real workers: status, the
exporter's gauges and explain list the waiting tenant with its counts and its cap in
force (issue: operators see the default mode, acceptance)."""

from __future__ import annotations

import json
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command

from django_fair_jobs.explanations import explain
from tests.conftest import Worker, wait_for
from tests.test_metrics import scrape, value
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]


def _status() -> dict[str, dict[str, Any]]:
    out = StringIO()
    call_command("fair_jobs_status", "--json", stdout=out)
    return {t["tenant"]: t for t in json.loads(out.getvalue())["tenants"]}


def test_dispatched_flood__status_metrics_and_explain_show_the_waiting_tenant(
    start_worker: Callable[..., Worker],
) -> None:
    call_command("fair_jobs_limit", "fair", "--tenant", "big", "--max-jobs", "1", stdout=StringIO())
    start_worker("w", pool="threads", concurrency=2)
    big = [tasks.dispatched.delay("big", 0.4) for _ in range(8)]
    small = tasks.dispatched.delay("small", 0.01)
    wait_for(lambda: _status().get("big", {}).get("running") == 1, 30, "big to run one job")
    rows = _status()
    assert rows["big"]["waiting"] >= 5
    (queue,) = rows["big"]["queues"]
    assert (queue["queue"], queue["limit"], queue["limit_source"]) == ("fair", 1, "override")
    assert "at its cap: 1 of 1 running" in queue["holds"]
    assert rows["big"]["oldest_wait_seconds"] is not None
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_max_jobs", tenant="big", queue="fair") == 1
    assert (value(samples, "fair_jobs_tenant_waiting", tenant="big", queue="fair") or 0) >= 4
    assert "at its cap: 1 of 1 running" in explain(big[-1].id).summary
    assert small.get(timeout=30) == "small:done"
    assert [r.get(timeout=60) for r in big] == ["big:done"] * 8
    # Still listed (its tenant slot has an override), with nothing left once the ends
    # are flushed.
    wait_for(
        lambda: (_status()["big"]["running"], _status()["big"]["waiting"]) == (0, 0),
        20,
        "big's ends to be flushed",
    )

"""One cap, everywhere the same: after ``fair_jobs_limit Q --tenant T --max-jobs 1``,
explain, status, the admin pages and the metrics all report 1 for a dispatched tenant, and
explain's reason names the cap; ``--max-jobs default`` takes it back everywhere; a paused
queue is reported as paused by each (issue: operators see the default mode, items 1-2)."""

from __future__ import annotations

import json
import re
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client

from django_fair_jobs import status
from django_fair_jobs.explanations import explain
from tests.dispatch.test_rule import published, set_capacity  # noqa: F401
from tests.test_admin_console import login
from tests.test_metrics import scrape, value
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]

LINES = "/admin/fair_jobs/dispatchtenant/"
SLOTS = "/admin/fair_jobs/tenantqueueslot/"
DASHBOARD = "/admin/fair_jobs/dashboard/"


def _flood(published: list[int]) -> list[str]:  # noqa: F811
    """Capacity 3; big capped at 1 by its tenant slot, then 5 jobs: 1 dispatched."""
    set_capacity(3)
    call_command("fair_jobs_limit", "fair", "--tenant", "big", "--max-jobs", "1", stdout=StringIO())
    ids = [tasks.dispatched.delay("big").id for _ in range(5)]
    assert len(published) == 1
    return ids


def _status_queue(tenant: str) -> dict[str, object]:
    out = StringIO()
    call_command("fair_jobs_status", "--json", stdout=out)
    rows = {t["tenant"]: t for t in json.loads(out.getvalue())["tenants"]}
    (queue,) = [q for q in rows[tenant]["queues"] if q["queue"] == "fair"]
    assert rows[tenant]["waiting"] == queue["waiting"]
    return queue  # type: ignore[no-any-return]


def _cell(html: str, column: str) -> list[str]:
    """The text of each cell of ``column`` (a list page's ``field-<name>`` cells)."""
    return [
        re.sub(r"<[^>]+>", "", cell).strip()
        for cell in re.findall(rf'<td class="field-{column}"[^>]*>(.*?)</td>', html, re.S)
    ]


def test_tenant_override_of_1__every_view_says_1__explain_names_the_cap(
    published: list[int],  # noqa: F811
    client: Client,
) -> None:
    ids = _flood(published)
    found = explain(ids[-1])
    assert found.details["tenant_cap"] == 1
    assert "at its cap: 1 of 1 running" in found.summary
    assert "fewest jobs in flight" not in found.summary
    queue = _status_queue("big")
    assert (queue["limit"], queue["running"], queue["waiting"]) == (1, 1, 4)
    text = status.as_text(status.snapshot())
    assert "big: running fair 1/1, 4 in line (its tenant is at its cap: 1 of 1 running" in text
    samples = scrape()
    assert value(samples, "fair_jobs_tenant_max_jobs", tenant="big", queue="fair") == 1
    assert value(samples, "fair_jobs_tenant_waiting", tenant="big", queue="fair") == 4
    assert value(samples, "fair_jobs_tenant_running", tenant="big", queue="fair") == 1
    login(client, "ops", perms=("view_dispatchtenant", "view_tenantqueueslot", "view_dashboard"))
    assert _cell(client.get(LINES).content.decode(), "cap_in_force") == ["1"]
    assert _cell(client.get(SLOTS).content.decode(), "limit_in_force") == ["1"]
    dashboard = client.get(DASHBOARD).content.decode()
    assert 'data-queue="fair" data-limit="1"' in dashboard


def test_override_back_to_default__the_task_cap_everywhere__none_for_an_uncapped_task(
    published: list[int],  # noqa: F811
    client: Client,
) -> None:
    ids = _flood(published)
    call_command("fair_jobs_limit", "fair", "--tenant", "big", "--max-jobs", "default",
                 stdout=StringIO())  # fmt: skip
    assert explain(ids[-1]).details["tenant_cap"] is None
    assert _status_queue("big")["limit"] is None
    assert value(scrape(), "fair_jobs_tenant_max_jobs", tenant="big", queue="fair") is None
    login(client, "ops", perms=("view_dispatchtenant", "view_tenantqueueslot"))
    assert _cell(client.get(LINES).content.decode(), "cap_in_force") == ["-"]
    # The slot row stays, with a task default of tenant slots that does not apply to the
    # tenant's dispatched jobs.
    assert _cell(client.get(SLOTS).content.decode(), "limit_in_force") == ["-"]


def test_paused_queue__each_view_says_paused(published: list[int], client: Client) -> None:  # noqa: F811
    set_capacity(3)
    call_command("fair_jobs_limit", "fair", "--max-jobs", "0", stdout=StringIO())
    job = tasks.dispatched.delay("acme")
    assert published == []
    found = explain(job.id)
    assert found.details["queue_paused"] is True
    assert "the queue fair is paused" in found.summary
    assert _status_queue("acme")["queue_paused"] is True
    (row,) = [d for d in status.snapshot()["dispatch"] if d["queue"] == "fair"]
    assert row["held_by"] == "the queue fair is paused (a limit of 0)"
    login(client, "ops", perms=("view_dispatchtenant", "view_dashboard"))
    assert _cell(client.get(LINES).content.decode(), "cap_in_force") == ["-; queue paused"]
    assert "(queue paused)" in client.get(DASHBOARD).content.decode()
    assert value(scrape(), "fair_jobs_queue_max_jobs", queue="fair") == 0


def test_no_worker__explain_gives_one_reason(published: list[int]) -> None:  # noqa: F811
    job = tasks.dispatched.delay("acme")
    summary = explain(job.id).summary
    assert "no live worker consumes fair" in summary
    assert "busy" not in summary

"""The admin console: editing limits, pausing, reaping; bad input is refused."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client

from django_fair_jobs import identity
from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.reroute import store as reroute_store
from django_fair_jobs.slots import store as slot_store

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def staff(client: Client) -> Client:
    user = User.objects.create_superuser("ops", "ops@example.com", "pw")
    client.force_login(user)
    return client


def acquire(process: uuid.UUID, task_id: str, limit: int = 1) -> Any:
    return slot_store.try_acquire(
        tenant="acme", queue="q", task_id=task_id, limit=limit, process_id=process, timeout=60
    ).grant


def test_changelist__lists_slots_with_search_and_filter(staff: Client, process: uuid.UUID) -> None:
    acquire(process, "j1")
    response = staff.get("/admin/fair_jobs/tenantqueueslot/", {"q": "acme", "queue": "q"})
    assert response.status_code == 200
    assert b"acme" in response.content


def test_edit_limit__takes_effect_on_next_job(staff: Client, process: uuid.UUID) -> None:
    assert acquire(process, "j1") is not None
    assert acquire(process, "j2") is None
    slot = TenantQueueSlot.objects.get()
    response = staff.post(
        f"/admin/fair_jobs/tenantqueueslot/{slot.pk}/change/",
        {
            "max_jobs": "2",
            "leases-TOTAL_FORMS": "1",
            "leases-INITIAL_FORMS": "1",
            "leases-MIN_NUM_FORMS": "0",
            "leases-MAX_NUM_FORMS": "1000",
            "leases-0-id": str(SlotLease.objects.get().pk),
            "leases-0-slot": str(slot.pk),
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    assert acquire(process, "j2") is not None
    slot.refresh_from_db()
    assert (slot.max_jobs, slot.current_jobs) == (2, 2)


def test_edit_limit__negative__refused_with_message(staff: Client, process: uuid.UUID) -> None:
    acquire(process, "j1")
    slot = TenantQueueSlot.objects.get()
    response = staff.post(
        f"/admin/fair_jobs/tenantqueueslot/{slot.pk}/change/",
        {
            "max_jobs": "-3",
            "leases-TOTAL_FORMS": "0",
            "leases-INITIAL_FORMS": "0",
            "leases-MIN_NUM_FORMS": "0",
            "leases-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 200
    assert b"greater than or equal to 0" in response.content
    slot.refresh_from_db()
    assert slot.max_jobs is None


def test_edit_limit__raising_wakes_parked_jobs(
    staff: Client, process: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    published: list[str] = []
    monkeypatch.setattr(
        "django_fair_jobs.messages.publish_woken",
        lambda job, app=None: published.append(job.task_id),
    )
    acquire(process, "j1")
    slot_store.try_park(
        tenant="acme", queue="q", task_id="j2", task_name="t", limit=1, signature="{}"
    )
    slot = TenantQueueSlot.objects.get()
    staff.post(
        f"/admin/fair_jobs/tenantqueueslot/{slot.pk}/change/",
        {
            "max_jobs": "2",
            "leases-TOTAL_FORMS": "0",
            "leases-INITIAL_FORMS": "0",
            "leases-MIN_NUM_FORMS": "0",
            "leases-MAX_NUM_FORMS": "1000",
        },
    )
    assert published == ["j2"]
    assert ParkedJob.objects.get().woken_at is not None


def test_action_pause__sets_limit_zero(staff: Client, process: uuid.UUID) -> None:
    grant = acquire(process, "j1")
    slot = TenantQueueSlot.objects.get()
    staff.post(
        "/admin/fair_jobs/tenantqueueslot/",
        {"action": "pause_tenants", "_selected_action": [slot.pk]},
    )
    slot_store.release(grant)
    assert acquire(process, "j2") is None
    assert TenantQueueSlot.objects.get().max_jobs == 0


def test_action_reap__releases_dead_workers_only(staff: Client, process: uuid.UUID) -> None:
    acquire(process, "j1")
    dead = uuid.uuid4()
    identity.register_process(process_id=dead, node="d@h", hostname="h", pid=2)
    slot_store.try_acquire(
        tenant="other", queue="q", task_id="j9", limit=1, process_id=dead, timeout=60
    )
    # Time passes: the dead worker's heartbeat and lease both age beyond the timeout.
    WorkerProcess.objects.filter(pk=dead).update(last_heartbeat_at="2000-01-01T00:00:00Z")
    SlotLease.objects.filter(process_id=dead).update(acquired_at="2000-01-01T00:00:00Z")
    slot = TenantQueueSlot.objects.get(tenant="acme")
    staff.post(
        "/admin/fair_jobs/tenantqueueslot/",
        {"action": "reap_dead_workers", "_selected_action": [slot.pk]},
    )
    assert TenantQueueSlot.objects.get(tenant="other").current_jobs == 0
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 1


def test_parked_and_process_pages__render_read_only(staff: Client, process: uuid.UUID) -> None:
    acquire(process, "j1")
    slot_store.try_park(
        tenant="acme", queue="q", task_id="j2", task_name="t", limit=1, signature="{}"
    )
    assert staff.get("/admin/fair_jobs/parkedjob/").status_code == 200
    assert staff.get("/admin/fair_jobs/workerprocess/").status_code == 200
    assert staff.get("/admin/fair_jobs/parkedjob/add/").status_code == 403


def test_reap_command__prints_report(
    process: uuid.UUID, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    acquire(process, "j1")
    WorkerProcess.objects.update(last_heartbeat_at="2000-01-01T00:00:00Z")
    SlotLease.objects.update(acquired_at="2000-01-01T00:00:00Z")
    with caplog.at_level(logging.INFO, logger="django_fair_jobs.maintenance"):
        call_command("fair_jobs_reap")
    out = capsys.readouterr().out
    assert "Reaped 1 lease(s) on 1 tenant slot(s) and 0 queue(s)" in out
    assert TenantQueueSlot.objects.get().current_jobs == 0
    # The log says what the command printed, in the same words.
    logged = [r.getMessage() for r in caplog.records if r.name == "django_fair_jobs.maintenance"]
    assert logged == [f"Maintenance: {out.split(' (timeout')[0]}"], (logged, out)


def test_reap_command__bad_timeout__command_error() -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="at least twice"):
        call_command("fair_jobs_reap", "--timeout", "0.9")  # test interval: 0.5 s


def test_migrations__in_sync() -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_parked_jobs_and_processes__cannot_be_deleted(staff: Client, process: uuid.UUID) -> None:
    acquire(process, "j1")
    slot_store.try_park(
        tenant="acme", queue="q", task_id="j2", task_name="t", limit=1, signature="{}"
    )
    parked = ParkedJob.objects.get()
    assert (
        staff.post(f"/admin/fair_jobs/parkedjob/{parked.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    assert (
        staff.post(f"/admin/fair_jobs/workerprocess/{process}/delete/", {"post": "yes"}).status_code
        == 403
    )
    assert ParkedJob.objects.exists() and WorkerProcess.objects.filter(pk=process).exists()


def test_window_pages__show_current_counts_and_reroutes_read_only(staff: Client) -> None:
    from django_fair_jobs.models import RerouteCount, TenantWindow
    from tests.testapp import tasks

    for _ in range(4):
        reroute_store.record(
            key=f"task:{tasks.rerouted.name}",
            tenant="acme",
            task_name=tasks.rerouted.name,
            rules=[(60, 2, "fair_slow")],
        )
    page = staff.get("/admin/fair_jobs/tenantwindow/")
    assert page.status_code == 200
    # The rerouted task's rule counts over 60 s: all four enqueues are in it now.
    assert "4 in 60 s" in page.content.decode()
    reroutes = staff.get("/admin/fair_jobs/reroutecount/")
    assert reroutes.status_code == 200 and "fair_slow" in reroutes.content.decode()
    assert RerouteCount.objects.get().total == 2
    window = TenantWindow.objects.get()
    assert staff.get(f"/admin/fair_jobs/tenantwindow/{window.pk}/delete/").status_code == 403
    assert staff.get("/admin/fair_jobs/tenantwindow/add/").status_code == 403


def test_queue_limits__listed_with_running_by_node_and_edited_without_touching_counters(
    staff: Client, process: uuid.UUID
) -> None:
    from django_fair_jobs import queue_limits
    from django_fair_jobs.identity import current_node_id
    from django_fair_jobs.models import QueueLimit

    queue_limits.set_limits("hooks", max_jobs=1)
    WorkerProcess.objects.filter(pk=process).update(node_id=current_node_id())
    got = queue_store.try_acquire(
        queue="hooks", tenant=None, limit=1, task_id="j1", process_id=process,
        node_id=current_node_id(),
    )  # fmt: skip
    assert got.status == "held"
    page = staff.get("/admin/fair_jobs/queuelimit/")
    assert page.status_code == 200
    assert b"n@h: 1" in page.content
    row = QueueLimit.objects.get()
    response = staff.post(
        f"/admin/fair_jobs/queuelimit/{row.pk}/change/",
        {"max_jobs": "0", "max_jobs_per_worker": "2"},
    )
    assert response.status_code == 302, response.content
    row.refresh_from_db()
    assert (row.max_jobs, row.max_jobs_per_worker, row.current_jobs) == (0, 2, 1)
    bad = staff.post(f"/admin/fair_jobs/queuelimit/{row.pk}/change/", {"max_jobs": "-1"})
    assert bad.status_code == 200 and b"greater than or equal to 0" in bad.content
    added = staff.post("/admin/fair_jobs/queuelimit/add/", {"queue": "email", "max_jobs": "3"})
    assert added.status_code == 302
    assert QueueLimit.objects.get(queue="email").max_jobs == 3


def test_planner_tenants__backlog_listed_and_promotion_paused_from_the_admin(staff: Client) -> None:
    from django_fair_jobs import planner
    from django_fair_jobs.models import PlannedJob, PlannerTenant
    from tests.testapp import tasks

    tasks.planned.delay("acme")
    tasks.planned.delay("other")
    call_command("fair_jobs_plan", tasks.planned.name)  # creates the tenants' rows
    tasks.planned.delay("acme")
    tasks.planned.delay("other")
    page = staff.get("/admin/fair_jobs/plannertenant/")
    assert page.status_code == 200 and b"acme" in page.content
    acme = PlannerTenant.objects.get(tenant="acme")
    staff.post(
        "/admin/fair_jobs/plannertenant/",
        {"action": "pause_promotion", "_selected_action": [str(acme.pk)]},
    )
    report = planner.run(tasks.planned, due_only=False)
    assert report is not None and report.counts == {"other": 1}
    assert PlannedJob.objects.filter(tenant="acme", promoted_at__isnull=True).count() == 1

"""The admin as an operations console: the dashboard, permissions on every page and
action, the actions themselves, the boost form and the read-only history pages."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client, override_settings
from kombu.utils.json import dumps

from django_fair_jobs import decisions, identity, queue_limits, slots
from django_fair_jobs.db import database_now
from django_fair_jobs.models import (
    JobDecision,
    LimitChange,
    Maintenance,
    ParkedJob,
    PlannerTenant,
    QueueLimit,
    SlotLease,
    TenantQueueSlot,
    TenantWindow,
    WorkerProcess,
)
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.reroute import store as reroute_store
from django_fair_jobs.slots import store as slot_store
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)

NODE = uuid.uuid4()
OLD = "2000-01-01T00:00:00Z"
DASHBOARD = "/admin/fair_jobs/dashboard/"
SLOTS = "/admin/fair_jobs/tenantqueueslot/"
QUEUES = "/admin/fair_jobs/queuelimit/"
WINDOWS = "/admin/fair_jobs/tenantwindow/"
PLANNER_TENANTS = "/admin/fair_jobs/plannertenant/"
NO_LEASES = {
    "leases-TOTAL_FORMS": "0",
    "leases-INITIAL_FORMS": "0",
    "leases-MIN_NUM_FORMS": "0",
    "leases-MAX_NUM_FORMS": "1000",
}


@pytest.fixture(autouse=True)
def _empty_broker(broker_env: dict[str, str]) -> None:
    """Wake-ups publish for real: start from an empty broker."""


def login(
    client: Client, username: str, *, staff: bool = True, perms: tuple[str, ...] = ()
) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=staff)
    for codename in perms:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="fair_jobs", codename=codename)
        )
    client.force_login(user)
    return user


@pytest.fixture
def ops(client: Client) -> Client:
    """A superuser named ops."""
    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    return client


@pytest.fixture
def process() -> uuid.UUID:
    pid = uuid.uuid4()
    identity.register_process(
        process_id=pid, node="n1@host", hostname="host", pid=4242, node_id=NODE
    )
    return pid


def acquire(process: uuid.UUID, task_id: str, tenant: str = "acme", limit: int = 1) -> None:
    got = slot_store.try_acquire(
        tenant=tenant, queue="q", task_id=task_id, limit=limit, process_id=process, timeout=60
    )
    assert got.grant is not None, got.status


def park(task_id: str, tenant: str = "acme") -> None:
    signature = dumps(dict(tasks.limited1.signature((tenant, 0), task_id=task_id)))
    outcome = slot_store.try_park(
        tenant=tenant, queue="q", task_id=task_id, task_name=tasks.limited1.name, limit=1,
        signature=str(signature),
    )  # fmt: skip
    assert outcome == "parked"


def act(client: Client, url: str, action: str, *pks: Any, follow: bool = False) -> Any:
    return client.post(
        url, {"action": action, "_selected_action": [str(pk) for pk in pks]}, follow=follow
    )


def history(**filters: Any) -> list[tuple[str, str, str, str, str]]:
    return [
        (c.user, c.source, c.field, c.old_value, c.new_value)
        for c in LimitChange.objects.filter(**filters).order_by("id")
    ]


def texts(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def record_window(tenant: str) -> None:
    reroute_store.record(
        key=f"task:{tasks.rerouted.name}", tenant=tenant, task_name=tasks.rerouted.name,
        rules=[(60, 2, "fair_slow")],
    )  # fmt: skip


# -- the dashboard ---------------------------------------------------------------------------


def test_dashboard__tenants_queues_nodes_and_refresh(ops: Client, process: uuid.UUID) -> None:
    acquire(process, "j1", limit=2)
    queue_limits.set_limits("hooks", max_jobs=3, max_jobs_per_worker=1)
    page = ops.get(DASHBOARD)
    assert page.status_code == 200
    html = page.content.decode()
    assert '<meta http-equiv="refresh" content="10">' in html
    assert 'data-tenant="acme"' in html and "q: 1 / 2" in html
    # Beside the tenant's name, links to its rows of both mechanisms: fair dispatch's
    # lines (the default) and tenant slots; its name led to the tenant slots only.
    assert 'href="/admin/fair_jobs/dispatchtenant/?q=acme">lines</a>' in html
    assert 'href="/admin/fair_jobs/tenantqueueslot/?q=acme">tenant slots</a>' in html
    assert 'data-queue="hooks"' in html
    assert "n1@host" in html and "alive" in html
    assert 'id="fair-shadow"' not in html
    assert page.context["snapshot"]["tenants"][0]["tenant"] == "acme"
    with override_settings(FAIR_JOBS_DASHBOARD_REFRESH=0):
        still = ops.get(DASHBOARD).content.decode()
    assert 'http-equiv="refresh"' not in still and 'data-tenant="acme"' in still
    with override_settings(FAIR_JOBS_DASHBOARD_REFRESH=30):
        assert '<meta http-equiv="refresh" content="30">' in ops.get(DASHBOARD).content.decode()


def test_dashboard__longest_waits_first__the_rest_counted(
    ops: Client, process: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("django_fair_jobs.admin.history.DASHBOARD_TENANTS", 2)
    for tenant, age_s in (("calm", None), ("late", 200), ("later", 500)):
        acquire(process, f"{tenant}-run", tenant=tenant)
        if age_s is not None:
            park(f"{tenant}-wait", tenant=tenant)
            ParkedJob.objects.filter(task_id=f"{tenant}-wait").update(
                parked_at=database_now() - timedelta(seconds=age_s)
            )
    page = ops.get(DASHBOARD)
    assert [t["tenant"] for t in page.context["tenants"]] == ["later", "late"]
    html = page.content.decode()
    assert 'data-tenant="calm"' not in html
    assert 'id="fair-tenants-hidden">1 more tenant(s) wait less' in html


def test_dashboard__a_planners_tenants_bounded_like_the_tenants(
    ops: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("django_fair_jobs.admin.history.DASHBOARD_TENANTS", 1)
    for tenant in ("a", "b", "c"):
        tasks.planned.delay(tenant)
    html = ops.get(DASHBOARD).content.decode()
    assert "; 3 tenants in all, the longest waits shown" in html
    assert html.count("(paused)") == 0 and ": 1 (" in html


def test_dashboard__shadow_banner(ops: Client) -> None:
    with override_settings(FAIR_JOBS_ENFORCE=False):
        html = ops.get(DASHBOARD).content.decode()
    assert 'id="fair-shadow"' in html and "Shadow mode" in html


def test_dashboard__paused_tenant_and_queue_are_marked(ops: Client) -> None:
    slots.set_tenant_limit("acme", "q", 0)
    queue_limits.set_limits("hooks", max_jobs=0)
    html = ops.get(DASHBOARD).content.decode()
    assert "q: 0 / 0 (paused)" in html
    assert "hooks <strong>(paused)</strong>" in html


# -- permissions -----------------------------------------------------------------------------


@pytest.mark.parametrize("url", [DASHBOARD, SLOTS, QUEUES, WINDOWS])
def test_anonymous_and_non_staff__sent_to_the_login_page(client: Client, url: str) -> None:
    anonymous = client.get(url)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/admin/login/")
    login(client, "visitor", staff=False)
    logged_in = client.get(url)
    assert logged_in.status_code == 302 and logged_in["Location"].startswith("/admin/login/")


def test_staff_without_permissions__403_on_pages_and_actions__nothing_changes(
    client: Client, process: uuid.UUID
) -> None:
    acquire(process, "j1")
    slots.set_tenant_limit("paused", "q", 0)
    queue_limits.set_limits("hooks", max_jobs=3)
    record_window("acme")
    PlannerTenant.objects.create(task_name=tasks.planned.name, tenant="acme")
    dead = uuid.uuid4()
    identity.register_process(process_id=dead, node="d@h", hostname="h", pid=2)
    acquire(dead, "d1", tenant="other")
    WorkerProcess.objects.filter(pk=dead).update(last_heartbeat_at=OLD)
    SlotLease.objects.filter(process_id=dead).update(acquired_at=OLD)
    changes = LimitChange.objects.count()
    login(client, "intern")
    for url in (DASHBOARD, SLOTS, QUEUES, WINDOWS, PLANNER_TENANTS):
        assert client.get(url).status_code == 403, url
    slot = TenantQueueSlot.objects.get(tenant="acme")
    paused = TenantQueueSlot.objects.get(tenant="paused")
    queue = QueueLimit.objects.get()
    window = TenantWindow.objects.get()
    planner_tenant = PlannerTenant.objects.get()
    posts = [
        (SLOTS, "pause_tenants", slot.pk),
        (SLOTS, "clear_overrides", paused.pk),
        (SLOTS, "reap_dead_workers", slot.pk),
        (QUEUES, "pause_queues", queue.pk),
        (QUEUES, "reap_dead_workers", queue.pk),
        (WINDOWS, "reset_windows", window.pk),
        (PLANNER_TENANTS, "pause_promotion", planner_tenant.pk),
    ]
    for url, action, pk in posts:
        assert act(client, url, action, pk).status_code == 403, action
    edit = client.post(f"{SLOTS}{slot.pk}/change/", {"max_jobs": "5", **NO_LEASES})
    assert edit.status_code == 403
    assert TenantQueueSlot.objects.get(tenant="acme").max_jobs is None
    assert TenantQueueSlot.objects.get(tenant="paused").max_jobs == 0
    assert TenantQueueSlot.objects.get(tenant="other").current_jobs == 1  # not reaped
    assert QueueLimit.objects.get().max_jobs == 3
    assert TenantWindow.objects.exists()
    assert PlannerTenant.objects.get().paused is False
    assert LimitChange.objects.count() == changes


def test_staff_with_dashboard_permission_only__sees_the_dashboard_only(client: Client) -> None:
    slots.set_tenant_limit("acme", "q", 2)
    login(client, "watcher", perms=("view_dashboard",))
    page = client.get(DASHBOARD)
    assert page.status_code == 200 and 'data-tenant="acme"' in page.content.decode()
    assert client.get(SLOTS).status_code == 403


def test_staff_with_view_permission_only__cannot_pause_or_edit(
    client: Client, process: uuid.UUID
) -> None:
    acquire(process, "j1")
    slot = TenantQueueSlot.objects.get()
    login(client, "viewer", perms=("view_tenantqueueslot",))
    page = client.get(SLOTS)
    assert page.status_code == 200
    assert "pause_tenants" not in page.content.decode()
    act(client, SLOTS, "pause_tenants", slot.pk)
    assert client.get(DASHBOARD).status_code == 403
    boost = client.post(
        f"{SLOTS}{slot.pk}/change/",
        {"boost_max_jobs": "5", "boost_until_time": "2099-01-01 00:00:00", **NO_LEASES},
    )
    assert boost.status_code == 403
    assert TenantQueueSlot.objects.get().max_jobs is None
    assert not LimitChange.objects.exists()


# -- actions ---------------------------------------------------------------------------------


def test_action_pause_tenants__limit_zero__history_names_the_user(
    ops: Client, process: uuid.UUID
) -> None:
    acquire(process, "j1")
    acquire(process, "o1", tenant="other")
    acme = TenantQueueSlot.objects.get(tenant="acme")
    response = act(ops, SLOTS, "pause_tenants", acme.pk, follow=True)
    assert any("Paused 1 slot(s)" in m for m in texts(response))
    assert TenantQueueSlot.objects.get(tenant="acme").max_jobs == 0
    assert TenantQueueSlot.objects.get(tenant="other").max_jobs is None
    assert history() == [("ops", "admin", "max_jobs", "", "0")]
    assert LimitChange.objects.get().tenant == "acme"


def test_action_clear_overrides__wakes_parked_jobs(ops: Client) -> None:
    slots.set_tenant_limit("acme", "q", 0)
    park("j1")
    slot = TenantQueueSlot.objects.get()
    assert slot.parked_jobs == 1
    response = act(ops, SLOTS, "clear_overrides", slot.pk, follow=True)
    assert any("Cleared 1 override(s)" in m for m in texts(response))
    slot.refresh_from_db()
    assert (slot.max_jobs, slot.current_jobs, slot.parked_jobs) == (None, 1, 0)
    assert ParkedJob.objects.get().woken_at is not None
    assert SlotLease.objects.filter(task_id="j1", process__isnull=True).exists()
    assert history()[-1] == ("ops", "admin", "max_jobs", "0", "")


def test_action_reap_dead_workers__from_slots_and_queues(ops: Client, process: uuid.UUID) -> None:
    acquire(process, "live")
    queue_limits.set_limits("hooks", max_jobs=2)
    dead = uuid.uuid4()
    identity.register_process(process_id=dead, node="d@h", hostname="h", pid=2, node_id=NODE)
    acquire(dead, "d1", tenant="other")
    WorkerProcess.objects.filter(pk=dead).update(last_heartbeat_at=OLD)
    SlotLease.objects.filter(process_id=dead).update(acquired_at=OLD)
    slot = TenantQueueSlot.objects.get(tenant="acme")
    response = act(ops, SLOTS, "reap_dead_workers", slot.pk, follow=True)
    # The pass's one summary, as the command prints and the log writes it.
    assert any(
        "Reaped 1 lease(s) on 1 tenant slot(s) and 0 queue(s)" in m
        and "published 0 again (not started in time)" in m
        for m in texts(response)
    ), texts(response)
    assert TenantQueueSlot.objects.get(tenant="other").current_jobs == 0
    assert TenantQueueSlot.objects.get(tenant="acme").current_jobs == 1  # alive: kept
    assert not WorkerProcess.objects.filter(pk=dead).exists()
    assert Maintenance.objects.get(name="reaped").leases_reaped_total == 1
    # The same action on the queue page.
    again = uuid.uuid4()
    identity.register_process(process_id=again, node="d@h", hostname="h", pid=3, node_id=NODE)
    held = queue_store.try_acquire(
        queue="hooks", tenant=None, limit=1, task_id="h1", process_id=again, node_id=NODE
    )
    assert held.status == "held"
    WorkerProcess.objects.filter(pk=again).update(last_heartbeat_at=OLD)
    SlotLease.objects.filter(process_id=again).update(acquired_at=OLD)
    act(ops, QUEUES, "reap_dead_workers", QueueLimit.objects.get().pk)
    queue = QueueLimit.objects.get()
    assert (queue.current_jobs, queue.running) == (0, {})
    assert Maintenance.objects.get(name="reaped").leases_reaped_total == 2


def test_action_pause_queues__limit_zero_with_history(ops: Client) -> None:
    queue_limits.set_limits("hooks", max_jobs=3, max_jobs_per_worker=2)
    queue_limits.set_limits("email", max_jobs=1)
    hooks = QueueLimit.objects.get(queue="hooks")
    response = act(ops, QUEUES, "pause_queues", hooks.pk, follow=True)
    assert any("Paused 1 queue(s)" in m for m in texts(response))
    hooks.refresh_from_db()
    assert (hooks.max_jobs, hooks.max_jobs_per_worker) == (0, 2)
    assert QueueLimit.objects.get(queue="email").max_jobs == 1
    assert history(queue="hooks", source="admin") == [("ops", "admin", "max_jobs", "3", "0")]


def test_action_reset_windows__needs_the_change_permission(ops: Client) -> None:
    record_window("acme")
    record_window("bob")
    acme = TenantWindow.objects.get(tenant="acme")
    viewer = Client()
    login(viewer, "viewer", perms=("view_tenantwindow",))
    page = viewer.get(WINDOWS)
    assert page.status_code == 200 and "reset_windows" not in page.content.decode()
    act(viewer, WINDOWS, "reset_windows", acme.pk)
    assert TenantWindow.objects.count() == 2
    response = act(ops, WINDOWS, "reset_windows", acme.pk, follow=True)
    assert any("Reset 1 window(s)" in m for m in texts(response))
    assert list(TenantWindow.objects.values_list("tenant", flat=True)) == ["bob"]
    changer = Client()
    login(changer, "changer", perms=("view_tenantwindow", "change_tenantwindow"))
    assert "reset_windows" in changer.get(WINDOWS).content.decode()
    act(changer, WINDOWS, "reset_windows", TenantWindow.objects.get().pk)
    assert not TenantWindow.objects.exists()


def test_action_planner_tenants__pause_and_resume(ops: Client) -> None:
    acme = PlannerTenant.objects.create(task_name=tasks.planned.name, tenant="acme")
    PlannerTenant.objects.create(task_name=tasks.planned.name, tenant="bob")
    response = act(ops, PLANNER_TENANTS, "pause_promotion", acme.pk, follow=True)
    assert any("Paused 1 tenant(s)" in m for m in texts(response))
    paused = dict(PlannerTenant.objects.values_list("tenant", "paused"))
    assert paused == {"acme": True, "bob": False}
    act(ops, PLANNER_TENANTS, "resume_promotion", acme.pk)
    assert not PlannerTenant.objects.filter(paused=True).exists()


# -- the slot form: limits and boosts --------------------------------------------------------


def test_boost_form__applies_a_boost_and_records_it(ops: Client) -> None:
    slot = slots.set_tenant_limit("acme", "q", 2)
    page = ops.get(f"{SLOTS}{slot.pk}/change/")
    assert page.status_code == 200
    assert 'name="boost_max_jobs"' in page.content.decode()
    assert 'name="boost_until_time"' in page.content.decode()
    until = (database_now() + timedelta(hours=1)).replace(microsecond=0)
    response = ops.post(
        f"{SLOTS}{slot.pk}/change/",
        {"max_jobs": "2", "boost_max_jobs": "5",
         "boost_until_time": until.strftime("%Y-%m-%d %H:%M:%S"), **NO_LEASES},
    )  # fmt: skip
    assert response.status_code == 302, response.content.decode()[:3000]
    slot.refresh_from_db()
    assert (slot.max_jobs, slot.boost_until, slot.boost_restore) == (5, until, 2)
    assert history()[-1] == ("ops", "admin", "max_jobs", "2", "5")
    assert LimitChange.objects.order_by("id").last().note.startswith("boost until")  # type: ignore[union-attr]
    listing = ops.get(SLOTS).content.decode()
    assert "5 until" in listing and "then 2" in listing


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"boost_max_jobs": "5"}, "A boost needs both a limit and an end time."),
        (
            {"boost_until_time": "2099-01-01 00:00:00"},
            "A boost needs both a limit and an end time.",
        ),
        (
            {"max_jobs": "3", "boost_max_jobs": "5", "boost_until_time": "2099-01-01 00:00:00"},
            "Change max_jobs or set a boost, not both at once.",
        ),
        ({"boost_max_jobs": "-1", "boost_until_time": "2099-01-01 00:00:00"}, "greater than"),
    ],
)
def test_boost_form__invalid__error_shown_nothing_changed(
    ops: Client, data: dict[str, str], message: str
) -> None:
    slot = slots.set_tenant_limit("acme", "q", 2)
    changes = LimitChange.objects.count()
    response = ops.post(f"{SLOTS}{slot.pk}/change/", {"max_jobs": "2", **data, **NO_LEASES})
    assert response.status_code == 200
    assert message in response.content.decode()
    slot.refresh_from_db()
    assert (slot.max_jobs, slot.boost_until) == (2, None)
    assert LimitChange.objects.count() == changes


def test_boost_form__end_in_the_past__form_error_not_a_server_error(ops: Client) -> None:
    slot = slots.set_tenant_limit("acme", "q", 2)
    past = (database_now() - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")
    response = ops.post(
        f"{SLOTS}{slot.pk}/change/",
        {"max_jobs": "2", "boost_max_jobs": "5", "boost_until_time": past, **NO_LEASES},
    )
    assert response.status_code == 200
    assert "future" in response.content.decode()
    slot.refresh_from_db()
    assert (slot.max_jobs, slot.boost_until) == (2, None)


def test_edit_max_jobs__history_has_old_and_new_values(ops: Client) -> None:
    slot = slots.set_tenant_limit("acme", "q", 2)
    for value in ("3", ""):
        response = ops.post(f"{SLOTS}{slot.pk}/change/", {"max_jobs": value, **NO_LEASES})
        assert response.status_code == 302
    assert history(source="admin") == [
        ("ops", "admin", "max_jobs", "2", "3"),
        ("ops", "admin", "max_jobs", "3", ""),
    ]
    assert TenantQueueSlot.objects.get().max_jobs is None
    # Saving without a change records nothing.
    ops.post(f"{SLOTS}{slot.pk}/change/", {"max_jobs": "", **NO_LEASES})
    assert len(history(source="admin")) == 2


def test_edit_max_jobs__in_the_list__history_recorded(ops: Client) -> None:
    slot = slots.set_tenant_limit("acme", "q", 2)
    response = ops.post(
        SLOTS,
        {"form-TOTAL_FORMS": "1", "form-INITIAL_FORMS": "1", "form-MIN_NUM_FORMS": "0",
         "form-MAX_NUM_FORMS": "1000", "form-0-id": str(slot.pk), "form-0-max_jobs": "7",
         "_save": "Save"},
    )  # fmt: skip
    assert response.status_code == 302, response.content.decode()[:3000]
    assert TenantQueueSlot.objects.get().max_jobs == 7
    assert history(source="admin") == [("ops", "admin", "max_jobs", "2", "7")]


def test_add_slot__creates_the_row_through_the_slot_api(ops: Client) -> None:
    response = ops.post(
        f"{SLOTS}add/", {"tenant": "acme", "queue": "q", "max_jobs": "4", **NO_LEASES}
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    assert TenantQueueSlot.objects.get().max_jobs == 4
    assert history() == [("ops", "admin", "max_jobs", "", "4")]


# -- history pages ---------------------------------------------------------------------------


def test_limit_history__read_only_and_searchable(ops: Client) -> None:
    slots.set_tenant_limit("acme", "q", 2, user="alice")
    queue_limits.set_limits("hooks", max_jobs=1)
    page = ops.get("/admin/fair_jobs/limitchange/", {"q": "acme"})
    assert page.status_code == 200
    assert [c.tenant for c in page.context["cl"].result_list] == ["acme"]
    by_user = ops.get("/admin/fair_jobs/limitchange/", {"q": "alice"})
    assert [c.user for c in by_user.context["cl"].result_list] == ["alice"]
    change = LimitChange.objects.get(tenant="acme")
    assert ops.get("/admin/fair_jobs/limitchange/add/").status_code == 403
    assert ops.get(f"/admin/fair_jobs/limitchange/{change.pk}/change/").status_code == 200
    edited = ops.post(f"/admin/fair_jobs/limitchange/{change.pk}/change/", {"new_value": "9"})
    assert edited.status_code == 403
    deleted = ops.post(f"/admin/fair_jobs/limitchange/{change.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 403
    assert LimitChange.objects.get(pk=change.pk).new_value == "2"


def test_decisions__read_only_and_searchable(ops: Client) -> None:
    for task_id, tenant in (("t-1", "acme"), ("t-2", "bob")):
        decisions.record(task_id=task_id, task_name="t", tenant=tenant, queue="q",
                         mechanism="reroute", action="rerouted")  # fmt: skip
    page = ops.get("/admin/fair_jobs/jobdecision/", {"q": "t-2"})
    assert page.status_code == 200
    assert [d.task_id for d in page.context["cl"].result_list] == ["t-2"]
    by_tenant = ops.get("/admin/fair_jobs/jobdecision/", {"q": "acme"})
    assert [d.task_id for d in by_tenant.context["cl"].result_list] == ["t-1"]
    assert ops.get("/admin/fair_jobs/jobdecision/add/").status_code == 403
    decision = JobDecision.objects.get(task_id="t-1")
    assert (
        ops.post(f"/admin/fair_jobs/jobdecision/{decision.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    assert JobDecision.objects.count() == 2

"""Security properties: the admin needs the app's model permissions on every page and
action, every statement that carries a tenant is parameterized, nothing is pickled into
our tables, and log lines show tenants cut short and escaped. docs/reliability.md
("Security") lists each property with the test that proves it.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.exceptions import Ignore
from django.apps import apps
from django.conf import settings as django_settings
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connection, models
from django.test import Client, RequestFactory
from django.urls import reverse
from kombu.utils.json import dumps

from django_fair_jobs import (
    admission,
    decisions,
    explain,
    identity,
    planner,
    queue_limits,
    slots,
    status,
)
from django_fair_jobs.models import (
    JobDecision,
    LimitChange,
    ParkedJob,
    PlannedJob,
    PlannerTenant,
    RerouteCount,
    SlotLease,
    TenantQueueSlot,
    TenantWindow,
)
from django_fair_jobs.reroute import store as reroute_store
from django_fair_jobs.slots import store as slot_store
from django_fair_jobs.tenants import LOG_MAX_LENGTH, for_log
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)

PACKAGE = Path(__file__).resolve().parent.parent / "django_fair_jobs"
SOURCES = sorted(PACKAGE.rglob("*.py"))
APP = apps.get_app_config("fair_jobs")

HOSTILE = [
    "'); DROP TABLE fair_jobs_tenantqueueslot; --",
    '"; DELETE FROM fair_jobs_parkedjob; --',
    "' OR '1'='1",
    "acme' UNION SELECT id, tenant FROM fair_jobs_tenantqueueslot --",
    "$$; TRUNCATE fair_jobs_plannedjob CASCADE; $$",
    "*/ DROP TABLE fair_jobs_tenantwindow; /*",
    "%s",
    "%(tenant)s",
    "%%",
    "{}",
    "{0}{tenant}",
    ":tenant ? @p0",
    "\\",
    "\\'; \\\"",
    "\u2019; DROP TABLE fair_jobs_slotlease; --",  # a typographic quote
    "ten\nant\r\tX",
]


@pytest.fixture(autouse=True)
def _empty_broker(broker_env: dict[str, str]) -> None:
    """Wake-ups and promotions publish for real: start from an empty broker."""


@pytest.fixture
def process(monkeypatch: pytest.MonkeyPatch) -> uuid.UUID:
    """A registered worker process that in-process job runs use as theirs: without it
    the first run would start a heartbeat and a planner thread in the test process."""
    pid = uuid.uuid4()
    identity.register_process(process_id=pid, node="sec@host", hostname="host", pid=9)
    monkeypatch.setattr(identity, "current_process_id", lambda node=None: pid)
    return pid


def broker_headers(queue: str) -> list[dict[str, Any]]:
    """The headers of the messages waiting in ``queue`` on the test broker."""
    raw = redis.Redis.from_url(django_settings.CELERY_BROKER_URL).lrange(queue, 0, -1)
    return [json.loads(m)["headers"] for m in raw]


def run_as_worker(
    task: Any, args: tuple[Any, ...], *, task_id: str, headers: dict[str, Any]
) -> Any:
    """Run ``task`` as a worker runs a message delivered from the ``fair`` queue."""
    task.push_request(
        id=task_id, headers=headers, delivery_info={"routing_key": "fair", "redelivered": False},
        hostname="sec@host", is_eager=False, args=args, kwargs={},
    )  # fmt: skip
    try:
        return task(*args)
    finally:
        task.pop_request()


def fair_tables() -> set[str]:
    """The tables of the app's concrete models."""
    return {m._meta.db_table for m in APP.get_models() if not m._meta.proxy}


def snapshot() -> dict[str, list[dict[str, Any]]]:
    """Every row of every table of the app, to prove that nothing changed."""
    return {
        m._meta.label: list(m._default_manager.order_by("pk").values())
        for m in APP.get_models()
        if not m._meta.proxy
    }


# The admin: permissions on every page and action -----------------------------------------


def fill_every_table(process: uuid.UUID) -> None:
    """At least one row in every table the admin shows."""
    slots.set_tenant_limit("paused", "fair", 0)  # a slot and a limit change
    queue_limits.set_limits("hooks", max_jobs=3)
    grant = slot_store.try_acquire(
        tenant="acme", queue="fair", task_id="running", limit=1, process_id=process, timeout=60
    ).grant
    assert grant is not None
    with pytest.raises(Ignore):  # acme is full: the job parks
        run_as_worker(
            tasks.limited1, ("acme", 0), task_id="parked", headers={"fair_tenant": "acme"}
        )
    for _ in range(2):  # the second is above threshold 1: a reroute count too
        reroute_store.record(
            key=f"task:{tasks.rerouted.name}", tenant="acme", task_name=tasks.rerouted.name,
            rules=[(60, 1, "fair_slow")],
        )  # fmt: skip
    tasks.planned.delay("acme")
    PlannerTenant.objects.create(task_name=tasks.planned.name, tenant="acme")
    decisions.record(
        task_id="d1", task_name="t", tenant="acme", queue="fair", mechanism="reroute",
        action="rerouted",
    )  # fmt: skip


def registered() -> list[tuple[type[models.Model], admin.ModelAdmin[Any]]]:
    """Every model the admin site registers for the app, with its admin."""
    found = [(m, a) for m, a in admin.site._registry.items() if m._meta.app_label == APP.label]
    assert len(found) >= 10  # the table below must not pass by being empty
    return sorted(found, key=lambda pair: pair[0]._meta.model_name or "")


def urls_of(model: type[models.Model]) -> dict[str, str]:
    """The changelist, add, and (for a stored row) change, delete and history pages."""
    name = f"admin:{model._meta.app_label}_{model._meta.model_name}"
    urls = {"changelist": reverse(f"{name}_changelist"), "add": reverse(f"{name}_add")}
    row = model._default_manager.order_by("pk").first()
    if row is not None and not model._meta.proxy:
        for page in ("change", "delete", "history"):
            urls[page] = reverse(f"{name}_{page}", args=[row.pk])
    return urls


def every_action(model_admin: admin.ModelAdmin[Any]) -> list[str]:
    """The names of the actions the admin offers a superuser on the model."""
    request = RequestFactory().get("/")
    request.user = User(is_superuser=True, is_staff=True, is_active=True)
    return list(model_admin.get_actions(request))


def login(
    client: Client, username: str, *, staff: bool = True, perms: tuple[str, ...] = ()
) -> None:
    user = User.objects.create_user(username, password="pw", is_staff=staff)
    for codename in perms:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=APP.label, codename=codename)
        )
    client.force_login(user)


def test_every_page_and_action__anonymous_and_non_staff__sent_to_the_login_page(
    client: Client, process: uuid.UUID
) -> None:
    fill_every_table(process)
    before = snapshot()
    for viewer in ("anonymous", "non-staff"):
        if viewer == "non-staff":
            login(client, "visitor", staff=False)
        for model, model_admin in registered():
            for page, url in urls_of(model).items():
                response = client.get(url)
                assert response.status_code == 302, (viewer, page, url)
                assert response["Location"].startswith("/admin/login/"), (viewer, url)
            pk = model._default_manager.order_by("pk").values_list("pk", flat=True).first()
            for action in every_action(model_admin):
                posted = client.post(urls_of(model)["changelist"], {
                    "action": action, "_selected_action": [str(pk)], "post": "yes"})  # fmt: skip
                assert posted.status_code == 302, (viewer, model, action)
    assert snapshot() == before


def test_every_page_and_action__staff_without_permission__403__nothing_changes(
    client: Client, process: uuid.UUID
) -> None:
    fill_every_table(process)
    before = snapshot()
    login(client, "intern")
    checked = 0
    for model, model_admin in registered():
        for page, url in urls_of(model).items():
            assert client.get(url).status_code == 403, (page, url)
            checked += 1
        urls = urls_of(model)
        pk = model._default_manager.order_by("pk").values_list("pk", flat=True).first()
        for action in every_action(model_admin):
            posted = client.post(urls["changelist"], {
                "action": action, "_selected_action": [str(pk)], "post": "yes"})  # fmt: skip
            assert posted.status_code == 403, (model, action)
            checked += 1
        if "change" in urls:
            assert client.post(urls["change"], {"max_jobs": "9"}).status_code == 403
            assert client.post(urls["delete"], {"post": "yes"}).status_code == 403
    assert checked > 30
    assert snapshot() == before


def test_every_action__staff_with_view_permission_only__runs_nothing__nothing_changes(
    client: Client, process: uuid.UUID
) -> None:
    fill_every_table(process)
    before = snapshot()
    views = tuple(f"view_{m._meta.model_name}" for m, _ in registered())
    login(client, "watcher", perms=views)
    for model, model_admin in registered():
        urls = urls_of(model)
        assert client.get(urls["changelist"]).status_code == 200, model
        assert client.get(urls["add"]).status_code == 403, model
        if "delete" in urls:
            assert client.post(urls["delete"], {"post": "yes"}).status_code == 403, model
            assert client.post(urls["change"], {"max_jobs": "9"}).status_code == 403, model
        pk = model._default_manager.order_by("pk").values_list("pk", flat=True).first()
        for action in every_action(model_admin):
            posted = client.post(urls["changelist"], {
                "action": action, "_selected_action": [str(pk)], "post": "yes"})  # fmt: skip
            # Django leaves out the actions a user may not run: "no action selected".
            assert posted.status_code in (200, 302, 403), (model, action)
    assert snapshot() == before


# SQL: parameterized everywhere a tenant goes ------------------------------------------


def _tables_intact() -> None:
    assert fair_tables() <= set(connection.introspection.table_names())


@pytest.mark.parametrize("tenant", HOSTILE)
def test_hostile_tenant__slot_protocol__round_trips_exactly(
    tenant: str, process: uuid.UUID
) -> None:
    manager = TenantQueueSlot.objects
    store = slot_store
    first = store.try_acquire(tenant=tenant, queue="fair", task_id="a", limit=1,
                                process_id=process, timeout=60).grant  # fmt: skip
    assert first is not None
    assert store.try_acquire(tenant=tenant, queue="fair", task_id="b", limit=1,
                               process_id=process, timeout=60).status == "full"  # fmt: skip
    signature = dumps(dict(tasks.limited1.signature((tenant, 0), task_id="b")))
    assert store.try_park(tenant=tenant, queue="fair", task_id="b", task_name="t", limit=1,
                            signature=signature) == "parked"  # fmt: skip
    store.count_deferral(tenant=tenant, queue="fair")
    assert store.release(first) == 1  # one parked job to wake
    slot = manager.get(tenant=tenant)
    woken = store.wake_one(slot.pk)
    assert woken is not None and woken.task_id == "b"
    assert json.loads(woken.signature)["args"] == [tenant, 0]
    assert list(manager.values_list("tenant", flat=True)) == [tenant]
    assert manager.filter(tenant=tenant).count() == 1 and SlotLease.objects.count() == 1
    _tables_intact()


@pytest.mark.parametrize("tenant", HOSTILE)
def test_hostile_tenant__queue_limit_path__round_trips_exactly(
    tenant: str, process: uuid.UUID
) -> None:
    queue_limits.set_limits("hostile", max_jobs=1)
    first = admission.acquire(tenant=tenant, queue="hostile", task_id="a", limit=5, node="n@h",
                          woken=False)  # fmt: skip
    assert first.grant is not None, first.status
    assert admission.acquire(tenant=tenant, queue="hostile", task_id="b", limit=5, node="n@h",
                         woken=False).status == "queue_full"  # fmt: skip
    assert queue_limits.park(queue="hostile", tenant=tenant, limit=5, task_id="b", task_name="t",
                       signature="{}", woken=False) == "parked"  # fmt: skip
    assert TenantQueueSlot.objects.get().tenant == tenant
    assert ParkedJob.objects.get().slot.tenant == tenant  # type: ignore[union-attr]
    _tables_intact()


@pytest.mark.parametrize("tenant", HOSTILE)
def test_hostile_tenant__rerouting_window__counted_and_rerouted_exactly(tenant: str) -> None:
    for _ in range(3):  # threshold 2: the third goes to fair_slow
        tasks.rerouted.delay(tenant)
    assert [h["fair_tenant"] for h in broker_headers("fair")] == [tenant, tenant]
    assert [h["fair_tenant"] for h in broker_headers("fair_slow")] == [tenant]
    assert TenantWindow.objects.get().tenant == tenant
    assert (RerouteCount.objects.get().tenant, RerouteCount.objects.get().total) == (tenant, 1)
    assert JobDecision.objects.get().tenant == tenant
    _tables_intact()


@pytest.mark.parametrize("tenant", HOSTILE)
def test_hostile_tenant__planner_park_run_status_explain__exact(tenant: str) -> None:
    result = tasks.planned.delay(tenant)
    assert PlannedJob.objects.get().tenant == tenant
    waiting = explain(result.id).as_dict()
    assert waiting["state"] == "pending" and waiting["details"]["tenant"] == tenant
    (plan,) = [p for p in planner.status() if p["task"] == tasks.planned.name]
    assert [t["tenant"] for t in plan["tenants"]] == [tenant]
    assert [t["tenant"] for t in status.snapshot()["tenants"]] == [tenant]
    report = planner.run(tasks.planned, due_only=False)
    assert report is not None and report.counts == {tenant: 1}
    assert PlannerTenant.objects.get().tenant == tenant
    assert [h["fair_tenant"] for h in broker_headers("fair")] == [tenant]
    _tables_intact()


@pytest.mark.parametrize("tenant", HOSTILE)
def test_hostile_tenant__limit_command_and_admin_search(tenant: str, client: Client) -> None:
    out = StringIO()
    call_command("fair_jobs_limit", "fair", "--tenant", tenant, "--max-jobs", "3", stdout=out)
    call_command("fair_jobs_limit", "fair", "--tenant", tenant, stdout=out)
    assert tenant in out.getvalue()
    row = TenantQueueSlot.objects.get()
    assert (row.tenant, row.max_jobs) == (tenant, 3)
    assert LimitChange.objects.get().tenant == tenant
    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    for model, model_admin in registered():
        if not model_admin.search_fields:
            continue
        url = reverse(f"admin:{APP.label}_{model._meta.model_name}_changelist")
        page = client.get(url, {"q": tenant})
        assert page.status_code == 200, url
        if model is TenantQueueSlot:
            assert [r.tenant for r in page.context["cl"].result_list] == [tenant]
    _tables_intact()
    assert TenantQueueSlot.objects.count() == 1 and LimitChange.objects.count() == 1


_SQL_CALLS = {"execute", "executemany", "raw", "extra", "executescript"}


def _sql_argument_is_fixed(node: ast.expr) -> bool:
    """True for SQL that holds no runtime value: a plain string literal, or a named
    statement of ``sql/*.sql`` (``queries()[name]``), whose values are all bind
    parameters (checked below)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return True
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "queries"
    )


def _forwarding_calls(tree: ast.AST) -> set[ast.Call]:
    """Calls inside a cursor's own ``execute(self, query, ...)`` that pass its ``query``
    on unchanged (the preparing cursor of ``db.py``): the text is its callers', which
    this scan checks where they call it."""
    found: set[ast.Call] = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef) or function.name != "execute":
            continue
        if len(function.args.args) < 2:
            continue
        query = function.args.args[1].arg
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "execute"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == query
            ):
                found.add(node)
    return found


def test_static__sql_text_is_never_built_from_values() -> None:
    # What this checks: every call that sends SQL text (cursor.execute / executemany /
    # executescript, Manager.raw, QuerySet.extra, RawSQL) in the package passes a string
    # literal or a named statement from the .sql files, never an f-string, a
    # %-formatted, concatenated or .format()ed string, or a variable. Values go in as
    # bind parameters only.
    offenders: list[str] = []
    calls = 0
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        forwarded = _forwarding_calls(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or node in forwarded:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in _SQL_CALLS and name != "RawSQL":
                continue
            if name in ("raw", "extra") and not node.args:
                continue  # e.g. str.raw? nothing SQL without a statement
            calls += 1
            if not node.args or not _sql_argument_is_fixed(node.args[0]):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert calls >= 3  # the scan found the library's statements
    assert offenders == []


def test_static__named_statements_use_bind_parameters_only() -> None:
    from django_fair_jobs.sql import queries

    statements = queries()
    assert "record_enqueue" in statements and "acquire" in statements
    for name, sql in statements.items():
        # Every % is a psycopg named parameter: no positional %s, no Python formatting.
        stray = re.sub(r"%\(\w+\)s", "", sql)
        assert "%" not in stray, name
        assert not re.search(r"\{\w*\}", sql.replace("'{}'", "")), name


def test_sql_blocks__a_name_defined_twice_is_refused() -> None:
    from django_fair_jobs.sql import blocks

    text = "-- name: a\nSELECT 1;\n-- name: b\nSELECT 2;\n"
    assert blocks(text) == {"a": "SELECT 1", "b": "SELECT 2"}
    with pytest.raises(ValueError, match="'a' is defined twice"):
        blocks(text + "-- name: a\nSELECT 3;\n")


# No pickle in our storage -------------------------------------------------------------

_UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                   "jsonpickle"}  # fmt: skip


def test_static__no_pickle_imported_or_named_by_the_package() -> None:
    # Imports of the pickle family, attributes named after them, and the pickle
    # serializer's names as string literals (e.g. passed to kombu) are all refused.
    serializer_names = ("pickle", "application/x-python-serialize")
    found: list[str] = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Attribute) and node.attr in _UNSAFE_MODULES:
                names = [node.attr]
            elif isinstance(node, ast.Constant) and node.value in serializer_names:
                names = [str(node.value)]
            found += [
                f"{path.name}:{getattr(node, 'lineno', 0)} {n}"
                for n in names
                if n.split(".")[0] in _UNSAFE_MODULES or n in serializer_names
            ]
    assert found == []


def test_models__store_text_and_json_only__no_binary_or_pickled_field() -> None:
    kinds = set()
    for model in APP.get_models():
        for field in model._meta.concrete_fields:
            kinds.add(type(field).__name__)
            assert not isinstance(field, models.BinaryField), field
            assert "pickle" not in type(field).__name__.lower(), field
    assert "JSONField" in kinds and "TextField" in kinds


def test_stored_jobs__parked_and_planned__are_json_text(process: uuid.UUID) -> None:
    slot_store.try_acquire(
        tenant="acme", queue="fair", task_id="holder", limit=1, process_id=process, timeout=60
    )
    with pytest.raises(Ignore):
        run_as_worker(tasks.limited1, ("acme", 0), task_id="p1", headers={"fair_tenant": "acme"})
    tasks.planned.delay("acme")
    for text in [*ParkedJob.objects.values_list("signature", flat=True),
                 *PlannedJob.objects.values_list("signature", flat=True)]:  # fmt: skip
        assert isinstance(json.loads(text), dict)
        assert "\\x80" not in text and "pickle" not in text
    assert ParkedJob.objects.count() == 1 and PlannedJob.objects.count() == 1


# Logs: tenants cut short and escaped -----------------------------------------------------


def _tenant_refs(node: ast.AST) -> list[ast.AST]:
    """Tenant values in a log call's arguments that do not go through ``for_log``."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "for_log":
        return []
    if isinstance(node, ast.Name) and "tenant" in node.id.lower():
        return [node]
    if (
        isinstance(node, ast.Attribute)
        and "tenant" in node.attr.lower()
        and not node.attr.isupper()
    ):
        return [node]
    return [ref for child in ast.iter_child_nodes(node) for ref in _tenant_refs(child)]


def test_static__every_log_call_passes_tenants_through_for_log() -> None:
    offenders: list[str] = []
    calls = 0
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "logger"
            ):
                continue
            calls += 1
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                offenders += [
                    f"{path.name}:{getattr(ref, 'lineno', 0)}" for ref in _tenant_refs(arg)
                ]
    assert calls >= 20
    assert offenders == []


def test_for_log__short__escaped__same_digest_as_the_metrics_label() -> None:
    from django_fair_jobs.tenants import shorten

    long = "x" * 10_240
    assert len(for_log(long)) == LOG_MAX_LENGTH + 2  # the quotes
    assert for_log(long).strip("'").split("~")[1] == shorten(long).split("~")[1]
    forged = "acme\n2030-01-01 CRITICAL forged line"
    assert "\n" not in for_log(forged) and "\\n" in for_log(forged)
    assert for_log("\x1b[31mred") == "'\\x1b[31mred'"
    assert for_log(None) == "None" and for_log(7) == "'7'"
    assert for_log("caf\u00e9 \U0001f680") == "'caf\u00e9 \U0001f680'"  # readable as is


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every library log record, debug included."""
    with caplog.at_level(logging.DEBUG, logger="django_fair_jobs"):
        yield caplog


def _assert_short(records: list[logging.LogRecord], tenant: str) -> None:
    assert records
    for record in records:
        line = record.getMessage()
        assert len(line) < 300, line
        assert tenant[:150] not in line


def test_logs__10_kb_tenant_reaching_a_worker__one_short_line(
    process: uuid.UUID, debug_logs: pytest.LogCaptureFixture, settings: Any
) -> None:
    settings.FAIR_JOBS_TENANT_WARNING_INTERVAL = 0
    tenant = "t" * 10_240
    run_as_worker(tasks.limited1, ("acme", 0), task_id="big", headers={"fair_tenant": tenant})
    _assert_short([r for r in debug_logs.records if r.name.startswith("django_fair_jobs")], tenant)


def test_logs__10_kb_tenant_from_a_weights_function__short_warning(
    debug_logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = "w" * 10_240
    plan = {
        **dict(tasks.planned.fair_plan or {}),
        "tenant_weights": lambda t: {tenant: float("nan")},
    }
    monkeypatch.setattr(tasks.planned, "fair_plan", plan)
    tasks.planned.delay("acme")
    assert planner.run(tasks.planned, due_only=False) is not None
    _assert_short([r for r in debug_logs.records if "Weight" in r.getMessage()], tenant)


def test_logs__longest_tenant_deferred_and_rerouted__short_lines(
    process: uuid.UUID, debug_logs: pytest.LogCaptureFixture
) -> None:
    tenant = "L" * 255
    slot_store.try_acquire(
        tenant=tenant, queue="fair", task_id="holder", limit=1, process_id=process, timeout=60
    )
    with pytest.raises(Ignore):
        run_as_worker(tasks.limited1, (tenant, 0), task_id="p", headers={"fair_tenant": tenant})
    for _ in range(3):
        tasks.rerouted.delay(tenant)
    lines = [
        r
        for r in debug_logs.records
        if "Deferred" in r.getMessage() or "Rerouted" in r.getMessage()
    ]
    assert {r.getMessage().split()[0] for r in lines} == {"Deferred", "Rerouted"}
    _assert_short(lines, tenant)

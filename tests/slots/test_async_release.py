"""Asynchronous releases (``FAIR_JOBS_ASYNC_RELEASE``): a slot's release commits without
waiting for the disk, and each process confirms its releases at its next maintenance pass,
releasing again any slot whose release a crash of the database server lost. The release
and its confirmation on the suite's database, then a real crash of a server of the test's
own (``pg_ctl stop -m immediate``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import InterfaceError, OperationalError, connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_fair_jobs import identity, messages
from django_fair_jobs.admission import ends
from django_fair_jobs.leases.types import Grant
from django_fair_jobs.models import ParkedJob, SlotLease, TenantQueueSlot, WorkerProcess
from django_fair_jobs.slots import store as slot_store
from tests.chaos.harness import ROOT
from tests.chaos.pgserver import ThrowawayPostgres, _binary

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="releases are asynchronous on PostgreSQL only"
    ),
]


@pytest.fixture(autouse=True)
def no_unconfirmed(monkeypatch: pytest.MonkeyPatch, process: uuid.UUID) -> None:
    """This test's own list of unconfirmed releases, made by the ``process`` fixture's."""
    monkeypatch.setattr(ends.LEDGER, "unconfirmed", [])
    monkeypatch.setattr(identity, "registered_process_id", lambda: process)


@pytest.fixture
def woken(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The parked jobs woken (their re-publish recorded instead of sent to the broker)."""
    jobs: list[Any] = []
    monkeypatch.setattr(messages, "publish_woken", lambda job, app=None: jobs.append(job))
    return jobs


def acquire(process: uuid.UUID, task_id: str, limit: int = 1) -> Grant:
    grant = slot_store.try_acquire(
        tenant="acme", queue="q", task_id=task_id, limit=limit, process_id=process, timeout=60
    ).grant
    assert grant is not None
    return grant


def slot() -> TenantQueueSlot:
    return TenantQueueSlot.objects.get(tenant="acme", queue="q")


def lose_release(grant: Grant, process: uuid.UUID) -> None:
    """Leave what a crash that lost ``grant``'s release leaves (its lease, and the count as
    before it), and park job b on the slot, which is full again."""
    SlotLease.objects.create(
        slot_id=grant.slot_id, task_id=grant.task_id, token=grant.token, process_id=process
    )
    TenantQueueSlot.objects.filter(tenant="acme", queue="q").update(current_jobs=1)
    assert slot_store.try_park(
        tenant="acme", queue="q", task_id="b", task_name="t", limit=1,
        signature='{"task": "t", "options": {"task_id": "b"}}',
    ) == "parked"  # fmt: skip


@override_settings(FAIR_JOBS_ASYNC_RELEASE=True)
def test_release__async__one_statement_without_waiting_for_the_disk_kept_to_confirm(
    process: uuid.UUID,
) -> None:
    grant = acquire(process, "a")
    with CaptureQueriesContext(connection) as queries:
        ends.release(grant)
    assert len(queries) == 1
    assert "set_config('synchronous_commit', 'off', true)" in queries[0]["sql"]
    assert not SlotLease.objects.exists() and slot().current_jobs == 0
    assert ends.LEDGER.unconfirmed == [grant]
    # The setting lasts for the release's own transaction only.
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone() == ("on",)


@override_settings(FAIR_JOBS_ASYNC_RELEASE=True)
def test_release__inside_a_transaction__waits_for_the_disk_as_the_transaction_does(
    process: uuid.UUID,
) -> None:
    grant = acquire(process, "a")
    with transaction.atomic():
        ends.release(grant)
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone() == ("on",)  # the caller's commit is left alone
    assert ends.LEDGER.unconfirmed == []
    assert not SlotLease.objects.exists()


@override_settings(FAIR_JOBS_ASYNC_RELEASE=True)
def test_release__error_after_it_may_have_committed__confirmed_as_well_as_retried(
    process: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    grant = acquire(process, "a")
    release = slot_store.release

    def released_reply_lost(grant: Grant) -> int | None:
        release(grant)
        raise InterfaceError("connection lost")

    monkeypatch.setattr(slot_store, "release", released_reply_lost)
    with ends.LEDGER.lock:
        pending = len(ends.LEDGER.pending_releases)
    ends.release(grant)
    assert ends.LEDGER.unconfirmed == [grant]
    with ends.LEDGER.lock:
        assert ends.LEDGER.pending_releases[pending:] == [grant]
        del ends.LEDGER.pending_releases[pending:]


def test_confirm__session_that_skips_the_disk__the_confirmation_waits_for_it(
    process: uuid.UUID,
) -> None:
    # A database or role set to synchronous_commit = off would make the confirmation as
    # losable as the releases it confirms.
    grant = acquire(process, "a")
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit = off")
        slot_store.confirm_releases([grant], process_id=process)
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone() == ("local",)


def test_release__sync_by_default__nothing_kept_to_confirm(process: uuid.UUID) -> None:
    ends.release(acquire(process, "a"))
    assert ends.LEDGER.unconfirmed == []
    assert not SlotLease.objects.exists() and slot().current_jobs == 0


@override_settings(FAIR_JOBS_ASYNC_RELEASE=True)
def test_confirm__nothing_lost__one_statement_that_beats_list_emptied(process: uuid.UUID) -> None:
    ends.release(acquire(process, "a"))
    ends.release(acquire(process, "b"))
    WorkerProcess.objects.filter(pk=process).update(last_heartbeat_at="2000-01-01T00:00Z")
    with CaptureQueriesContext(connection) as queries:
        assert ends.confirm_releases() == 0
    assert len(queries) == 1
    assert ends.LEDGER.unconfirmed == []
    assert WorkerProcess.objects.get(pk=process).last_heartbeat_at.year > 2000
    assert slot().current_jobs == 0


@override_settings(FAIR_JOBS_ASYNC_RELEASE=True)
def test_confirm__release_lost__slot_released_again_parked_job_woken(
    process: uuid.UUID, woken: list[Any]
) -> None:
    grant = acquire(process, "a")
    ends.release(grant)
    lose_release(grant, process)
    assert ends.confirm_releases() == 1
    assert [job.task_id for job in woken] == ["b"]
    # The slot went to the parked job (its reservation), not lost, not counted twice.
    assert list(SlotLease.objects.values_list("task_id", flat=True)) == ["b"]
    assert slot().current_jobs == 1
    assert ParkedJob.objects.get(task_id="b").woken_at is not None
    assert ends.LEDGER.unconfirmed == []


@override_settings(FAIR_JOBS_ASYNC_RELEASE=True)
def test_confirm__lease_taken_over_since__fenced_nothing_freed(process: uuid.UUID) -> None:
    grant = acquire(process, "a")
    ends.release(grant)
    again = acquire(process, "a")  # a redelivery of the job, with a token of its own
    assert ends.confirm_releases() == 0
    assert list(SlotLease.objects.values_list("token", flat=True)) == [again.token]
    assert slot().current_jobs == 1


@override_settings(FAIR_JOBS_ASYNC_RELEASE=True)
def test_confirm__process_reaped__kept_until_registered_again_lost_ones_released(
    process: uuid.UUID, woken: list[Any]
) -> None:
    grant = acquire(process, "a")
    ends.release(grant)
    lose_release(grant, process)
    row = WorkerProcess.objects.get(pk=process)
    row.delete()
    # No process row: the statement may have written nothing whose commit waits for the
    # disk, so the releases stay to confirm; the lost one is released and its job woken.
    assert ends.confirm_releases() == 1
    assert [job.task_id for job in woken] == ["b"]
    assert ends.LEDGER.unconfirmed == [grant]
    row.pk = process  # registered again
    row.save(force_insert=True)
    assert ends.confirm_releases() == 0
    assert ends.LEDGER.unconfirmed == []


def test_confirm__orm_store__redoes_a_lease_still_held(
    process: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ORM path (every other database) keeps the contract: a lease still held is released.
    from django_fair_jobs.slots import store_orm

    grant = acquire(process, "a")
    confirmed, freed = store_orm.confirm_releases([grant], process_id=process)
    assert confirmed and freed == [(grant.slot_id, 0)]
    assert not SlotLease.objects.exists() and slot().current_jobs == 0


# A script run against a server of the test's own, as a worker process: it holds ten
# slots, releases the first durably and the nine others asynchronously, then waits; once
# the test has crashed and restarted the server, it reports which leases the crash brought
# back, and again once its maintenance thread has confirmed its releases. Then it releases
# five more asynchronously, confirms them itself, and once the test has crashed the server
# again, reports what came back.
CRASH_SCRIPT = """
import json, sys, time
import django
django.setup()
from django.db import InterfaceError, OperationalError, connection, transaction
from django.test import override_settings
from django_fair_jobs import identity
from django_fair_jobs.admission import ends
from django_fair_jobs.models import SlotLease, TenantQueueSlot
from django_fair_jobs.slots import store

pid = identity.current_process_id("crash@h")  # as a worker's, its threads started
grants = [
    store.try_acquire(tenant="t", queue="q", task_id=f"job{i}", limit=100, process_id=pid,
                      timeout=600).grant
    for i in range(10)
]
with override_settings(FAIR_JOBS_ASYNC_RELEASE=False):
    ends.release(grants[0])
with override_settings(FAIR_JOBS_ASYNC_RELEASE=True):
    for grant in grants[1:]:
        ends.release(grant)
print(json.dumps({"unconfirmed": len(ends.LEDGER.unconfirmed)}), flush=True)
sys.stdin.readline()  # the server crashed and came back
connection.close()

def state():
    return {
        "held": sorted(SlotLease.objects.values_list("task_id", flat=True)),
        "count": TenantQueueSlot.objects.get(tenant="t").current_jobs,
    }

after_crash = state()
# The process's maintenance thread confirms the releases at its first pass.
deadline = time.monotonic() + 120
while ends.LEDGER.unconfirmed and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({"after_crash": after_crash, "after_confirm": state(),
                  "unconfirmed": len(ends.LEDGER.unconfirmed)}), flush=True)

grants = [
    store.try_acquire(tenant="t", queue="q", task_id=f"job{i}", limit=100, process_id=pid,
                      timeout=600).grant
    for i in range(10, 15)
]
with override_settings(FAIR_JOBS_ASYNC_RELEASE=True):
    for grant in grants:
        ends.release(grant)
ends.confirm_releases()
print(json.dumps({"unconfirmed": len(ends.LEDGER.unconfirmed)}), flush=True)
sys.stdin.readline()  # the server crashed and came back again
connection.close()
print(json.dumps({"after_second_crash": state()}), flush=True)
"""


@pytest.fixture
def crashable_pg() -> Iterator[ThrowawayPostgres]:
    """A server of the test's own whose WAL writer waits 10 s between flushes (the most
    it may), so that an asynchronous commit is still in memory when the server crashes."""
    server = ThrowawayPostgres()
    try:
        server.init()
        with (server.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "synchronous_commit = on\nwal_writer_delay = 10s\nautovacuum = off\n"
                "bgwriter_lru_maxpages = 0\n"
            )
        server.start()
        subprocess.run(
            ["psql", server.url(), "-qc", "CREATE DATABASE crash"], check=True, capture_output=True
        )
        yield server
    finally:
        server.destroy()


@pytest.mark.workers
def test_crash_of_the_server__async_releases_lost__confirm_releases_them_again(
    crashable_pg: ThrowawayPostgres,
) -> None:
    # The maintenance thread's first pass comes after the crash (which takes a second or
    # two), not before: it would confirm the releases and the crash lose nothing.
    script = start_script(crashable_pg, CRASH_SCRIPT, FAIR_JOBS_HEARTBEAT_INTERVAL="15")
    assert script.stdin is not None and script.stdout is not None
    try:
        assert json.loads(script.stdout.readline()) == {"unconfirmed": 9}
        crash(crashable_pg, script)
        report = json.loads(script.stdout.readline())
        assert json.loads(script.stdout.readline()) == {"unconfirmed": 0}
        crash(crashable_pg, script)
        second = json.loads(script.stdout.readline())
    finally:
        script.kill()
        script.wait()
    held = report["after_crash"]["held"]
    # The durable release survived; the asynchronous ones after it were lost with the WAL
    # the crash took, and their slots show held (fewer jobs would run, never more).
    assert "job0" not in held
    assert held, "no asynchronous release was lost: the crash proved nothing"
    assert report["after_crash"]["count"] == len(held)
    # The maintenance pass released every one of them again, and nothing is left to confirm.
    assert report["after_confirm"] == {"held": [], "count": 0}
    assert report["unconfirmed"] == 0
    # Confirmed releases are on disk: a crash right after the confirmation (well within
    # the WAL writer's 10 s) brought none of them back.
    assert second == {"after_second_crash": {"held": [], "count": 0}}


def start_script(server: ThrowawayPostgres, script: str, **env: str) -> subprocess.Popen[str]:
    """Migrate ``server``'s database ``crash`` and start ``script`` against it, as a worker
    process of the test suite's settings (``env``: more environment), its standard input
    and output piped."""
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(ROOT),
        "DATABASE_URL": server.url("crash"),
        "FAIR_JOBS_WORKER_TIMEOUT": "60",
        **env,
    }
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0"], cwd=ROOT, env=environ, check=True
    )
    return subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=environ, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip


def crash(server: ThrowawayPostgres, script: subprocess.Popen[str]) -> None:
    """Crash ``server`` (every server process killed, the WAL still in memory with them),
    start it again, and tell ``script`` to go on."""
    server._run(_binary("pg_ctl"), "-D", str(server.data), "-m", "immediate", "-w", "stop")
    server.start()
    assert script.stdin is not None
    script.stdin.write("go\n")
    script.stdin.flush()


@override_settings(FAIR_JOBS_ASYNC_RELEASE=True)
def test_confirm__database_error__kept_for_the_next_pass_which_goes_on(
    process: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    grant = acquire(process, "a")
    ends.release(grant)

    def fail(grants: list[Grant], *, process_id: uuid.UUID) -> Any:
        raise OperationalError("the server closed the connection")

    monkeypatch.setattr(slot_store, "confirm_releases", fail)
    assert ends.confirm_releases() == 0  # the maintenance pass goes on to its next step
    assert ends.LEDGER.unconfirmed == [grant]
    monkeypatch.undo()
    monkeypatch.setattr(ends.LEDGER, "unconfirmed", [grant])
    monkeypatch.setattr(identity, "registered_process_id", lambda: process)
    assert ends.confirm_releases() == 0
    assert ends.LEDGER.unconfirmed == []

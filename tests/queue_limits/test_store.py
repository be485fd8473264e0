"""Queue limits against the real database: the statements of mechanism D, without workers."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from django.core.management import call_command
from django.test import override_settings

from django_fair_jobs import headers as fair_headers
from django_fair_jobs import identity, queue_limits
from django_fair_jobs.leases import store as lease_store
from django_fair_jobs.leases.types import Grant
from django_fair_jobs.models import (
    ParkedJob,
    QueueLimit,
    SlotLease,
    TenantQueueSlot,
    WorkerProcess,
)
from django_fair_jobs.queue_limits import store as queue_store
from django_fair_jobs.slots import store as slot_store

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]

NODE_A, NODE_B = uuid.uuid4(), uuid.uuid4()


@pytest.fixture
def process() -> uuid.UUID:
    pid = uuid.uuid4()
    identity.register_process(process_id=pid, node="a@host", hostname="host", pid=1, node_id=NODE_A)
    return pid


Take = Callable[..., tuple[str, Grant | None]]


@pytest.fixture
def take(process: uuid.UUID) -> Take:
    def take(
        task_id: str,
        queue: str = "hooks",
        tenant: str | None = None,
        node: uuid.UUID = NODE_A,
        limit: int = 5,
        woken: bool = False,
    ) -> tuple[str, Grant | None]:
        got = queue_store.try_acquire(
            queue=queue, tenant=tenant, limit=limit, task_id=task_id,
            process_id=process, node_id=node, woken=woken,
        )  # fmt: skip
        return got.status, got.grant

    return take


def row(queue: str = "hooks") -> QueueLimit:
    return QueueLimit.objects.get(queue=queue)


def park(
    task_id: str,
    queue: str = "hooks",
    tenant: str | None = None,
    node: uuid.UUID = NODE_A,
    limit: int = 5,
) -> str:
    return queue_store.try_park(
        queue=queue, tenant=tenant, limit=limit, task_id=task_id, task_name="t",
        signature="{}", node_id=node,
    )  # fmt: skip


def test_global_limit__nth_plus_one_refused_until_a_release(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs=3)
    grants = [take(f"j{i}") for i in range(3)]
    assert [status for status, _ in grants] == ["held"] * 3
    assert take("j3")[0] == "queue_full"
    assert row().current_jobs == 3 and row().running == {str(NODE_A): 3}
    released = queue_store.release(grants[0][1])  # type: ignore[arg-type]
    assert released == (0, None)
    assert take("j3")[0] == "held"
    # A second release with the same grant is fenced off.
    assert queue_store.release(grants[0][1]) is None  # type: ignore[arg-type]
    assert row().current_jobs == 3


def test_global_limit__shared_by_two_nodes(take: Take) -> None:
    # LF-11: limit 3, node A takes 2, node B 1, then both are refused.
    queue_limits.set_limits("hooks", max_jobs=3)
    a1, a2 = take("a1"), take("a2")
    b1 = take("b1", node=NODE_B)
    assert [a1[0], a2[0], b1[0]] == ["held"] * 3
    assert take("a3")[0] == take("b2", node=NODE_B)[0] == "queue_full"
    assert row().running == {str(NODE_A): 2, str(NODE_B): 1}
    queue_store.release(a1[1])  # type: ignore[arg-type]
    assert take("b2", node=NODE_B)[0] == "held"


def test_per_worker_limit__counts_by_node(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs_per_worker=2)
    assert [take(f"a{i}")[0] for i in range(3)] == ["held", "held", "queue_full"]
    assert [take(f"b{i}", node=NODE_B)[0] for i in range(3)] == ["held", "held", "queue_full"]


def test_both_limits__the_stricter_applies(take: Take) -> None:
    # LF-07: global 5, per worker 2: the same node's third is refused; global caps the rest.
    queue_limits.set_limits("hooks", max_jobs=5, max_jobs_per_worker=2)
    assert [take(f"a{i}")[0] for i in range(3)] == ["held", "held", "queue_full"]
    nodes = [uuid.uuid4() for _ in range(3)]
    held = [take(f"n{i}-{j}", node=node)[0] for i, node in enumerate(nodes) for j in range(2)]
    assert held.count("held") == 3  # 2 on A + 3 = the global 5
    assert row().current_jobs == 5


def test_limit_zero__pauses_and_raising_it_wakes_the_line(
    take: Take, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue_limits.set_limits("hooks", max_jobs=0)
    assert take("j1")[0] == "queue_full"
    assert park("j1") == "parked"
    assert row().parked_jobs == 1
    woken: list[str] = []
    monkeypatch.setattr(
        "django_fair_jobs.messages.publish_woken", lambda job, app=None: woken.append(job.task_id)
    )
    queue_limits.set_limits("hooks", max_jobs=1)
    assert woken == ["j1"]
    assert row().parked_jobs == 0
    assert take("j1", woken=True)[0] == "held"
    assert not ParkedJob.objects.exists()


def test_per_worker_zero__pauses_too(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs_per_worker=0)
    assert take("j1")[0] == "queue_full"
    assert park("j1") == "parked"
    assert queue_store.wake_one(row().pk) is None


def test_limits__independent_per_queue__unlimited_queue_has_no_row(take: Take) -> None:
    # LF-08, LF-09.
    queue_limits.set_limits("email", max_jobs=1)
    queue_limits.set_limits("hooks", max_jobs=2)
    assert take("e1", queue="email")[0] == "held"
    assert take("e2", queue="email")[0] == "queue_full"
    assert [take(f"h{i}")[0] for i in range(3)] == ["held", "held", "queue_full"]
    assert take("x", queue="free")[0] == "unlimited"
    assert not QueueLimit.objects.filter(queue="free").exists()


def test_tenant_and_queue__both_or_neither(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs=2)
    # The tenant's slot row is created on first use, together with the queue place.
    status, grant = take("t1", tenant="acme", limit=1)
    assert status == "held" and grant is not None and grant.slot_id is not None
    slot = TenantQueueSlot.objects.get(tenant="acme", queue="hooks")
    assert slot.current_jobs == 1
    # Tenant full: the queue place is not taken either.
    assert take("t2", tenant="acme", limit=1)[0] == "full"
    assert row().current_jobs == 1
    # Queue full: the tenant slot is not taken either.
    assert take("o1", tenant="other", limit=1)[0] == "held"
    assert take("z1", tenant="zeta", limit=1)[0] == "queue_full"
    assert not TenantQueueSlot.objects.filter(tenant="zeta", current_jobs__gt=0).exists()
    # Released together.
    queue_store.release(grant)
    slot.refresh_from_db()
    assert (slot.current_jobs, row().current_jobs) == (0, 1)
    assert SlotLease.objects.filter(slot__isnull=False, queue_limit__isnull=True).count() == 0


def test_park__only_while_blocked__and_wake_skips_jobs_whose_tenant_is_full(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs=2)
    assert park("early") == "room"  # nothing blocks it
    _, greedy = take("g1", tenant="greedy", limit=1)
    _, small = take("s1", tenant="small", limit=1)
    assert park("g2", tenant="greedy", limit=1) == "parked"  # first in line; tenant full
    assert park("s2", tenant="small", limit=1) == "parked"
    assert park("s2", tenant="small", limit=1) == "already_parked"
    assert row().parked_jobs == 2
    assert queue_store.wake_one(row().pk) is None  # the queue is full
    in_line, _ = queue_store.release(small)  # type: ignore[arg-type,misc]
    assert in_line == 2
    woken = queue_store.wake_one(row().pk)
    assert woken is not None and woken.task_id == "s2"  # g2 is held up by its tenant only
    assert greedy is not None


def test_reap__gives_back_global_and_node_counts_on_every_queue(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs=3)
    queue_limits.set_limits("email", max_jobs=3)
    dead = uuid.uuid4()
    identity.register_process(process_id=dead, node="b@h", hostname="h", pid=2, node_id=NODE_B)
    for queue in ("hooks", "email"):
        queue_store.try_acquire(
            queue=queue, tenant="acme", limit=5, task_id=f"d-{queue}", process_id=dead,
            node_id=NODE_B,
        )  # fmt: skip
    take("live")
    WorkerProcess.objects.filter(pk=dead).update(last_heartbeat_at="2000-01-01T00:00:00Z")
    SlotLease.objects.filter(process_id=dead).update(acquired_at="2000-01-01T00:00:00Z")
    reaped = lease_store.reap(timeout=60)
    assert reaped.leases == 2
    assert sorted(n for _, n in reaped.queues) == [1, 1]
    assert row("hooks").running == {str(NODE_A): 1} and row("hooks").current_jobs == 1
    assert row("email").running == {} and row("email").current_jobs == 0
    assert not TenantQueueSlot.objects.filter(current_jobs__gt=0).exists()


def test_duplicate_delivery__refused(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs=3)
    assert take("j1")[0] == "held"
    assert take("j1")[0] == "duplicate"
    assert row().current_jobs == 1


def test_seed__fills_missing_queues_only(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs=7)
    with override_settings(
        FAIR_JOBS_QUEUE_LIMITS={"hooks": 2, "email": 1},
        FAIR_JOBS_QUEUE_LIMITS_PER_WORKER={"email": 1},
    ):
        assert queue_limits.seed() == ["email"]
        assert (row("hooks").max_jobs, row("email").max_jobs) == (7, 1)
        assert row("email").max_jobs_per_worker == 1
        queue_limits.reset()
        assert row("hooks").max_jobs == 2


def test_limit_command__sets_clears_and_resets(capsys: pytest.CaptureFixture[str]) -> None:
    call_command("fair_jobs_limit", "hooks", "--max-jobs", "4", "--per-worker", "1")
    assert (row().max_jobs, row().max_jobs_per_worker) == (4, 1)
    call_command("fair_jobs_limit", "hooks", "--per-worker", "2")
    assert (row().max_jobs, row().max_jobs_per_worker) == (4, 2)
    call_command("fair_jobs_limit", "hooks", "--clear")
    assert (row().max_jobs, row().max_jobs_per_worker) == (None, None)
    assert "hooks" not in queue_limits.limited_queues(refresh=True)
    with override_settings(FAIR_JOBS_QUEUE_LIMITS={"hooks": 3}):
        call_command("fair_jobs_limit", "--reset")
    assert row().max_jobs == 3
    out = capsys.readouterr().out
    assert "hooks" in out


def test_limit_command__bad_input_is_a_clear_error() -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="whole number"):
        call_command("fair_jobs_limit", "hooks", "--max-jobs", "-1")
    with pytest.raises(CommandError, match="QUEUE"):
        call_command("fair_jobs_limit", "--max-jobs", "1")
    assert not QueueLimit.objects.exists()


def test_status_command__lists_limits_running_by_node_and_parked(
    take: Take, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    queue_limits.set_limits("hooks", max_jobs=1, max_jobs_per_worker=1)
    take("j1")
    assert park("j2") == "parked"
    call_command("fair_jobs_status")
    text = capsys.readouterr().out
    assert "hooks" in text and "a@host" in text
    call_command("fair_jobs_status", "--json")
    data = json.loads(capsys.readouterr().out)
    (queue,) = data["queues"]
    assert queue["queue"] == "hooks"
    assert (queue["max_jobs"], queue["max_jobs_per_worker"]) == (1, 1)
    assert queue["running"] == 1 and queue["parked"] == 1
    assert queue["running_by_node"] == {"a@host": 1}
    assert queue["oldest_parked_seconds"] is not None


@pytest.mark.parametrize("redelivered", [False, True])
def test_woken_copy__dropped_when_stale__started_afresh_when_redelivered(
    redelivered: bool,
) -> None:
    # A woken copy whose parked row is gone was started by another copy: dropped. But a
    # redelivery (its holder died before acknowledging) must run, or the job is lost.
    from celery.exceptions import Ignore

    from django_fair_jobs.headers import WAKE as WAKE_HEADER
    from tests.testapp import tasks

    task = tasks.no_tenant
    task.push_request(
        id=f"woken-{redelivered}",
        headers={WAKE_HEADER: 1},
        delivery_info={"routing_key": "fair", "redelivered": redelivered},
        hostname="t@h",
        is_eager=False,
    )
    try:
        if redelivered:
            assert task(21) == 42
        else:
            with pytest.raises(Ignore):
                task(21)
    finally:
        task.pop_request()


def test_limit_cleared_while_jobs_run__waiting_jobs_woken_at_once__queue_drains_on_its_row(
    take: Take, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue_limits.set_limits("hooks", max_jobs=1)
    _, running = take("j1")
    assert park("j2") == "parked"
    woken: list[str] = []
    monkeypatch.setattr(
        "django_fair_jobs.messages.publish_woken", lambda job, app=None: woken.append(job.task_id)
    )
    queue_limits.set_limits("hooks", max_jobs=None)
    assert woken == ["j2"]  # not left waiting for j1 to finish
    # j1 still holds a place: the queue stays on the limited path until it is given back.
    assert "hooks" in queue_limits.limited_queues(refresh=True)
    assert queue_store.release(running) is not None  # type: ignore[arg-type]
    assert "hooks" not in queue_limits.limited_queues(refresh=True)


def test_tenant_wake__never_takes_a_job_waiting_in_a_queue_line(take: Take) -> None:
    queue_limits.set_limits("hooks", max_jobs=1)
    take("j1", tenant="acme", limit=1)
    assert park("j2", tenant="acme", limit=1) == "parked"
    slot = TenantQueueSlot.objects.get(tenant="acme", queue="hooks")
    TenantQueueSlot.objects.filter(pk=slot.pk).update(max_jobs=5)
    assert slot_store.wake_one(slot.pk) is None
    assert ParkedJob.objects.get().woken_at is None


def test_is_limited__database_down_before_any_read__takes_the_slot_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db import OperationalError

    def down(**kwargs: object) -> frozenset[str]:
        raise OperationalError("down")

    monkeypatch.setattr(queue_limits, "limited_queues", down)
    monkeypatch.setattr(queue_limits._cache, "pid", -1)
    assert queue_limits.is_limited("anything") is True


@pytest.mark.parametrize("redelivered", [False, True])
def test_postpone__keeps_the_wake_mark_only_on_a_woken_copy(
    redelivered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.canvas import Signature

    from django_fair_jobs import messages
    from tests.testapp import tasks

    sent: list[tuple[dict[str, object], dict[str, object]]] = []
    monkeypatch.setattr(
        Signature, "apply_async", lambda self, **kw: sent.append((dict(self.options), kw))
    )
    task = tasks.limited1
    task.push_request(
        id="p1",
        headers={fair_headers.WAKE: 3, "fair_tenant": "acme"},
        delivery_info={"routing_key": "fair", "redelivered": redelivered},
        is_eager=False,
    )
    try:
        messages.postpone(task, ("acme",), {}, countdown=1, reason="test")
    finally:
        task.pop_request()
    ((options, kwargs),) = sent
    headers = options.get("headers") or {}
    assert isinstance(headers, dict)
    if redelivered:
        assert fair_headers.WAKE not in headers and "fair_wake" not in kwargs
    else:
        assert headers[fair_headers.WAKE] == 3 and kwargs == {"fair_wake": 3}


def _dead_queue_lease(task_id: str) -> uuid.UUID:
    """A job that holds a place in ``hooks`` and acme's slot, on a process that died."""
    dead = uuid.uuid4()
    identity.register_process(process_id=dead, node="b@h", hostname="h", pid=2, node_id=NODE_B)
    got = queue_store.try_acquire(
        queue="hooks", tenant="acme", limit=5, task_id=task_id, process_id=dead, node_id=NODE_B
    )
    assert got.status == "held"
    WorkerProcess.objects.filter(pk=dead).update(last_heartbeat_at="2000-01-01T00:00:00Z")
    SlotLease.objects.filter(process_id=dead).update(acquired_at="2000-01-01T00:00:00Z")
    return dead


def test_tenant_path__never_claims_a_queue_lease__the_queue_place_is_not_leaked(
    process: uuid.UUID,
) -> None:
    # A redelivered copy reaching a process whose limited-queue cache predates the limit
    # takes the tenant path. Claiming the dead holder's queue lease there would make its
    # release lower only the tenant slot: the queue's place would be lost for good.
    queue_limits.set_limits("hooks", max_jobs=3)
    _dead_queue_lease("x")
    got = slot_store.try_acquire(
        tenant="acme", queue="hooks", task_id="x", limit=5, process_id=process, timeout=60
    )
    assert got.status == "duplicate" and got.grant is None
    # The lease stays the queue path's: the reaper gives back both places together.
    lease_store.reap(timeout=60)
    assert (row().current_jobs, row().running) == (0, {})
    assert not TenantQueueSlot.objects.filter(current_jobs__gt=0).exists()


def test_maintenance__recounts_queue_places_from_leases_under_the_row_lock(
    take: Take,
) -> None:
    # Whatever leaked a queue's counters (a place taken and never given back), maintenance
    # puts them back to what the leases say.
    queue_limits.set_limits("hooks", max_jobs=3)
    take("live")
    QueueLimit.objects.filter(queue="hooks").update(
        current_jobs=3, running={str(NODE_A): 2, str(NODE_B): 1}
    )
    assert queue_store.reconcile_running() == 1
    assert (row().current_jobs, row().running) == (1, {str(NODE_A): 1})
    assert queue_store.reconcile_running() == 0  # nothing left to fix
    from django_fair_jobs import maintenance

    QueueLimit.objects.filter(queue="hooks").update(current_jobs=2, running={})
    maintenance.run_maintenance(timeout=60)
    assert (row().current_jobs, row().running) == (1, {str(NODE_A): 1})


def test_limit_command__no_global_option__max_jobs_is_the_one_name() -> None:
    from io import StringIO

    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="unrecognized arguments: --global"):
        call_command("fair_jobs_limit", "hooks", "--global", "3", stdout=StringIO())
    call_command("fair_jobs_limit", "hooks", "--max-jobs", "3", stdout=StringIO())
    assert row().max_jobs == 3

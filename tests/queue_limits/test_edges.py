"""Queue limits at their edges, against the real database and broker: the per-process
cache of limited queues after a change, the status of a queue whose node restarted or
whose line was partly woken, and wake-ups that take exactly the room a change made."""

from __future__ import annotations

import uuid

import pytest
from kombu.utils.json import dumps

from django_fair_jobs import identity, queue_limits
from django_fair_jobs.models import ParkedJob, QueueLimit
from django_fair_jobs.queue_limits import store as queue_store
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("broker_env")]

NODE_A, NODE_B = uuid.uuid4(), uuid.uuid4()


def _register(node_id: uuid.UUID, node: str = "a@host") -> uuid.UUID:
    pid = uuid.uuid4()
    identity.register_process(process_id=pid, node=node, hostname="host", pid=1, node_id=node_id)
    return pid


def _park(task_id: str, queue: str = "hooks") -> None:
    """Park a job with a real signature, so that a wake-up publishes it for real."""
    signature = str(dumps(dict(tasks.no_tenant.signature((1,), task_id=task_id))))
    got = queue_store.try_park(
        queue=queue, tenant=None, limit=5, task_id=task_id, task_name=tasks.no_tenant.name,
        signature=signature, node_id=NODE_A,
    )  # fmt: skip
    assert got == "parked"


def _woken(queue: str = "hooks") -> list[str]:
    rows = ParkedJob.objects.filter(queue_limit__queue=queue, woken_at__isnull=False)
    return sorted(rows.values_list("task_id", flat=True))


def test_limit_set_on_a_queue_without_one__limited_at_once_in_this_process() -> None:
    """The process that sets a limit sees its queue limited at once, not after its cached
    set of limited queues next expires."""
    assert "fresh" not in queue_limits.limited_queues(refresh=True)
    assert queue_limits.is_limited("fresh") is False
    queue_limits.set_limits("fresh", max_jobs=1)
    assert queue_limits.is_limited("fresh") is True
    queue_limits.set_limits("fresh", max_jobs=None)
    assert queue_limits.is_limited("fresh") is False


def test_status__a_restarted_node__its_runs_summed_under_its_name__a_gone_node_named() -> None:
    """Two node ids of one node name (a worker restarted) show as one node with the jobs
    of both; a node id no process row names shows as a gone node."""
    pa, pb = _register(NODE_A), _register(NODE_B)
    gone = uuid.uuid4()
    queue_limits.set_limits("hooks", max_jobs=5)
    for task_id, process, node in (("a1", pa, NODE_A), ("b1", pb, NODE_B), ("g1", pa, gone)):
        got = queue_store.try_acquire(
            queue="hooks", tenant=None, limit=5, task_id=task_id, process_id=process,
            node_id=node, woken=False,
        )  # fmt: skip
        assert got.status == "held"
    (queue,) = queue_limits.queue_status()
    assert queue["running"] == 3
    assert queue["running_by_node"] == {"a@host": 2, f"gone node {str(gone)[:8]}": 1}


def _three_in_a_paused_line() -> None:
    """Jobs j1, j2 and j3 parked, in that order, in the line of the paused queue hooks."""
    queue_limits.set_limits("hooks", max_jobs=0)
    for task_id in ("j1", "j2", "j3"):
        _park(task_id)


def test_status__woken_jobs_not_counted_as_parked() -> None:
    """A woken job has left the line (it is on its way to a worker): the queue's status
    counts only the jobs still waiting in line."""
    _three_in_a_paused_line()
    queue_limits.set_limits("hooks", max_jobs=1)
    assert len(_woken()) == 1
    (queue,) = queue_limits.queue_status()
    assert (queue["parked"], queue["paused"]) == (2, False)
    assert queue["oldest_parked_seconds"] is not None


def test_raised_limit__wakes_exactly_the_room_it_made() -> None:
    """Raising a paused queue's limit to 2 wakes the first 2 of 3 jobs in its line, not a
    third that would only find the queue full."""
    _three_in_a_paused_line()
    queue_limits.set_limits("hooks", max_jobs=2)
    assert _woken() == ["j1", "j2"]
    row = QueueLimit.objects.get(queue="hooks")
    assert queue_limits.wake_line(row.pk, limit=0) == 0
    assert _woken() == ["j1", "j2"]

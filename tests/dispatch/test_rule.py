"""Fair dispatch's selection rule and bookkeeping, on the real database (no worker): jobs
are enqueued through the task, dispatched into a capacity the test sets, and started and
ended through the same calls a worker makes."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from bench.pgstats import row_updates, statistics
from django_fair_jobs import dispatch
from django_fair_jobs.dispatch.models import (
    DISPATCHED,
    RUNNING,
    WAITING,
    DispatchJob,
    DispatchQueue,
    DispatchTenant,
)
from django_fair_jobs.models import TenantQueueSlot
from tests.conftest import is_postgres, runs_sql
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("engine")]

PROCESS = uuid.uuid4()
PUBLISHED: list[int] = []
"""Row ids of the jobs dispatched in this test, in order (nothing reaches a broker)."""


@pytest.fixture(autouse=True)
def published(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Nothing is published: dispatched jobs are collected (their row ids) instead."""
    published = PUBLISHED
    published.clear()

    def collect(app: Any, ready: list[dispatch.Ready]) -> int:
        published.extend(r.job_id for r in ready)
        return len(ready)

    monkeypatch.setattr(dispatch, "publish", collect)
    tasks.DISPATCH_WEIGHTS.clear()
    dispatch._weights.clear()
    yield published
    tasks.DISPATCH_WEIGHTS.clear()
    dispatch._weights.clear()


def set_capacity(capacity: int, queue: str = "fair", slack: int = 0) -> None:
    DispatchQueue.objects.update_or_create(
        queue=queue, defaults={"capacity": capacity, "slack": slack}
    )


def tenant_of(job_id: int) -> str:
    return DispatchJob.objects.values_list("tenant", flat=True).get(pk=job_id)


def run_one(job_id: int) -> list[dispatch.Ready]:
    """Start and end a dispatched job as a worker would; returns what its end dispatched."""
    assert dispatch.start(job_id, PROCESS).status == "started"
    ready = dispatch.end(job_id, PROCESS)
    PUBLISHED.extend(r.job_id for r in ready)
    return ready


def pump() -> list[dispatch.Ready]:
    """Dispatch into the queue's room, as maintenance does."""
    ready = dispatch.dispatch("fair")
    PUBLISHED.extend(r.job_id for r in ready)
    return ready


def enqueue(tenant: str, n: int = 1, task: Any = tasks.dispatched) -> list[str]:
    return [task.delay(tenant).id for _ in range(n)]


def dispatched_tenants() -> list[str]:
    rows = DispatchJob.objects.filter(state=DISPATCHED).order_by("dispatched_at", "id")
    return list(rows.values_list("tenant", flat=True))


def test_enqueue_without_capacity__waits_in_line__nothing_published(published: list[int]) -> None:
    ids = enqueue("a", 3)
    assert published == []
    rows = DispatchJob.objects.order_by("id")
    assert [r.task_id for r in rows] == ids and {r.state for r in rows} == {WAITING}
    line = DispatchTenant.objects.get(tenant="a")
    assert (line.waiting, line.in_flight, line.head_id) == (3, 0, rows[0].pk)


def test_enqueue_with_room__dispatched_at_once__up_to_capacity_plus_slack(
    published: list[int],
) -> None:
    set_capacity(2, slack=1)
    enqueue("a", 5)
    assert len(published) == 3
    assert dispatch.in_flight() == {"fair": 3}
    assert DispatchJob.objects.filter(state=WAITING).count() == 2


def test_max_min__the_tenant_with_fewest_in_flight_goes_first(published: list[int]) -> None:
    enqueue("greedy", 20)
    set_capacity(3)
    pump()  # greedy alone: it takes the whole queue
    assert Counter(dispatched_tenants()) == {"greedy": 3}
    enqueue("small", 2)
    first = published[0]
    ready = run_one(first)  # a greedy job ends: the room goes to the newcomer
    assert [tenant_of(r.job_id) for r in ready] == ["small"]


def test_newcomer__served_before_a_backlogged_tenant_with_equal_load(published: list[int]) -> None:
    # Both have nothing in flight; greedy has been served often (its virtual time is
    # ahead), small enters at the queue's virtual time: small first.
    set_capacity(1)
    enqueue("greedy", 10)
    for _ in range(5):
        run_one(published[-1])
    enqueue("small", 1)
    ready = run_one(published[-1])
    assert [tenant_of(r.job_id) for r in ready] == ["small"]


def test_floor__an_idle_tenant_banks_no_credit(published: list[int]) -> None:
    set_capacity(1)
    enqueue("early", 1)
    run_one(published[-1])  # early is served once, then idles
    enqueue("busy", 30)
    for _ in range(20):
        run_one(published[-1])
    enqueue("early", 3)
    # Back after idling: it re-enters at the queue's virtual time, not 19 turns ahead:
    # the next dispatches alternate instead of giving early three in a row.
    served = []
    for _ in range(4):
        ready = run_one(published[-1])
        served.append(tenant_of(ready[0].job_id))
    assert served.count("early") == 2, served
    early = DispatchTenant.objects.get(tenant="early")
    busy = DispatchTenant.objects.get(tenant="busy")
    assert abs(early.pass_value - busy.pass_value) <= 1.0


def test_oldest_job__within_a_tenant_fifo(published: list[int]) -> None:
    ids = enqueue("a", 3)
    set_capacity(3)
    pump()
    order = DispatchJob.objects.filter(pk__in=published).order_by("dispatched_at", "id")
    assert [r.task_id for r in order] == ids


def next_job_id(value: int) -> None:
    """Make the next job row's id ``value``: as when two enqueues commit in the other order
    than their rows took their ids (each row is stored before its line is written)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence('fair_jobs_dispatchjob', 'id'), %s, false)",
            [value],
        )


def test_oldest_job__an_enqueue_older_than_its_lines_head__leads_the_line(
    published: list[int],
) -> None:
    if not is_postgres():
        pytest.skip("SQLite's writers take turns and its ids only grow: no race to replay")
    next_job_id(1_000_100)
    (newer,) = enqueue("a")
    next_job_id(1_000_000)
    (older,) = enqueue("a")
    pk = dict(DispatchJob.objects.values_list("task_id", "pk"))
    assert pk[older] < pk[newer]
    assert DispatchTenant.objects.get(tenant="a").head_id == pk[older]
    set_capacity(2)
    pump()
    order = DispatchJob.objects.filter(pk__in=published).order_by("dispatched_at", "id")
    assert [r.task_id for r in order] == [older, newer]


def test_an_older_enqueue_of_an_uncapped_task__leads_a_blocked_line__dispatched_at_once(
    published: list[int],
) -> None:
    # The line is blocked at its head's task cap (2 in flight); an older job of an
    # uncapped task reaches it later and leads: the line stayed blocked at the old head's
    # cap, and the job waited for the end of a capped one.
    if not is_postgres():
        pytest.skip("SQLite's writers take turns and its ids only grow: no race to replay")
    set_capacity(8)
    next_job_id(1_000_100)
    enqueue("a", 3, task=tasks.dispatched_capped)
    assert len(published) == 2 and DispatchTenant.objects.get(tenant="a").blocked
    next_job_id(1_000_000)
    (older,) = enqueue("a")
    assert published[2:] == [DispatchJob.objects.get(task_id=older).pk]


def test_weights__one_three_six__shares_of_starts_within_five_percent(
    published: list[int],
) -> None:
    tasks.DISPATCH_WEIGHTS.update({"w1": 1, "w3": 3, "w6": 6})
    for tenant in ("w1", "w3", "w6"):
        enqueue(tenant, 150)
    set_capacity(4)
    pump()
    starts: Counter[str] = Counter()
    flying = list(published)
    for _ in range(200):
        job = flying.pop(0)
        starts[tenant_of(job)] += 1
        flying += [r.job_id for r in run_one(job)]
    total = sum(starts.values())
    for tenant, weight in (("w1", 0.1), ("w3", 0.3), ("w6", 0.6)):
        assert abs(starts[tenant] / total - weight) <= 0.05 * weight + 0.01, starts


def test_cap__a_tenant_at_its_cap_is_skipped__the_room_goes_to_the_next(
    published: list[int],
) -> None:
    enqueue("capped", 10, task=tasks.dispatched_capped)
    set_capacity(4)
    pump()
    assert DispatchTenant.objects.get(tenant="capped").in_flight == 2  # fair_max_jobs=2
    assert dispatch.in_flight() == {"fair": 2}  # two processes stay free...
    enqueue("other", 5, task=tasks.dispatched_capped)  # ...for the next tenant
    assert Counter(dispatched_tenants()) == {"capped": 2, "other": 2}


def test_cap__slot_override_and_pause_win_over_the_task(published: list[int]) -> None:
    TenantQueueSlot.objects.create(tenant="vip", queue="fair", max_jobs=3)
    TenantQueueSlot.objects.create(tenant="paused", queue="fair", max_jobs=0)
    enqueue("vip", 5, task=tasks.dispatched_capped)
    enqueue("paused", 5, task=tasks.dispatched_capped)
    set_capacity(8)
    pump()
    assert Counter(dispatched_tenants()) == {"vip": 3}
    started = dispatch.start(published[0], PROCESS)
    assert (started.status, started.cap) == ("started", 3)


def test_second_copy_of_a_message__duplicate__does_not_run(published: list[int]) -> None:
    enqueue("a", 1)
    set_capacity(1)
    pump()
    job = published[0]
    assert dispatch.start(job, PROCESS).status == "started"
    assert dispatch.start(job, uuid.uuid4()).status == "duplicate"
    assert DispatchJob.objects.get(pk=job).state == RUNNING


def test_end__fenced_by_the_process_that_started_it(published: list[int]) -> None:
    enqueue("a", 2)
    set_capacity(1)
    pump()
    job = published[0]
    dispatch.start(job, PROCESS)
    assert dispatch.end(job, uuid.uuid4()) == []  # not its holder: nothing changes
    assert DispatchJob.objects.filter(pk=job).exists()
    assert [r.job_id for r in dispatch.end(job, PROCESS)] != []
    assert not DispatchJob.objects.filter(pk=job).exists()


def test_end_many__one_round_trip__only_its_own_running_jobs__room_dispatched(
    published: list[int],
) -> None:
    enqueue("a", 2)
    enqueue("b", 2)
    enqueue("c", 1)
    set_capacity(2)
    pump()
    mine, theirs = published  # a's and b's first jobs
    other = uuid.uuid4()
    dispatch.start(mine, PROCESS)
    dispatch.start(theirs, other)
    with CaptureQueriesContext(connection) as queries:
        ready = dispatch.end_many([mine, theirs], PROCESS)
    assert not DispatchJob.objects.filter(pk=mine).exists()
    assert DispatchJob.objects.get(pk=theirs).state == RUNNING  # another process's: kept
    assert [tenant_of(r.job_id) for r in ready] == ["c"]  # the one place it left
    lines = dict(DispatchTenant.objects.values_list("tenant", "in_flight"))
    assert lines == {"a": 0, "b": 1, "c": 1}
    assert dispatch.end_many([mine], PROCESS) == []  # sent again: nothing left to end
    if runs_sql():
        assert len(queries) == 1


def test_end_many__two_jobs_of_one_line__its_count_in_flight_drops_by_both(
    published: list[int],
) -> None:
    # A flush carries every end its process made since the last one, often several of
    # one tenant: the line's count in flight drops by each of them, not by one per line
    # (a count left too high holds the tenant back, below its share and at its cap early).
    set_capacity(2)
    enqueue("a", 4)
    first, second = published
    for job in (first, second):
        assert dispatch.start(job, PROCESS).status == "started"
    ready = dispatch.end_many([first, second], PROCESS)
    assert [tenant_of(r.job_id) for r in ready] == ["a", "a"]  # the room both left
    line = DispatchTenant.objects.get(tenant="a")
    assert (line.in_flight, line.waiting) == (2, 0)
    assert dispatch.recount() == 0  # no drift for maintenance to set right


def test_cancel__a_countdown_of_a_line_with_jobs_waiting__the_waiting_count_stays_true(
    published: list[int],
) -> None:
    # A job not yet due (or failed) is in no line: its cancel lowers the line's waiting
    # count only by the waiting jobs it deleted.
    set_capacity(0)
    enqueue("a", 2)
    later = tasks.dispatched_capped.apply_async(("a",), countdown=3600).id
    cancelled = dispatch.cancel("fair", "a", tasks.dispatched_capped.name)
    assert cancelled == [(later, False)]
    line = DispatchTenant.objects.get(tenant="a")
    assert (line.waiting, line.in_flight) == (2, 0)
    assert dispatch.recount() == 0  # no drift for maintenance to set right


def _ended_and_dispatched(ended: int) -> tuple[list[str], int]:
    """End ``ended`` (running under PROCESS) as a flush does; the tenants of the jobs it
    dispatched, and how many row updates of the line table it made."""
    before = _line_updates()[0]
    ready = dispatch.end_many([ended], PROCESS)
    return [tenant_of(r.job_id) for r in ready], _line_updates()[0] - before


def test_an_end_whose_line_is_chosen_next__one_update_of_that_line(
    published: list[int],
) -> None:
    if not runs_sql():
        pytest.skip("row updates of one statement are the PostgreSQL store's figure")
    # The end's room goes to the ended job's own line: its count in flight goes down by
    # the end and up by the dispatch, so one new version of the line says both, instead
    # of two (each a new entry in every index of the line table).
    set_capacity(1)
    enqueue("a", 3)
    first = published[0]
    assert dispatch.start(first, PROCESS).status == "started"
    tenants, updates = _ended_and_dispatched(first)
    assert (tenants, updates) == (["a"], 1)
    line = DispatchTenant.objects.get(tenant="a")
    jobs = list(DispatchJob.objects.order_by("id").values_list("pk", "state"))
    assert jobs[0][1] == DISPATCHED and jobs[1] == (line.head_id, WAITING)
    assert (line.in_flight, line.waiting, line.pass_value, line.served_pass) == (1, 1, 2.0, 1.0)
    assert not line.blocked and line.dispatched_total == 2


def _row_marks(tenant: str) -> str:
    """The xmax of the line's current row version: the last transaction that locked it or
    carried a lock onto it (each lock a WAL record); unchanged while none does."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xmax::text FROM fair_jobs_dispatchtenant WHERE tenant = %s", [tenant]
        )
        return str(cursor.fetchone()[0])


def test_an_end_whose_line_is_chosen__the_index_first_line_not_locked(
    published: list[int],
) -> None:
    if not runs_sql():
        pytest.skip("row locks are the PostgreSQL store's")
    # b leads the index by a's old key (its head is older) and a by its true count: the
    # room goes to a, and b, which nothing changes, is not locked on the way.
    enqueue("b", 2)
    enqueue("a", 2)
    set_capacity(2)
    pump()
    ended = next(j for j in published if tenant_of(j) == "a")
    assert dispatch.start(ended, PROCESS).status == "started"
    marks = _row_marks("b")
    tenants, updates = _ended_and_dispatched(ended)
    assert (tenants, updates) == (["a"], 1)
    assert _row_marks("b") == marks


def test_an_end_whose_line_is_not_chosen__the_lowest_key_wins(published: list[int]) -> None:
    if not runs_sql():
        pytest.skip("row updates of one statement are the PostgreSQL store's figure")
    # a has two in flight and b none: the room goes to b, and a's line still drops to 1.
    set_capacity(2)
    enqueue("a", 4)
    enqueue("b", 1)
    first = published[0]
    assert dispatch.start(first, PROCESS).status == "started"
    tenants, updates = _ended_and_dispatched(first)
    assert (tenants, updates) == (["b"], 2)
    lines = dict(DispatchTenant.objects.values_list("tenant", "in_flight"))
    assert lines == {"a": 1, "b": 1}


def test_an_end_that_unblocks_its_capped_line__its_next_job_dispatched_in_one_update(
    published: list[int],
) -> None:
    if not runs_sql():
        pytest.skip("row updates of one statement are the PostgreSQL store's figure")
    # At its cap the line is out of the selection's index; the end brings it back with
    # room for one, which its next job takes, and it is at its cap (blocked) again.
    enqueue("capped", 4, task=tasks.dispatched_capped)  # fair_max_jobs=2
    set_capacity(4)
    pump()
    first = published[0]
    assert DispatchTenant.objects.get(tenant="capped").blocked
    assert dispatch.start(first, PROCESS).status == "started"
    tenants, updates = _ended_and_dispatched(first)
    assert (tenants, updates) == (["capped"], 1)
    line = DispatchTenant.objects.get(tenant="capped")
    assert (line.in_flight, line.waiting, line.blocked) == (2, 1, True)


def test_countdown__not_dispatched_before_it_is_due(published: list[int]) -> None:
    set_capacity(2)
    tasks.dispatched.apply_async(("a",), countdown=3600)
    late = tasks.dispatched.apply_async(("a",), countdown=0.2)
    assert published == []
    time.sleep(0.3)
    pump()
    assert [DispatchJob.objects.get(pk=j).task_id for j in published] == [late.id]


def test_due_queues__only_queues_with_a_countdown_come_due(published: list[int]) -> None:
    from datetime import timedelta

    from django.utils import timezone

    set_capacity(0)  # nothing dispatched: the rows stay as enqueued
    set_capacity(0, queue="other")
    tasks.dispatched.apply_async(("a",), countdown=3600)
    tasks.dispatched.apply_async(("a",), queue="other", countdown=3600)
    tasks.dispatched.apply_async(("b",), queue="other")  # waiting, not scheduled
    assert dispatch.due_queues(["fair", "other"]) == []
    DispatchJob.objects.filter(queue="other", state=0).update(
        not_before=timezone.now() - timedelta(seconds=1)
    )
    assert dispatch.due_queues(["fair", "other", "unknown"]) == ["other"]
    assert dispatch.due_queues(["fair"]) == [] and dispatch.due_queues([]) == []


def test_due_queues__a_queue_with_room_and_jobs_waiting(published: list[int]) -> None:
    set_capacity(0)
    tasks.dispatched.delay("a")  # waiting: no room
    assert dispatch.due_queues(["fair"]) == []
    set_capacity(1)  # room, and a job waiting that no end dispatched
    assert dispatch.due_queues(["fair"]) == ["fair"]
    assert len(dispatch.dispatch("fair")) == 1
    assert dispatch.due_queues(["fair"]) == []  # nothing waits any more


def test_publish_failure__aside_for_later__the_next_dispatch_takes_its_room(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    monkeypatch.undo()  # the real publish, with a broker that refuses one job
    enqueue("poison", 1)
    enqueue("fine", 1)
    sent: list[str] = []

    def publish(self: Any, body: Any, **kwargs: Any) -> None:
        if body[0][0] == "poison":
            raise RuntimeError("cannot publish")
        sent.append(body[0][0])

    monkeypatch.setattr("kombu.messaging.Producer.publish", publish)
    set_capacity(1)
    ready = dispatch.dispatch("fair")
    assert [tenant_of(r.job_id) for r in ready] == ["poison"]
    dispatch.publish(celery_app, ready)
    assert sent == []  # nothing dispatched into its room by the failed publish itself...
    dispatch.publish(celery_app, dispatch.dispatch("fair"))
    assert sent == ["fine"]  # ...the next dispatch (an end, the due poll, maintenance) does
    poison = DispatchJob.objects.get(tenant="poison")
    assert poison.publish_failures == 1 and poison.not_before is not None


def test_bulk_enqueue__one_round_trip__lines_in_order__dispatched_fairly(
    published: list[int],
) -> None:
    set_capacity(3)
    items: list[tuple[tuple[str], dict[str, Any]]] = [
        ((t,), {}) for t in ["a", "a", "a", "b", "a", "c"]
    ]
    with CaptureQueriesContext(connection) as queries:
        results = tasks.dispatched.bulk_enqueue(items)
    if runs_sql():
        assert len(queries) == 1  # every job stored and the queue dispatched in one call
    ids = [r.id for r in results]
    assert len(set(ids)) == 6
    rows = {row.task_id: row for row in DispatchJob.objects.all()}
    assert [rows[i].tenant for i in ids] == ["a", "a", "a", "b", "a", "c"]
    # Each tenant's line keeps the order given; the room went one job per tenant.
    a_rows = sorted((rows[i].pk, i) for i in ids if rows[i].tenant == "a")
    assert [i for _, i in a_rows] == [ids[0], ids[1], ids[2], ids[4]]
    assert sorted(tenant_of(j) for j in published) == ["a", "b", "c"]
    assert DispatchTenant.objects.get(tenant="a").waiting == 3
    # The stored message is the job's own: its id, arguments and tenant header.
    first = DispatchJob.objects.get(task_id=ids[0])
    assert '"a"' in first.message and ids[0] in first.message


def test_bulk_enqueue__a_task_id_for_all__refused_nothing_stored(published: list[int]) -> None:
    with pytest.raises(dispatch.DispatchError, match="task id of its own"):
        tasks.dispatched.bulk_enqueue([(("a",), {})], task_id="same")
    assert not DispatchJob.objects.exists()


def test_statements__enqueue_start_end__one_each_on_postgresql(published: list[int]) -> None:
    if not runs_sql():
        pytest.skip("statement counts are the PostgreSQL store's figure; this run is the ORM's")
    set_capacity(1)
    enqueue("a", 1)
    tasks.dispatched.delay("b")  # warm up the task's weights cache for b
    with CaptureQueriesContext(connection) as enqueue_queries:
        tasks.dispatched.delay("b")
    job = published[0]
    with CaptureQueriesContext(connection) as start_queries:
        dispatch.start(job, PROCESS)
    with CaptureQueriesContext(connection) as end_queries:
        ready = dispatch.end(job, PROCESS)
    assert ready  # the end dispatched b's job in the same round trip
    assert (len(enqueue_queries), len(start_queries), len(end_queries)) == (1, 1, 1)


def _line_updates() -> tuple[int, int]:
    """The line table's row updates so far, and how many were HOT."""
    return row_updates(("fair_jobs_dispatchtenant",))["fair_jobs_dispatchtenant"]


def test_enqueue_behind_the_head__its_line_updated_in_place__no_index_entry(
    published: list[int],
) -> None:
    if not is_postgres():
        pytest.skip("HOT updates are PostgreSQL's")
    # A line with jobs waiting: an enqueue behind its head changes only the line's count
    # of jobs waiting, which no index of the line table names, so PostgreSQL updates the
    # line in place (a HOT update) instead of writing an entry in each of its indexes.
    enqueue("a", 2)
    before = _line_updates()
    enqueue("a", 5)
    after = _line_updates()
    assert (after[0] - before[0], after[1] - before[1]) == (5, 5)
    line = DispatchTenant.objects.get(tenant="a")
    first = DispatchJob.objects.order_by("id").values_list("pk", flat=True).first()
    assert (line.waiting, line.head_id) == (7, first)


class _VirtualTimeReads:
    """How many times the steps inside it read a queue's virtual time: calls of
    ``fair_jobs_dispatch_vt`` (PostgreSQL's statistics, which count a function's calls
    from another) on the SQL store, the ORM store's reads of the highest pass."""

    def __enter__(self) -> _VirtualTimeReads:
        self.sql = runs_sql()
        if self.sql:
            with connection.cursor() as cursor:
                cursor.execute("SET track_functions = 'pl'")
            self.before = self._calls()
        else:
            self.queries = CaptureQueriesContext(connection).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sql:
            self.count = self._calls() - self.before
            with connection.cursor() as cursor:
                cursor.execute("RESET track_functions")
        else:
            self.queries.__exit__(None, None, None)
            self.count = sum(
                'MAX("fair_jobs_dispatchtenant"."served_pass")' in q["sql"]
                for q in self.queries.captured_queries
            )

    @staticmethod
    def _calls() -> int:
        rows = statistics(
            "SELECT calls FROM pg_stat_user_functions WHERE funcname = %s",
            ["fair_jobs_dispatch_vt"],
        )
        return int(rows[0][0]) if rows else 0


def test_enqueue_behind_the_head__the_virtual_time_not_read(published: list[int]) -> None:
    # Only a line that was empty re-enters at the queue's virtual time; an enqueue behind
    # a head leaves the line's pass as it was, so it need not read it (one probe less,
    # and on SQLite one read less while the enqueue holds the database's write lock).
    enqueue("a", 1)
    with _VirtualTimeReads() as behind:
        enqueue("a", 3)
    with _VirtualTimeReads() as new_line:
        enqueue("b", 1)
    assert (behind.count, new_line.count) == (0, 1)
    assert DispatchTenant.objects.get(tenant="a").waiting == 4


def test_selection__one_index_probe__blocked_tenants_never_read(published: list[int]) -> None:
    if not is_postgres():
        pytest.skip("the plan is PostgreSQL's")
    # 3,000 lines with jobs waiting, all but the last 30 blocked (at their cap or paused):
    # the selection reads its first row from the index, which holds no blocked line.
    rows = [
        DispatchTenant(
            queue="fair",
            tenant=f"t{i}",
            waiting=1 + i % 3,
            head_id=i + 1,
            in_flight=i % 5,
            blocked=i < 2970,
        )
        for i in range(3000)
    ]
    DispatchTenant.objects.bulk_create(rows)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE fair_jobs_dispatchtenant")
        cursor.execute(
            "EXPLAIN (ANALYZE, COSTS OFF) SELECT t.id FROM fair_jobs_dispatchtenant AS t "
            "WHERE t.queue = 'fair' AND t.head_id IS NOT NULL AND NOT t.blocked "
            "ORDER BY floor(t.in_flight / t.weight), t.pass_value, t.head_id "
            "LIMIT 1 FOR UPDATE SKIP LOCKED"
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "fair_jobs_dispatch_next" in plan and "Sort" not in plan, plan
    assert "Rows Removed by Filter" not in plan, plan  # no line read and thrown away

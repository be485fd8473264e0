"""RabbitMQ quorum queues and Celery's native delayed delivery, on the local RabbitMQ.

With quorum queues Celery cannot hold a countdown in the worker: it publishes the job to a
chain of topic exchanges (``celery_delayed_0`` to ``celery_delayed_27``) under a routing key
of 28 binary digits followed by the queue's own key, and the job reaches its queue through
a ``#.<key>`` binding with that key unchanged. A worker that took the delivery's routing
key for the queue's name would take a tenant slot (and a queue limit) on a queue that does
not exist, and re-publish a deferred job to it, where no worker consumes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue

from django_fair_jobs import routing
from tests.conftest import Worker, wait_for
from tests.testapp.models import JobRun

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]

AMQP = os.environ.get("FAIR_JOBS_CHAOS_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
"""The RabbitMQ the chaos suite uses too (scripts/test.sh checks that it answers)."""


def quorum_queue_declared(name: str) -> Queue:
    """The queue as tests/settings.py declares it with ``FAIR_JOBS_TESTS_QUORUM_QUEUE``: a
    quorum queue on a topic exchange, under a routing key that is not its name."""
    return Queue(
        name,
        Exchange(name, type="topic"),
        routing_key=f"{name}.jobs",
        queue_arguments={"x-queue-type": "quorum"},
    )


@pytest.fixture
def quorum_queue(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Celery]]:
    """A quorum queue of this test's own (deleted at the end) and a publisher app that
    sends to it as a project on quorum queues does."""
    # The environment's broker would override the app's own.
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    name = f"fair_quorum_{uuid.uuid4().hex[:8]}"
    app = Celery("quorum_publisher", broker=AMQP, set_as_current=False)
    app.conf.update(
        task_queues=[quorum_queue_declared(name)],
        broker_transport_options={"confirm_publish": True},
    )
    yield name, app
    with app.connection_for_write() as conn, contextlib.suppress(Exception):
        conn.default_channel.queue_delete(name)  # type: ignore[attr-defined]


def test_delay_prefix__stripped__the_queue_key_kept() -> None:
    key = "0." * 27 + "1.imports"
    assert routing.queue_from_routing_key(key) == "imports"
    # Fewer than 28 digits is a key of the project's own.
    assert routing.queue_from_routing_key("1.0.imports") == "1.0.imports"
    assert routing.queue_from_routing_key("imports") == "imports"


def test_countdowns_on_quorum_queues__slots_on_the_real_queue__retries_come_back(
    start_worker: Callable[..., Worker], quorum_queue: tuple[str, Celery]
) -> None:
    from django_fair_jobs.models import TenantQueueSlot

    name, app = quorum_queue
    start_worker(
        queues=name,
        concurrency=2,
        extra_env={
            "CELERY_BROKER_URL": AMQP,
            "CELERY_BROKER_TRANSPORT_OPTIONS": json.dumps({"confirm_publish": True}),
            "FAIR_JOBS_TESTS_QUORUM_QUEUE": name,
        },
    )
    # Tenant "q" at the default limit of 1: the second job defers by re-publishing itself
    # with a countdown, which on quorum queues is native delayed delivery again.
    sent: list[Any] = [
        app.send_task(
            "tests.testapp.tasks.limited1_retry", args=["q", 0.5], queue=name, countdown=1
        )
        for _ in range(2)
    ]
    ids = {result.id for result in sent}
    wait_for(
        lambda: JobRun.objects.filter(task_id__in=ids, finished_at__isnull=False).count() == 2,
        60,
        "both jobs to run on the quorum queue",
    )
    runs = list(JobRun.objects.filter(task_id__in=ids).order_by("started_at"))
    assert [run.task_id for run in runs] != [] and {run.task_id for run in runs} == ids
    assert len(runs) == 2, "a job ran twice"
    # The deliveries carried the delay prefix and the queue's routing key, not its name...
    assert all(run.queue.endswith(f".{name}.jobs") for run in runs), [r.queue for r in runs]
    # ...yet the slot was the queue's own, so the limit of 1 held across the two jobs.
    assert set(TenantQueueSlot.objects.values_list("queue", flat=True)) == {name}
    first, second = runs
    assert first.finished_at is not None and second.started_at >= first.finished_at


def test_consumed_queue__found_by_its_routing_key__else_the_key_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    app = Celery("consumer", broker=AMQP, set_as_current=False)
    app.conf.task_queues = [quorum_queue_declared("imports"), Queue("reports")]
    delayed = "1." + "0." * 27
    assert routing.consumed_queue(app, delayed + "imports.jobs") == "imports"
    assert routing.consumed_queue(app, "imports.jobs") == "imports"
    assert routing.consumed_queue(app, "reports") == "reports"
    # Not a key any queue is bound under: the key is the queue's name.
    assert routing.consumed_queue(app, delayed + "elsewhere") == "elsewhere"
    assert routing.consumed_queue(app, "elsewhere") == "elsewhere"


def test_consumed_queue__a_topic_pattern_binds_its_keys__a_worker_of_one_queue_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    app = Celery("consumer", broker=AMQP, set_as_current=False)
    topic = Exchange("jobs", type="topic")
    app.conf.task_queues = [
        Queue("imports", topic, routing_key="imports.#"),
        Queue("reports", topic, routing_key="*.report"),
    ]
    assert routing.consumed_queue(app, "imports.csv.large") == "imports"
    assert routing.consumed_queue(app, "1." + "0." * 27 + "monthly.report") == "reports"
    assert routing.consumed_queue(app, "importsx") == "importsx"  # words, not prefixes
    # A worker that consumes one queue (-Q imports) takes every delivery from it.
    app.amqp.queues.select(["imports"])
    assert routing.consumed_queue(app, "anything.else") == "imports"

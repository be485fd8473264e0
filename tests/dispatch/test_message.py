"""A dispatched job's message is built once, at ``delay()``, as Celery builds a plain
job's, and published as stored when the job is dispatched (issue: publish without
rebuilding)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from celery.signals import before_task_publish
from kombu import Producer

from django_fair_jobs import dispatch, headers
from django_fair_jobs.dispatch.models import DispatchJob
from tests.dispatch.conftest import job_of, set_capacity
from tests.testapp import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("engine", "in_process_worker"),
]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any]]]:
    """What reaches kombu's producer: ``(body, keyword arguments)`` of each publish."""
    out: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(
        "kombu.messaging.Producer.publish", lambda self, body, **kw: out.append((body, kw))
    )
    return out


def test_publish__builds_no_message__sends_the_stored_one(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any, sent: list[Any]
) -> None:
    built: list[str] = []
    create = celery_app.amqp.create_task_message

    def counting(task_id: str, *args: Any, **kwargs: Any) -> Any:
        built.append(task_id)
        return create(task_id, *args, **kwargs)

    monkeypatch.setattr(celery_app.amqp, "create_task_message", counting)
    set_capacity(0)
    task_id = tasks.dispatched.delay("acme").id
    assert built == [task_id]  # at delay(), as for a plain job
    set_capacity(1)
    assert dispatch.publish(celery_app, dispatch.dispatch("fair")) == 1
    assert built == [task_id]  # and never again
    ((body, publish),) = sent
    assert body[0] == ["acme"]
    assert publish["headers"]["id"] == task_id
    assert publish["headers"][headers.TENANT] == "acme"
    assert publish["headers"][headers.DISPATCH] == job_of(task_id).pk
    assert publish["routing_key"] == "fair"


def test_publish_signals__sent_at_delay_with_the_stored_headers(
    celery_app: Any, sent: list[Any]
) -> None:
    seen: list[dict[str, Any]] = []

    def receiver(sender: str, headers: dict[str, Any], **kwargs: Any) -> None:
        headers["traced"] = "at-delay"  # as a tracing library adds its context
        seen.append(dict(headers))

    before_task_publish.connect(receiver, weak=False)
    try:
        set_capacity(0)
        task_id = tasks.dispatched.delay("acme").id
        assert [h["id"] for h in seen] == [task_id]
        set_capacity(1)
        dispatch.publish(celery_app, dispatch.dispatch("fair"))
    finally:
        before_task_publish.disconnect(receiver)
    assert len(seen) == 1  # not sent again at the publish
    ((_, publish),) = sent
    assert publish["headers"]["traced"] == "at-delay"  # what the receiver added is kept


def _waiting_until(expires: str) -> None:
    """A job stored with ``expires=60``, its message's expiry then set to ``expires`` (ISO
    8601), as if it had waited in its line; the queue has no room for it yet."""
    set_capacity(0)
    row = job_of(tasks.dispatched.apply_async(("acme",), expires=60).id)
    stored = json.loads(row.message)
    stored["headers"]["expires"] = expires
    row.message = json.dumps(stored)
    row.save(update_fields=["message"])


def test_expires__the_brokers_time_to_live_counts_from_the_publish(
    celery_app: Any, sent: list[Any]
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    # The job waited 50 s in its line: 10 s are left of its 60.
    _waiting_until((timezone.now() + timedelta(seconds=10)).isoformat())
    set_capacity(1)
    dispatch.publish(celery_app, dispatch.dispatch("fair"))
    ((_, publish),) = sent
    assert 8 < publish["expiration"] <= 10


def test_expires_passed_while_waiting__a_time_to_live_of_0__never_negative(
    celery_app: Any, sent: list[Any]
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    # The job waited in its line past its expiry: the broker is told to drop it at once
    # (RabbitMQ refuses a negative expiration), and the worker reports it expired.
    _waiting_until((timezone.now() - timedelta(seconds=30)).isoformat())
    set_capacity(1)
    dispatch.publish(celery_app, dispatch.dispatch("fair"))
    ((_, publish),) = sent
    assert publish["expiration"] == 0.0


def test_task_sent_event__sent_when_the_job_is_published(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any, sent: list[Any]
) -> None:
    from celery.events.dispatcher import EventDispatcher

    events: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(
        EventDispatcher,
        "publish",
        lambda self, type, fields, *a, **k: events.append((type, fields)),
    )
    was = celery_app.conf.task_send_sent_event
    celery_app.conf.task_send_sent_event = True
    try:
        set_capacity(0)
        task_id = tasks.dispatched.delay("acme").id
        assert events == []  # nothing is sent while the job waits in its line
        set_capacity(1)
        dispatch.publish(celery_app, dispatch.dispatch("fair"))
    finally:
        celery_app.conf.task_send_sent_event = was
    ((kind, fields),) = events
    assert kind == "task-sent"
    assert fields["uuid"] == task_id and fields["queue"] == "fair"


def test_rpc_result_backend__reply_queue_declared_at_delay__replies_to_the_caller(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any, sent: list[Any]
) -> None:
    from celery.backends.rpc import RPCBackend

    # The rpc:// backend declares the caller's reply queue on the producer's channel at
    # every publish; the job's message must name this process as the one to reply to.
    monkeypatch.setattr(celery_app._local, "backend", RPCBackend(app=celery_app), raising=False)
    set_capacity(0)
    task_id = tasks.dispatched.apply_async(("acme",), ignore_result=False).id
    stored = json.loads(job_of(task_id).message)
    assert stored["properties"]["reply_to"] == celery_app.thread_oid
    assert stored["properties"]["correlation_id"] == task_id


def test_a_connection_given_to_delay__nothing_sent_until_the_job_is_dispatched(
    celery_app: Any, sent: list[Any]
) -> None:
    set_capacity(0)
    with celery_app.connection_for_write() as connection:
        task_id = tasks.dispatched.apply_async(("acme",), connection=connection).id
    assert sent == []  # Celery's send_task would have made a producer of it and sent it
    set_capacity(1)
    dispatch.publish(celery_app, dispatch.dispatch("fair"))
    ((_, publish),) = sent
    assert publish["headers"]["id"] == task_id


def test_retry__the_callers_own__else_the_apps_when_the_job_is_sent(
    celery_app: Any, sent: list[Any]
) -> None:
    from celery.app import amqp

    callback = getattr(amqp, "_callback_publish_retry", None)
    set_capacity(0)
    token = callback.set(True) if callback is not None else None
    try:  # as Celery publishes a link or chord callback from a worker (Celery 5.7)
        default = tasks.dispatched.delay("acme").id
    finally:
        if token is not None:
            callback.reset(token)  # type: ignore[union-attr]
    refused = tasks.dispatched.apply_async(("acme",), retry=False).id
    set_capacity(2)
    dispatch.publish(celery_app, dispatch.dispatch("fair"))
    by_id = {kw["headers"]["id"]: kw for _, kw in sent}
    assert by_id[default]["retry"] is celery_app.conf.task_publish_retry
    assert by_id[default]["retry_policy"] == celery_app.conf.task_publish_retry_policy
    assert by_id[refused]["retry"] is False


def test_priority_and_the_callers_properties__published_as_given(
    celery_app: Any, sent: list[Any]
) -> None:
    # What Celery hands its producer beyond the routing (priority, correlation id) is
    # stored at delay() and goes with the publish: a broker that orders by priority sees it.
    set_capacity(0)
    task_id = tasks.dispatched.apply_async(("acme",), priority=7).id
    set_capacity(1)
    dispatch.publish(celery_app, dispatch.dispatch("fair"))
    ((_, publish),) = sent
    assert (publish["priority"], publish["correlation_id"]) == (7, task_id)


def test_retry_policy__the_callers_keys_over_the_apps(celery_app: Any, sent: list[Any]) -> None:
    # As Celery's send_task does: the caller's retry_policy updates the app's, key by key.
    set_capacity(0)
    task_id = tasks.dispatched.apply_async(("acme",), retry_policy={"max_retries": 1}).id
    set_capacity(1)
    dispatch.publish(celery_app, dispatch.dispatch("fair"))
    ((_, publish),) = sent
    assert publish["headers"]["id"] == task_id
    default = celery_app.conf.task_publish_retry_policy
    assert set(default) - {"max_retries"}, default  # keys of the app's that must stay
    assert publish["retry_policy"] == {**default, "max_retries": 1}


def test_expires_written_naive__read_as_utc_whatever_the_machines_zone(
    celery_app: Any, sent: list[Any]
) -> None:
    import time
    from datetime import UTC, datetime, timedelta

    _waiting_until((datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=10)).isoformat())
    zone = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"  # five hours behind UTC
    time.tzset()
    try:
        set_capacity(1)
        dispatch.publish(celery_app, dispatch.dispatch("fair"))
    finally:
        if zone is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = zone
        time.tzset()
    ((_, publish),) = sent
    assert 8 < publish["expiration"] <= 10


def _redis_sends(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Each write to a Redis socket from now on (one per round trip: a pipeline's
    commands go in one), the real write made as well."""
    from redis.connection import AbstractConnection

    sends: list[Any] = []
    real: Any = AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        sends.append(command)
        real(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    return sends


def _in_broker(queue: str = "fair") -> list[int]:
    """The row ids the messages waiting in ``queue`` of the Redis broker name."""
    import redis
    from django.conf import settings

    raw = redis.Redis.from_url(settings.CELERY_BROKER_URL).lrange(queue, 0, -1)
    return sorted(int(json.loads(m)["headers"][headers.DISPATCH]) for m in raw)


@pytest.fixture
def empty_broker() -> None:
    """The Redis broker's ``fair`` queue empty."""
    import redis
    from django.conf import settings

    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete("fair")


BATCHES = hasattr(Producer, "batch")
"""kombu 5.7 batches a producer's publishes on Redis (``Producer.batch``); before it, each
publish is its own round trip."""


@pytest.mark.usefixtures("empty_broker")
def test_jobs_dispatched_together__go_to_redis_in_one_round_trip(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    set_capacity(0)
    for i in range(11):
        tasks.dispatched.delay(f"t{i}")
    set_capacity(1)
    dispatch.publish(celery_app, dispatch.dispatch("fair"))  # the queue declared once
    set_capacity(11)
    ready = dispatch.dispatch("fair")
    assert len(ready) == 10
    sends = _redis_sends(monkeypatch)
    assert dispatch.publish(celery_app, ready) == 10
    assert len(sends) == (1 if BATCHES else 10)
    assert _in_broker() == sorted(DispatchJob.objects.values_list("pk", flat=True))


@pytest.mark.usefixtures("empty_broker")
def test_a_batch_that_fails__nothing_lost__the_first_aside__the_rest_repaired(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    from redis.connection import AbstractConnection
    from redis.exceptions import ConnectionError as RedisConnectionError

    set_capacity(0)
    for i in range(5):
        tasks.dispatched.delay(f"t{i}")
    set_capacity(5)
    ready = dispatch.dispatch("fair")

    def cut(self: Any, command: Any, check_health: bool = True) -> None:
        raise RedisConnectionError("Connection reset by peer")

    with monkeypatch.context() as broken:
        broken.setattr(AbstractConnection, "send_packed_command", cut)
        assert dispatch.publish(celery_app, ready) == 0
    assert _in_broker() == []
    failures = dict(DispatchJob.objects.values_list("pk", "publish_failures"))
    assert len(failures) == 5  # nothing lost
    assert failures[ready[0].job_id] == 1  # aside, for a growing delay
    assert DispatchJob.objects.filter(state=2).count() == 4  # for the lost-message repair


@pytest.mark.usefixtures("empty_broker")
def test_a_queue_not_declared_yet__the_send_declares_it__the_message_kept(
    celery_app: Any,
) -> None:
    """Before any worker has started, Redis has no binding of the queue to its exchange,
    and a message published to that exchange without declaring the queue is dropped (one
    sent to the default exchange, Celery's default route, needs none). Plain Celery
    declares the queue at the publish; so must a dispatched job's, on a connection that
    has not declared it yet."""
    import redis
    from django.conf import settings

    from django_fair_jobs.dispatch import message

    set_capacity(0)
    job = job_of(tasks.dispatched.apply_async(("acme",), exchange="fair", routing_key="fair").id)
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    # A connection of its own, which remembers declaring nothing; the app's pooled ones
    # stay as they are for the tests after this one (closing them breaks their threads).
    with celery_app.connection_for_write() as connection:
        client.delete(
            "_kombu.binding.fair", "_kombu.binding_permanent.fair"
        )  # kombu 5.7 keeps both
        try:
            producer = Producer(connection.default_channel)
            message.send(celery_app, producer, job.message, int(job.pk))
        finally:  # the binding back, whatever the send did
            celery_app.amqp.queues["fair"](connection.default_channel).declare()
    assert _in_broker() == [job.pk]


@pytest.mark.usefixtures("empty_broker")
def test_a_batch_that_cannot_reach_the_broker__past_the_tries__fails_no_job(
    monkeypatch: pytest.MonkeyPatch, celery_app: Any
) -> None:
    """A broker that cannot be reached is not a job's fault: a batch whose connection is
    reset sets its first job aside, whatever its count of failed publishes, and never ends
    it failed, as for a job published alone (an outage longer than the tries)."""
    from redis.connection import AbstractConnection
    from redis.exceptions import ConnectionError as RedisConnectionError

    from django_fair_jobs.dispatch.models import SCHEDULED
    from django_fair_jobs.dispatch.store import PUBLISH_ATTEMPTS

    set_capacity(0)
    for i in range(2):
        tasks.dispatched.delay(f"t{i}")
    DispatchJob.objects.update(publish_failures=PUBLISH_ATTEMPTS)  # the outage's tries so far
    set_capacity(2)
    ready = dispatch.dispatch("fair")
    assert len(ready) == 2
    with celery_app.producer_or_acquire() as producer:
        # Connected and the queue declared, as on a busy node: the reset comes with the
        # pushes themselves.
        producer.maybe_declare(celery_app.amqp.queues["fair"])

    def cut(self: Any, command: Any, check_health: bool = True) -> None:
        raise RedisConnectionError("Connection reset by peer")

    with monkeypatch.context() as broken:
        broken.setattr(AbstractConnection, "send_packed_command", cut)
        assert dispatch.publish(celery_app, ready) == 0
    row = DispatchJob.objects.get(pk=ready[0].job_id)
    assert (row.state, row.publish_failures) == (SCHEDULED, PUBLISH_ATTEMPTS + 1)

"""Why is this job waiting? :func:`explain` answers from the library's rows alone.

A job the library knows about is in exactly one of these places, looked up in this order:

* a lease with a process: **running**, on that worker node, holding a tenant slot, a place
  in a limited queue, or both;
* a lease without a process: **reserved**, woken from parking and on its way through the
  broker with its slot kept for it;
* a parked row: **parked** behind a tenant slot or a queue limit (or **woken**: re-published,
  its reservation on the way);
* a planned row: **pending** in its tenant's virtual queue, **promoted** to the broker, or
  **failed** (its publish failed too often; never promoted again);
* a dispatch row (fair dispatch): **scheduled** (a countdown or ETA not yet due),
  **waiting** in its tenant's line, **dispatched** (published: in the broker, not started)
  or **running**;
* only decisions: **rerouted** (a rule sent it to a slower queue), or **shadow** (shadow
  mode recorded what a rule would have done);
* the result backend's end state: **finished** (SUCCESS, FAILURE or REVOKED);
* the broker, where it can be read without taking messages (Redis): **queued**, with its
  queue and the messages ahead of it (the oldest :data:`broker.SEARCHED` are searched);
* nothing: **unknown** (in the broker where it cannot be searched or too far back, taken
  by a worker that has not started it, ended without a result, or not a job of ours).

Every age is read on the database clock.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from django_fair_jobs import broker, caps, db, planner
from django_fair_jobs.conf import fair_settings
from django_fair_jobs.planner import store as planner_store
from django_fair_jobs.status import age

logger = logging.getLogger("django_fair_jobs.explanations")

_HOLDERS_SHOWN = 20
"""Holders listed for a parked job; the count is always given in full."""


@dataclass
class Explanation:
    """Where a job is and why: ``state`` (one word), ``summary`` (one sentence), and
    ``details`` and ``decisions`` (JSON-ready) for tools."""

    task_id: str
    state: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The explanation as plain JSON-ready data."""
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"{self.task_id}: {self.state}", f"  {self.summary}"]
        lines += [f"  {key}: {_text(value)}" for key, value in self.details.items()]
        for d in self.decisions:
            shadow = "" if d["enforced"] else " (shadow mode: not done)"
            lines.append(f"  decision at {d['at']}: {d['mechanism']} {d['action']}{shadow}"
                         f" {_text(d['detail'])}")  # fmt: skip
        return "\n".join(lines)


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "; ".join(_text(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items())
    return "-" if value is None else str(value)


def explain(task_id: str) -> Explanation:
    """Say where job ``task_id`` is and why it has not started (or what it holds while it
    runs), from the library's rows: leases, parked jobs, virtual queues and recorded
    decisions. Read-only; a few indexed queries."""
    from django_fair_jobs.dispatch.models import DispatchJob
    from django_fair_jobs.models import JobDecision, ParkedJob, PlannedJob, SlotLease

    task_id = str(task_id)
    now = db.database_now()
    decisions = [
        {"at": d.at.isoformat(), "mechanism": d.mechanism, "action": d.action,
         "enforced": d.enforced, "queue": d.queue, "tenant": d.tenant or None,
         "detail": d.detail}
        for d in JobDecision.objects.filter(task_id=task_id).order_by("at", "pk")
    ]  # fmt: skip
    leases = list(SlotLease.objects.filter(task_id=task_id).select_related("slot", "queue_limit"))
    if leases:
        found = _leased(task_id, leases, now)
    elif (parked := ParkedJob.objects.filter(task_id=task_id).first()) is not None:
        found = _parked(parked, now)
    elif (planned := PlannedJob.objects.filter(task_id=task_id).first()) is not None:
        found = _planned(planned, now)
    elif (job := DispatchJob.objects.filter(task_id=task_id).order_by("-pk").first()) is not None:
        found = _dispatched(job, now)
    else:
        found = _undecided(task_id, decisions)
    found.decisions = decisions
    return found


def _holding(lease: Any) -> list[dict[str, Any]]:
    held: list[dict[str, Any]] = []
    if lease.slot is not None:
        slot = lease.slot
        held.append({"tenant_slot": f"{slot.tenant} on {slot.queue}", "running":
                     slot.current_jobs, "limit": slot.effective_max_jobs})  # fmt: skip
    if lease.queue_limit is not None:
        q = lease.queue_limit
        held.append({"queue": q.queue, "running": q.current_jobs, "max_jobs": q.max_jobs,
                     "max_jobs_per_worker": q.max_jobs_per_worker})  # fmt: skip
    return held


def _leased(task_id: str, leases: list[Any], now: datetime) -> Explanation:
    from django_fair_jobs.models import WorkerProcess

    lease = leases[0]
    held = [h for one in leases for h in _holding(one)]
    if lease.process_id is None:
        return Explanation(
            task_id, "reserved",
            "Woken from parking: its slots are reserved for it and it was re-published; "
            "it starts when a worker takes it from the broker.",
            {"reserved_since": lease.acquired_at.isoformat(),
             "reserved_seconds": age(now, lease.acquired_at), "holding": held},
        )  # fmt: skip
    process = WorkerProcess.objects.filter(pk=lease.process_id).first()
    details: dict[str, Any] = {
        "node": None if process is None else process.node,
        "hostname": None if process is None else process.hostname,
        "pid": None if process is None else process.pid,
        "since": lease.acquired_at.isoformat(),
        "running_seconds": age(now, lease.acquired_at),
        "holding": held,
    }
    beat_age = None if process is None else age(now, process.last_heartbeat_at)
    details["last_heartbeat_seconds"] = beat_age
    where = "an unknown worker" if process is None else process.node
    summary = f"Running on {where} since {lease.acquired_at:%Y-%m-%d %H:%M:%S}."
    if process is None or (beat_age or 0) > fair_settings.WORKER_TIMEOUT:
        summary += (
            " Its worker has not sent a heartbeat within FAIR_JOBS_WORKER_TIMEOUT: it is "
            "presumed dead, and the next maintenance pass gives its slots back."
        )
    return Explanation(task_id, "running", summary, details)


def _parked(parked: Any, now: datetime) -> Explanation:
    from django_fair_jobs.models import ParkedJob, SlotLease

    details: dict[str, Any] = {
        "task": parked.task_name,
        "parked_since": parked.parked_at.isoformat(),
        "waiting_seconds": age(now, parked.parked_at),
    }
    if parked.woken_at is not None:
        details["woken_at"] = parked.woken_at.isoformat()
        return Explanation(
            parked.task_id, "woken",
            "Woken: re-published when a place freed; it starts when a worker takes it from "
            "the broker (a lost copy goes back in line after FAIR_JOBS_WORKER_TIMEOUT).",
            details,
        )  # fmt: skip
    reasons = []
    for kind, row in (("tenant slot", parked.slot), ("queue", parked.queue_limit)):
        if row is None:
            continue
        # A parked job waits for its own limit (the one it brought), whatever task last
        # touched the row; in a queue's line, its tenant slot is a reason only when full.
        limit = row.max_jobs if row.max_jobs is not None else parked.default_max_jobs
        if kind == "tenant slot" and parked.queue_limit is not None and row.current_jobs < limit:
            continue
        line = ParkedJob.objects.filter(woken_at__isnull=True, pk__lt=parked.pk)
        line = line.filter(slot=row) if kind == "tenant slot" else line.filter(queue_limit=row)
        holders = SlotLease.objects.filter(**{"slot" if kind == "tenant slot" else
                                              "queue_limit": row})  # fmt: skip
        entry: dict[str, Any] = {
            "position": _place(line),
            "held_by": list(holders.values_list("task_id", flat=True)[:_HOLDERS_SHOWN]),
            "running": row.current_jobs,
        }
        if kind == "tenant slot":
            entry.update(tenant=row.tenant, queue=row.queue, limit=limit)
            if row.boost_until is not None:
                entry["boosted_until"] = row.boost_until.isoformat()
            why = (f"tenant {row.tenant!r} is paused on {row.queue} (limit 0)" if limit == 0
                   else f"tenant {row.tenant!r} runs {row.current_jobs} of its limit {limit} "
                   f"on {row.queue}")  # fmt: skip
        else:
            entry.update(queue=row.queue, max_jobs=row.max_jobs,
                         max_jobs_per_worker=row.max_jobs_per_worker)  # fmt: skip
            paused = row.max_jobs == 0 or row.max_jobs_per_worker == 0
            why = (f"queue {row.queue} is paused (limit 0)" if paused else
                   f"queue {row.queue} is at a limit ({row.current_jobs} running, max_jobs "
                   f"{row.max_jobs}, max_jobs_per_worker {row.max_jobs_per_worker})")  # fmt: skip
        entry["reason"] = why
        details["tenant_slot" if kind == "tenant slot" else "queue_limit"] = entry
        reasons.append(f"{why}; it is number {entry['position']} in line")
    summary = "Parked: " + "; and ".join(reasons) + ". It is re-published when a slot frees."
    return Explanation(parked.task_id, "parked", summary, details)


def _planner_details(
    planned: Any, details: dict[str, Any]
) -> tuple[Any, float | None, float | None, bool]:
    """Add the planner's side of a pending planned job to ``details`` (its tenant's weight,
    the last run, the queue's latency and backpressure); returns its task (None if not
    registered here), the queue's latency, the plan's threshold and whether it holds back."""
    from django_fair_jobs.models import PlannerRun

    task = next((t for t in planner.planned_tasks() if t.name == planned.task_name), None)
    plan = None if task is None else planner.parse_plan(getattr(task, "fair_plan", None) or {})
    weight: Any = None
    if plan is not None:
        try:
            weight = planner.weights(plan, [planned.tenant]).get(planned.tenant, 0.0)
        except Exception as exc:  # the user's callable: report, never fail explain
            weight = f"tenant_weights failed: {exc.__class__.__name__}: {exc}"
    details["tenant_weight"] = weight
    run = PlannerRun.objects.filter(task_name=planned.task_name).first()
    latency, depth = planner_store.latency(
        planned.task_name, stale_after=None if plan is None else planner.stale_after(plan)
    )
    threshold = None if plan is None else plan.latency_threshold
    backpressure = latency is not None and threshold is not None and latency > threshold
    details.update(
        last_run_at=None if run is None or run.last_run_at is None else run.last_run_at.isoformat(),
        next_run_at=None if run is None else run.next_run_at.isoformat(),
        last_promoted=None if run is None else run.last_promoted,
        last_skipped_for_backpressure=bool(run and run.last_skipped),
        queue_latency_seconds=None if latency is None else round(latency, 1),
        promoted_not_started=depth,
        latency_threshold=threshold,
        backpressure=backpressure,
    )  # fmt: skip
    return task, latency, threshold, backpressure


def _planned(planned: Any, now: datetime) -> Explanation:
    from django_fair_jobs.models import PlannedJob, PlannerTenant

    details: dict[str, Any] = {
        "task": planned.task_name,
        "tenant": planned.tenant,
        "queue": planned.queue,
        "enqueued_at": planned.enqueued_at.isoformat(),
        "waiting_seconds": age(now, planned.enqueued_at),
    }
    if planned.attempts:
        details["failed_publishes"] = planned.attempts
        details["last_error"] = planned.last_error
    if planned.failed_at is not None:
        details["failed_at"] = planned.failed_at.isoformat()
        return Explanation(
            planned.task_id, "failed",
            f"The planner failed to publish it {planned.attempts} times and will not try "
            f"again: {planned.last_error}. Remove the cause, then put it back in line in the "
            "admin (planned jobs, failed), or cancel it with its tenant's waiting jobs of "
            f"that task (manage.py fair_jobs_cancel --task {shlex.quote(planned.task_name)} -- "
            f"{shlex.quote(planned.tenant)}).",
            details,
        )  # fmt: skip
    if planned.promoted_at is not None:
        details["promoted_at"] = planned.promoted_at.isoformat()
        return Explanation(
            planned.task_id, "promoted",
            f"Promoted by the planner to {planned.queue}; it starts when a worker takes it "
            "from the broker.",
            details,
        )  # fmt: skip
    details["position_in_tenant_queue"] = _place(PlannedJob.objects.filter(
        task_name=planned.task_name, tenant=planned.tenant, promoted_at__isnull=True,
        failed_at__isnull=True, pk__lt=planned.pk,
    ))  # fmt: skip
    standing = PlannerTenant.objects.filter(
        task_name=planned.task_name, tenant=planned.tenant
    ).first()
    details["tenant_paused"] = bool(standing and standing.paused)
    task, latency, threshold, backpressure = _planner_details(planned, details)
    if not_before := planned.not_before:
        details["not_before"] = not_before.isoformat()
    whose = (f"tenant {planned.tenant!r}'s virtual queue" if planned.tenant
             else "the virtual queue of the jobs without a tenant")  # fmt: skip
    summary = (f"Pending in {whose} of {planned.task_name}, "
               f"number {details['position_in_tenant_queue']}.")  # fmt: skip
    if details["tenant_paused"]:
        summary += " The tenant's promotion is paused in the admin."
    if backpressure:
        summary += (f" The planner holds back: the queue's oldest promoted job waits "
                    f"{latency:.0f} s, above the {threshold:g} s threshold.")  # fmt: skip
    if planned.attempts:
        summary += (f" Its publish failed {planned.attempts} time(s) (of "
                    f"{planner.PUBLISH_ATTEMPTS}): {planned.last_error}")  # fmt: skip
    if task is None:
        summary += " No planned task of that name is registered in this process."
    return Explanation(planned.task_id, "pending", summary, details)


AHEAD_COUNTED = 1000
"""Jobs counted ahead of a waiting job in its line (parked, planned or dispatched); past
this, the answer is "more than 1000", so that explain costs the same wherever the job is
in its line."""


def _ahead(rows: Any) -> int | str:
    """How many of ``rows`` (the jobs ahead) there are, counted up to :data:`AHEAD_COUNTED`."""
    # One row past the bound tells "exactly AHEAD_COUNTED" from "more".
    count = len(rows.values("pk")[: AHEAD_COUNTED + 1])
    return count if count <= AHEAD_COUNTED else f"more than {AHEAD_COUNTED}"


def _place(ahead: Any) -> int | str:
    """The place in line behind ``ahead`` (1: first), or "more than N" past the count."""
    n = _ahead(ahead)
    return n + 1 if isinstance(n, int) else n


def _dispatched(job: Any, now: datetime) -> Explanation:
    from django_fair_jobs import dispatch
    from django_fair_jobs.dispatch.models import (
        DISPATCHED,
        FAILED,
        RUNNING,
        SCHEDULED,
        DispatchJob,
        DispatchQueue,
        DispatchTenant,
    )

    line = DispatchTenant.objects.filter(queue=job.queue, tenant=job.tenant).first()
    queue = DispatchQueue.objects.filter(queue=job.queue).first()
    flight = DispatchJob.objects.filter(queue=job.queue, state__in=[DISPATCHED, RUNNING])
    read = None if line is None else caps.Line(line.cap, line.in_flight)
    cap = caps.of_line(job.tenant, job.queue, read)
    details: dict[str, Any] = {
        "queue": job.queue,
        "tenant": job.tenant,
        "task": job.task_name,
        "enqueued_at": job.enqueued_at.isoformat(),
        "waited_seconds": age(now, job.enqueued_at),
        "tenant_in_flight": None if line is None else line.in_flight,
        "tenant_cap": cap.limit,
        "tenant_cap_source": cap.source,
        "queue_in_flight": flight.count(),
        "queue_capacity": None if queue is None else queue.capacity,
        "queue_slack": None if queue is None else queue.slack,
        "queue_room": dispatch.room().get(job.queue, 0),
        "queue_paused": cap.queue_paused,
        "publish_failures": job.publish_failures,
        "failure": job.failure,
    }
    details["held_by"] = cap.holds() or caps.queue_held_by(
        job.queue, 0 if queue is None else queue.capacity, 0 if queue is None else queue.slack,
        details["queue_in_flight"], details["queue_room"], cap.queue_max_jobs,
    )  # fmt: skip
    if job.state == FAILED:
        return Explanation(job.task_id, "failed", _failed(job), details)
    if job.state == RUNNING:
        return _dispatched_running(job, now, details)
    if job.state == DISPATCHED:
        return _dispatched_in_broker(job, now, details)
    if job.state == SCHEDULED:
        details["due_at"] = job.not_before.isoformat() if job.not_before else None
        summary = (
            f"Its countdown or ETA is not due yet (due {details['due_at']}); then it waits "
            f"in {_line_of(job.tenant)} on {job.queue}."
            if job.not_before is not None and job.not_before > now
            else f"Due: it joins {_line_of(job.tenant)} on {job.queue} at the queue's next "
            "dispatch (a job's end, the due poll, or the maintenance pass)."
        )
        return Explanation(job.task_id, "scheduled", summary, details)
    return _dispatch_waiting(job, line, queue, details)


def _failed(job: Any) -> str:
    """Why a dispatched job ended failed, as its row's ``failure`` records: its publish
    failed ``PUBLISH_ATTEMPTS`` times, or a worker that received it had no task of that
    name registered."""
    if job.failure != "unregistered":
        cause = (
            f"Its message could not be published {job.publish_failures} times (a broker or "
            "serializer that refuses it)"
        )
    else:
        cause = (
            f"The worker that received it had no task of that name ({job.task_name}) "
            "registered (a worker older than its publisher), and Celery rejected it"
        )
    return (
        f"{cause}: it will not run. Fix the cause, then put it back in its line (the "
        "admin's action 'Put the selected failed jobs back in line' on fair dispatch's jobs), "
        "or cancel it (the admin's action 'Cancel the selected failed jobs' there)."
    )


def _dispatched_running(job: Any, now: datetime, details: dict[str, Any]) -> Explanation:
    """A fair-dispatch job a worker process has started: where, and for how long."""
    from django_fair_jobs.models import WorkerProcess

    process = WorkerProcess.objects.filter(pk=job.process_id).first()
    where = "an unknown worker" if process is None else process.node
    details["node"] = None if process is None else process.node
    details["running_seconds"] = age(now, job.started_at) if job.started_at else None
    return Explanation(job.task_id, "running", f"Running on {where} (fair dispatch).", details)


def _dispatched_in_broker(job: Any, now: datetime, details: dict[str, Any]) -> Explanation:
    """A fair-dispatch job published to its queue and not started yet."""
    details["dispatched_seconds"] = age(now, job.dispatched_at) if job.dispatched_at else None
    summary = (
        f"In the broker: dispatched to queue {job.queue} "
        f"{details['dispatched_seconds']} s ago and not started yet; it is among the "
        "jobs that fill the queue's free worker processes, so it starts when one takes it."
    )
    if (details["dispatched_seconds"] or 0) > fair_settings.DISPATCH_LOST_AFTER:
        summary += (
            " It has waited longer than FAIR_JOBS_DISPATCH_LOST_AFTER: if its message was "
            "lost (a purged queue), the next maintenance pass publishes it again."
        )
    return Explanation(job.task_id, "dispatched", summary, details)


def _dispatch_waiting(job: Any, line: Any, queue: Any, details: dict[str, Any]) -> Explanation:
    """A fair-dispatch job in its tenant's line: the jobs ahead of it and why it has not
    gone yet (tenant at its cap, every worker busy, or no worker on the queue)."""
    from django_fair_jobs.dispatch.models import DispatchJob

    details["ahead_in_its_line"] = _ahead(
        DispatchJob.objects.filter(queue=job.queue, tenant=job.tenant, state=job.state,
                                   pk__lt=job.pk)
    )  # fmt: skip
    details["tenant_waiting"] = None if line is None else line.waiting
    cause = (
        details["held_by"]
        or "the next free worker process takes the tenant with the fewest jobs in flight"
    )
    summary = (
        f"Waiting in {_line_of(job.tenant)} on {job.queue} (fair dispatch), "
        f"{details['ahead_in_its_line']} of its tenant's jobs ahead of it; {cause}."
    )
    return Explanation(job.task_id, "waiting", summary, details)


def _line_of(tenant: str) -> str:
    """A tenant's line, in words (fair dispatch's jobs without a tenant share the line
    of the empty tenant)."""
    return f"{tenant}'s line" if tenant else "the line of the jobs without a tenant"


def _undecided(task_id: str, decisions: list[dict[str, Any]]) -> Explanation:
    reroutes = [d for d in decisions if d["mechanism"] == "reroute" and d["enforced"]]
    if reroutes:
        d = reroutes[-1]["detail"]
        return Explanation(
            task_id, "rerouted",
            f"Rerouted to {d.get('to_queue')} by rule {d.get('rule')}: {d.get('count')} "
            f"enqueues in {d.get('per')} s, above {d.get('threshold')}. Nothing holds it "
            "now: it is on the broker, running without a slot, or finished.",
            {**d, **_broker_details(_in_broker(task_id, d.get("to_queue")))},
        )  # fmt: skip
    if decisions:
        return Explanation(
            task_id, "shadow",
            "Shadow mode (FAIR_JOBS_ENFORCE = False) recorded what the rules would have done "
            "to it; nothing was done, and nothing holds it now.",
        )  # fmt: skip
    state = _result_state(task_id)
    if state is not None:
        return Explanation(
            task_id, "finished",
            f"It has ended: the result backend says {state}.", {"result_state": state},
        )  # fmt: skip
    search = _in_broker(task_id)
    if search is not None and search.queue is not None:
        details = {**_broker_details(search), "consumed": _consumed(search.queue)}
        nobody = (
            ""
            if details["consumed"]
            else f" No live worker consumes {search.queue}: start one with -Q {search.queue}."
        )
        return Explanation(
            task_id, "queued",
            f"It waits in the broker on queue {search.queue}, {search.ahead} message(s) "
            "ahead of it: no worker has taken it yet. Tenant slots and queue limits hold a "
            "job back only once a worker takes it." + nobody,
            details,
        )  # fmt: skip
    return Explanation(
        task_id, "unknown",
        "django-fair-jobs holds nothing for this id, and the result backend knows no end of "
        "it: it waits in the broker unheld (tenant slots and queue limits record a job only "
        "once it is held back; fair dispatch records every job until it ends), ended without "
        "a stored result (a job's rows go when it ends: set a result backend to keep its "
        "end), or the id is wrong.",
        _broker_details(search),
    )  # fmt: skip


def _in_broker(task_id: str, first: str | None = None) -> broker.Search | None:
    """Search the broker for ``task_id`` in every queue the app declares or the library's
    rows name (``first`` first), or None if the broker cannot be reached."""
    from celery import current_app

    from django_fair_jobs.dispatch.models import DispatchQueue
    from django_fair_jobs.models import QueueLimit, TenantQueueSlot

    named = [first] if first else []
    named += list(current_app.amqp.queues)
    for model in (TenantQueueSlot, QueueLimit, DispatchQueue):
        named += model.objects.order_by().values_list("queue", flat=True).distinct()
    try:
        return broker.find(current_app, task_id, list(dict.fromkeys(named)))
    except Exception:  # the broker is down or refuses: explain answers from the rows alone
        logger.warning("Could not search the broker for job %s", task_id, exc_info=True)
        return None


def _consumed(queue: str) -> bool:
    """Whether a live worker process (one that beat within ``FAIR_JOBS_WORKER_TIMEOUT``)
    consumes ``queue``, from the queues each process registered."""
    from django_fair_jobs import dispatch

    return queue in dispatch.live_processes()


def _broker_details(search: broker.Search | None) -> dict[str, Any]:
    """What a broker search found, for an explanation's details."""
    if search is None:
        return {"broker": "not reachable"}
    if not search.searchable:
        return {"broker": f"{search.transport}: not searched (it cannot be read without "
                          "taking messages)"}  # fmt: skip
    if search.queue is None and search.read == 0:
        return {"broker": f"no message waits in {', '.join(search.queues) or 'any queue'}"}
    if search.queue is None:
        return {"broker": f"not found in the oldest {search.read} message(s) of "
                          f"{', '.join(search.queues) or 'no queue'}"}  # fmt: skip
    return {"queue": search.queue, "ahead": search.ahead}


def _result_state(task_id: str) -> str | None:
    """The job's end state from the Celery result backend (SUCCESS, FAILURE, REVOKED...),
    or None: not ended, no result backend, or the backend cannot be read."""
    from celery import current_app, states

    try:
        state = str(current_app.AsyncResult(task_id).state)
    except Exception:  # no backend (DisabledBackend raises), or it is down: not an answer
        return None
    return state if state in states.READY_STATES else None

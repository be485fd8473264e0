"""The ideal the benchmark compares against: a max-min fair, work-conserving scheduler.

Deterministic discrete-event simulation. ``concurrency`` workers; a worker never idles while
any job is waiting (work-conserving). Whenever a worker is free, it takes the oldest waiting
job of the backlogged tenant that is running the fewest jobs right now, so at every decision
the workers are shared max-min fairly among the tenants with work. Ties go round-robin: the
tenant dispatched least recently (or never) first, then by name. Jobs are not preempted.

With jobs of equal size this is round-robin between backlogged tenants, the discrete form
of an equal share per tenant: a tenant that floods the queue gets one turn per round, and a
tenant that arrives later is served on the next free worker.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class SimJob:
    """A job to schedule: who, when it arrives, how long it runs (seconds)."""

    id: int
    tenant: str
    arrival: float
    duration: float


@dataclass(frozen=True)
class SimRun:
    """When the ideal scheduler ran a job."""

    id: int
    tenant: str
    arrival: float
    start: float
    end: float


def simulate(jobs: list[SimJob], concurrency: int) -> list[SimRun]:
    """Schedule ``jobs`` on ``concurrency`` workers; one run per job, ordered by start."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if any(j.duration < 0 for j in jobs):
        raise ValueError("job durations must be >= 0")
    arrivals = sorted(jobs, key=lambda j: (j.arrival, j.id))
    waiting: dict[str, deque[SimJob]] = {}
    running: dict[str, int] = {}
    last_turn: dict[str, int] = {}
    busy: list[tuple[float, int, str]] = []  # (end, job id, tenant): a min-heap of workers
    runs: list[SimRun] = []
    turn = 0
    now = 0.0
    i = 0
    while i < len(arrivals) or busy or any(waiting.values()):
        # Completions first: a worker freed at `now` can take a job arriving at `now`.
        while busy and busy[0][0] <= now:
            _, _, tenant = heapq.heappop(busy)
            running[tenant] -= 1
        while i < len(arrivals) and arrivals[i].arrival <= now:
            job = arrivals[i]
            waiting.setdefault(job.tenant, deque()).append(job)
            i += 1
        while len(busy) < concurrency:
            backlogged = [t for t, q in waiting.items() if q]
            if not backlogged:
                break
            tenant = min(backlogged, key=lambda t: (running.get(t, 0), last_turn.get(t, -1), t))
            job = waiting[tenant].popleft()
            end = now + job.duration
            heapq.heappush(busy, (end, job.id, tenant))
            running[tenant] = running.get(tenant, 0) + 1
            last_turn[tenant] = turn
            turn += 1
            runs.append(SimRun(job.id, tenant, job.arrival, now, end))
        next_times = []
        if i < len(arrivals):
            next_times.append(arrivals[i].arrival)
        if busy:
            next_times.append(busy[0][0])
        if not next_times:
            break
        now = max(now, min(next_times))
    return runs

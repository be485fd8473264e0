"""The benchmark's figures, computed from the jobs' own start and end records.

Pure functions on plain data (no Django), so that the tests can check them on synthetic
records and the ideal scheduler's runs go through exactly the same code as real ones.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Record:
    """One execution of one job (a job run twice has two records). Times in seconds."""

    job: int
    tenant: str
    enqueued_at: float
    started_at: float
    finished_at: float
    pid: int | None = None
    """The worker process that ran it (None for the ideal's runs)."""


@dataclass(frozen=True)
class Summary:
    """What the benchmark reports for one mode (or for the ideal)."""

    jobs: int
    completed: int
    lost: int
    run_twice: int
    small_wait_p50: float | None
    small_wait_p95: float | None
    small_wait_max: float | None
    greedy_makespan: float | None
    makespan: float
    throughput: float
    peak_tenant: str | None
    peak_jobs: int
    greedy_peak: int | None
    statements_per_job: float | None
    on_path_per_job: float | None = None
    """Statements per job sent by the worker processes' job threads (the job's path)."""
    commits_per_job: float | None = None
    """The library's durable commits per job, in every process (``bench.statements``)."""
    job_gap_ms: float | None = None
    """The median time, in a worker process, from the end of one job's body to the start of
    the next's, over the jobs already enqueued when the one before ended: what Celery and
    the library spend between two jobs (see :func:`process_gaps`)."""
    shares: dict[str, float] | None = None
    """With weights: each weighted tenant's share of the starts while all were backlogged."""
    share_error: float | None = None
    """With weights: the largest relative gap between a share and its weight's share."""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` by nearest rank (a value that occurred)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def peak_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The largest number of ``(start, end)`` intervals open at once.

    An interval ending at ``t`` and another starting at ``t`` do not overlap.
    """
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def first_runs(records: Iterable[Record]) -> dict[int, Record]:
    """Each job's first execution, by job id."""
    first: dict[int, Record] = {}
    for r in records:
        if r.job not in first or r.started_at < first[r.job].started_at:
            first[r.job] = r
    return first


def shares(records: Iterable[Record], weights: Mapping[str, float]) -> dict[str, float] | None:
    """Each of ``weights``' tenants' share of the jobs started while every one of them was
    backlogged, i.e. before the first of them started its last job (after that, a tenant
    with nothing left cannot take its share). None without weights or starts."""
    starts: dict[str, list[float]] = {t: [] for t in weights}
    for r in first_runs(records).values():
        if r.tenant in starts:
            starts[r.tenant].append(r.started_at)
    if not weights or any(not s for s in starts.values()):
        return None
    end = min(max(s) for s in starts.values())
    counts = {t: sum(1 for x in s if x < end) for t, s in starts.items()}
    total = sum(counts.values())
    if total == 0:
        return None
    return {t: n / total for t, n in counts.items()}


def share_error(observed: Mapping[str, float] | None, weights: Mapping[str, float]) -> float | None:
    """The largest ``|share / fair share - 1|`` over the tenants, where a tenant's fair
    share is its weight over the sum of weights; None if ``observed`` is None."""
    if observed is None:
        return None
    total = sum(weights.values())
    return max(abs(observed[t] / (w / total) - 1) for t, w in weights.items())


def process_gaps(records: Iterable[Record]) -> list[float]:
    """Per worker process, the seconds from the end of one job's body to the start of the
    next job's, for each next job that was enqueued before the one before it ended (so a
    gap is time spent between two jobs, never time the process had nothing to do)."""
    by_pid: dict[int, list[Record]] = {}
    for r in records:
        if r.pid is not None:
            by_pid.setdefault(r.pid, []).append(r)
    gaps = []
    for runs in by_pid.values():
        runs.sort(key=lambda r: r.started_at)
        for before, after in itertools.pairwise(runs):
            if after.enqueued_at <= before.finished_at:
                gaps.append(after.started_at - before.finished_at)
    return gaps


def summarize(
    records: Sequence[Record],
    expected: Iterable[int],
    greedy: frozenset[str],
    origin: float,
    statements: int | None = None,
    weights: Mapping[str, float] | None = None,
    on_path: int | None = None,
    commits: int | None = None,
) -> Summary:
    """Summarize one mode.

    ``expected`` are the job ids that were enqueued; ``greedy`` the greedy tenants (every
    other tenant is small; with none, none is); ``origin`` the time the mode's first job
    was enqueued;
    ``statements`` the statements on the library's tables during the mode, if counted;
    ``weights`` the tenants' weights, if the scenario weighs them; ``on_path`` the
    statements the worker processes sent from the thread that runs the jobs, if counted;
    ``commits`` the library's durable commits, if counted.
    """
    expected_ids = set(expected)
    first = first_runs(records)
    done = set(first) & expected_ids
    counts: dict[int, int] = {}
    for r in records:
        counts[r.job] = counts.get(r.job, 0) + 1
    # Small means "not greedy": where no tenant floods, no tenant is small either.
    small_waits = [
        r.started_at - r.enqueued_at for r in first.values() if greedy and r.tenant not in greedy
    ]
    greedy_ends = [r.finished_at for r in records if r.tenant in greedy]
    ends = [r.finished_at for r in records]
    makespan = (max(ends) - origin) if ends else 0.0
    by_tenant: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        by_tenant.setdefault(r.tenant, []).append((r.started_at, r.finished_at))
    peaks = {t: peak_overlap(iv) for t, iv in by_tenant.items()}
    # On a tie, name the greedy tenant: it is the one a limit is meant to hold back.
    peak_tenant = max(peaks, key=lambda t: (peaks[t], t in greedy, t)) if peaks else None
    greedy_peaks = [peaks[t] for t in greedy if t in peaks]
    gaps = process_gaps(records)
    return Summary(
        jobs=len(expected_ids),
        completed=len(done),
        lost=len(expected_ids - done),
        run_twice=sum(1 for j, n in counts.items() if n > 1),
        small_wait_p50=percentile(small_waits, 50) if small_waits else None,
        small_wait_p95=percentile(small_waits, 95) if small_waits else None,
        small_wait_max=max(small_waits) if small_waits else None,
        greedy_makespan=(max(greedy_ends) - origin) if greedy_ends else None,
        makespan=makespan,
        throughput=(len(done) / makespan) if makespan > 0 else 0.0,
        peak_tenant=peak_tenant,
        peak_jobs=peaks[peak_tenant] if peak_tenant is not None else 0,
        greedy_peak=max(greedy_peaks) if greedy_peaks else None,
        statements_per_job=(statements / len(expected_ids))
        if statements is not None and expected_ids
        else None,
        on_path_per_job=(on_path / len(expected_ids))
        if on_path is not None and expected_ids
        else None,
        commits_per_job=(commits / len(expected_ids))
        if commits is not None and expected_ids
        else None,
        job_gap_ms=statistics.median(gaps) * 1000 if gaps else None,
        shares=shares(records, weights) if weights else None,
        share_error=share_error(shares(records, weights), weights) if weights else None,
    )


RATIO_FLOOR = 0.001
"""A reference below this (a millisecond, a job a second) makes no ratio: the ideal's wait
on a scenario where no tenant waits is a rounding of zero, and a ratio to it says nothing."""


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or None when either is missing or the reference is below
    :data:`RATIO_FLOOR`."""
    if value is None or reference is None or reference < RATIO_FLOOR:
        return None
    return value / reference


def progress(records: Iterable[Record], origin: float) -> dict[str, list[float]]:
    """Per tenant, the sorted completion times (seconds since ``origin``) of its jobs."""
    out: dict[str, list[float]] = {}
    for r in first_runs(records).values():
        out.setdefault(r.tenant, []).append(r.finished_at - origin)
    for times in out.values():
        times.sort()
    return out

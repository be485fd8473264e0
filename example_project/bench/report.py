"""Turn a benchmark's records into its outputs: the ideal, the table, the JSON and the figure."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.metrics import Record, Summary, first_runs, progress, ratio, summarize
from bench.simulate import SimJob, simulate

IDEAL = "ideal"


@dataclass(frozen=True)
class ModeData:
    """One mode's records, as the report needs them."""

    name: str
    description: str
    origin: float
    records: list[Record]
    statements: int | None


def ideal_records(
    modes: list[ModeData], nominal: dict[int, tuple[str, float, float]], concurrency: int
) -> list[Record]:
    """The ideal scheduler's runs for the same jobs, arrivals and measured durations.

    A job's arrival (seconds after its mode's origin) and duration are the medians over the
    modes that ran it; a job no mode ran keeps its planned offset and duration.
    ``nominal`` maps each job id to its planned (tenant, offset, seconds).
    """
    arrivals: dict[int, list[float]] = {}
    durations: dict[int, list[float]] = {}
    for m in modes:
        # A second execution of a job says nothing new about its arrival.
        for r in first_runs(m.records).values():
            arrivals.setdefault(r.job, []).append(r.enqueued_at - m.origin)
            durations.setdefault(r.job, []).append(r.finished_at - r.started_at)
    jobs = [
        SimJob(
            id=job,
            tenant=tenant,
            arrival=statistics.median(arrivals.get(job, [offset])),
            duration=statistics.median(durations.get(job, [seconds])),
        )
        for job, (tenant, offset, seconds) in nominal.items()
    ]
    return [Record(r.id, r.tenant, r.arrival, r.start, r.end) for r in simulate(jobs, concurrency)]


def build(
    modes: list[ModeData],
    nominal: dict[int, tuple[str, float, float]],
    greedy: frozenset[str],
    concurrency: int,
    reference: str,
    recommended: str,
) -> dict[str, Any]:
    """Summaries per mode plus the ideal, and the ratios; JSON-ready."""
    ideal = ideal_records(modes, nominal, concurrency)
    summaries: dict[str, Summary] = {
        IDEAL: summarize(ideal, nominal, greedy, origin=0.0),
    }
    for m in modes:
        summaries[m.name] = summarize(m.records, nominal, greedy, m.origin, m.statements)
    ref = summaries.get(reference)
    out: dict[str, Any] = {}
    for name, s in summaries.items():
        out[name] = {
            **s.as_dict(),
            "small_p95_vs_ideal": ratio(s.small_wait_p95, summaries[IDEAL].small_wait_p95),
            "makespan_vs_plain": ratio(s.makespan, ref.makespan if ref else None),
            "throughput_vs_plain": ratio(s.throughput, ref.throughput if ref else None),
        }
    return {
        "summaries": out,
        "reference": reference,
        "recommended": recommended if recommended in out else None,
        "greedy_tenants": sorted(greedy),
        "progress": {
            IDEAL: progress(ideal, 0.0),
            **{m.name: progress(m.records, m.origin) for m in modes},
        },
        "small_waits": {
            IDEAL: _small_waits(ideal, greedy),
            **{m.name: _small_waits(m.records, greedy) for m in modes},
        },
    }


def _small_waits(records: list[Record], greedy: frozenset[str]) -> list[float]:
    first = first_runs(records).values()
    return sorted(r.started_at - r.enqueued_at for r in first if r.tenant not in greedy)


def _f(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def table(report: dict[str, Any]) -> str:
    """The markdown table of every mode (the ideal first)."""
    lines = [
        "| mode | small wait p50 | p95 | max | p95 / ideal | greedy makespan | makespan "
        "| makespan / plain | jobs/s | jobs/s / plain | most of one tenant at once "
        "| lost | run twice | library statements / job |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["summaries"].items():
        peak = f"{s['peak_jobs']} ({s['peak_tenant']})" if s["peak_tenant"] else "n/a"
        lines.append(
            f"| {name} | {_f(s['small_wait_p50'], ' s')} | {_f(s['small_wait_p95'], ' s')} "
            f"| {_f(s['small_wait_max'], ' s')} | {_f(s['small_p95_vs_ideal'], 'x')} "
            f"| {_f(s['greedy_makespan'], ' s')} | {_f(s['makespan'], ' s')} "
            f"| {_f(s['makespan_vs_plain'], 'x')} | {_f(s['throughput'], '', 0)} "
            f"| {_f(s['throughput_vs_plain'], 'x')} | {peak} "
            f"| {'-' if name == IDEAL else s['lost']} | {'-' if name == IDEAL else s['run_twice']} "
            f"| {'-' if name == IDEAL else _f(s['statements_per_job'], '', 1)} |"
        )
    return "\n".join(lines)


def headline(report: dict[str, Any]) -> str:
    """The ratios that matter, for the recommended mode."""
    name = report["recommended"]
    if name is None:
        return "The recommended mode did not run; no headline."
    s = report["summaries"][name]
    return (
        f"Headline ({name}): small-tenant p95 wait {_f(s['small_p95_vs_ideal'], 'x')} of the "
        f"ideal; makespan {_f(s['makespan_vs_plain'], 'x')} of plain Celery; throughput "
        f"{_f(s['throughput_vs_plain'], 'x')} of plain Celery."
    )


def write_json(report: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    """The whole report, with the run's description, as JSON."""
    path.write_text(json.dumps({**meta, **report}, indent=2, sort_keys=False) + "\n")


def write_figure(report: dict[str, Any], title: str, path: Path) -> None:
    """A PNG: small tenants' wait distribution per mode, then per-tenant progress per mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    names = list(report["summaries"])
    fig, axes = plt.subplots(
        1 + len(names), 1, figsize=(9, 3.2 * (1 + len(names))), constrained_layout=True
    )
    ax = axes[0]
    for name in names:
        waits = report["small_waits"][name]
        if waits:
            ys = [(i + 1) / len(waits) for i in range(len(waits))]
            ax.step(waits, ys, where="post", label=name, linewidth=2 if name == IDEAL else 1.5)
    ax.set_title(f"{title}: small tenants' wait, enqueue to start")
    ax.set_xlabel("wait (s)")
    ax.set_ylabel("fraction of small-tenant jobs")
    ax.legend()
    ax.grid(alpha=0.3)
    end = max((s["makespan"] for s in report["summaries"].values()), default=1.0)
    for ax, name in zip(axes[1:], names, strict=True):
        for tenant, times in sorted(report["progress"][name].items()):
            ys = [(i + 1) / len(times) for i in range(len(times))]
            greedy = tenant in report.get("greedy_tenants", [])
            ax.step(
                [0.0, *times],
                [0.0, *ys],
                where="post",
                color="tab:red" if greedy else "tab:blue",
                alpha=1.0 if greedy else 0.35,
                linewidth=2 if greedy else 1,
                label="greedy tenant" if greedy else None,
            )
        ax.set_xlim(0, end * 1.02)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{name}: each tenant's jobs completed (blue: small tenants)")
        ax.set_xlabel("time since the first enqueue (s)")
        ax.set_ylabel("fraction done")
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=90)
    plt.close(fig)

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
IDEAL_AT_PLAIN = "ideal at plain's speed"
"""The same scheduler with each job lasting its measured time plus plain Celery's gap
between two jobs of a process in the same run: its ratio tells the order from the cost."""
IDEALS = (IDEAL, IDEAL_AT_PLAIN)


@dataclass(frozen=True)
class ModeData:
    """One mode's records, as the report needs them."""

    name: str
    description: str
    origin: float
    records: list[Record]
    statements: int | None
    on_path: int | None = None
    """Of the statements, those the worker processes sent from the thread running the jobs."""
    commits: int | None = None
    """The library's durable commits in every process."""


def ideal_records(
    modes: list[ModeData],
    nominal: dict[int, tuple[str, float, float]],
    concurrency: int,
    overhead: float = 0.0,
) -> list[Record]:
    """The ideal scheduler's runs for the same jobs, arrivals and measured durations, each
    job lasting ``overhead`` seconds more (none for the ideal itself).

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
            duration=statistics.median(durations.get(job, [seconds])) + overhead,
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
    weights: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Summaries per mode plus the ideal, and the ratios; JSON-ready.

    With ``weights``, each mode's summary has the tenants' shares and their largest gap to
    the weights (the ideal's runs are unweighted, so it has none)."""
    ideal = ideal_records(modes, nominal, concurrency)
    summaries: dict[str, Summary] = {
        IDEAL: summarize(ideal, nominal, greedy, origin=0.0),
    }
    for m in modes:
        summaries[m.name] = summarize(
            m.records, nominal, greedy, m.origin, m.statements, weights or None, m.on_path,
            m.commits,
        )  # fmt: skip
    ref = summaries.get(reference)
    at_plain: list[Record] = []
    if ref is not None and ref.job_gap_ms is not None:
        at_plain = ideal_records(modes, nominal, concurrency, overhead=ref.job_gap_ms / 1000)
        summaries = {
            IDEAL: summaries[IDEAL],
            IDEAL_AT_PLAIN: summarize(at_plain, nominal, greedy, origin=0.0),
            **{k: v for k, v in summaries.items() if k != IDEAL},
        }
    paced = summaries.get(IDEAL_AT_PLAIN)
    out: dict[str, Any] = {}
    for name, s in summaries.items():
        out[name] = {
            **s.as_dict(),
            "small_p95_vs_ideal": ratio(s.small_wait_p95, summaries[IDEAL].small_wait_p95),
            "small_p95_vs_ideal_at_plain": ratio(
                s.small_wait_p95, paced.small_wait_p95 if paced else None
            ),
            "makespan_vs_plain": ratio(s.makespan, ref.makespan if ref else None),
            "throughput_vs_plain": ratio(s.throughput, ref.throughput if ref else None),
            "added_ms": None
            if s.job_gap_ms is None or ref is None or ref.job_gap_ms is None
            else s.job_gap_ms - ref.job_gap_ms,
        }
    return {
        "summaries": out,
        "reference": reference,
        "recommended": recommended if recommended in out else None,
        "greedy_tenants": sorted(greedy),
        "weights": weights or {},
        "progress": {
            IDEAL: progress(ideal, 0.0),
            **({IDEAL_AT_PLAIN: progress(at_plain, 0.0)} if at_plain else {}),
            **{m.name: progress(m.records, m.origin) for m in modes},
        },
        "small_waits": {
            IDEAL: _small_waits(ideal, greedy),
            **({IDEAL_AT_PLAIN: _small_waits(at_plain, greedy)} if at_plain else {}),
            **{m.name: _small_waits(m.records, greedy) for m in modes},
        },
    }


def _small_waits(records: list[Record], greedy: frozenset[str]) -> list[float]:
    first = first_runs(records).values()
    return sorted(r.started_at - r.enqueued_at for r in first if r.tenant not in greedy)


def _f(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def _shares(s: dict[str, Any], weights: dict[str, float]) -> str:
    if s.get("shares") is None:
        return "n/a | n/a"
    total = sum(weights.values())
    shares = " / ".join(
        f"{s['shares'][t]:.1%} ({w / total:.0%})" for t, w in sorted(weights.items(), key=_by_w)
    )
    return f"{shares} | {s['share_error']:.1%}"


def _by_w(item: tuple[str, float]) -> tuple[float, str]:
    return item[1], item[0]


def table(report: dict[str, Any]) -> str:
    """The markdown table of every mode (the ideal first); with weights, each mode's shares
    (and, in brackets, the weights' shares) and the largest relative gap between them."""
    weights: dict[str, float] = report.get("weights") or {}
    lines = [
        "| mode | small wait p50 | p95 | max | p95 / ideal | p95 / ideal at plain's speed "
        "| greedy makespan | makespan "
        "| makespan / plain | jobs/s | jobs/s / plain | most of one tenant at once "
        "| lost | run twice | library statements / job | on the job's path "
        "| durable commits / job | gap between jobs in a process "
        "| added to a job |" + (" shares while all backlogged | share gap |" if weights else ""),
        "|---" * (21 if weights else 19) + "|",
    ]
    for name, s in report["summaries"].items():
        peak = f"{s['peak_jobs']} ({s['peak_tenant']})" if s["peak_tenant"] else "n/a"
        lines.append(
            f"| {name} | {_f(s['small_wait_p50'], ' s')} | {_f(s['small_wait_p95'], ' s')} "
            f"| {_f(s['small_wait_max'], ' s')} | {_f(s['small_p95_vs_ideal'], 'x')} "
            f"| {_f(s['small_p95_vs_ideal_at_plain'], 'x')} "
            f"| {_f(s['greedy_makespan'], ' s')} | {_f(s['makespan'], ' s')} "
            f"| {_f(s['makespan_vs_plain'], 'x')} | {_f(s['throughput'], '', 0)} "
            f"| {_f(s['throughput_vs_plain'], 'x')} | {peak} "
            f"| {'-' if name in IDEALS else s['lost']} "
            f"| {'-' if name in IDEALS else s['run_twice']} "
            f"| {'-' if name in IDEALS else _f(s['statements_per_job'], '', 1)} "
            f"| {'-' if name in IDEALS else _f(s['on_path_per_job'], '', 1)} "
            f"| {'-' if name in IDEALS else _f(s['commits_per_job'], '', 1)} "
            f"| {_f(s['job_gap_ms'], ' ms', 1)} | {_f(s['added_ms'], ' ms', 1)} |"
            + (f" {'- | -' if name in IDEALS else _shares(s, weights)} |" if weights else "")
        )
    return "\n".join(lines)


def headline(report: dict[str, Any]) -> str:
    """The ratios that matter, for the recommended mode."""
    name = report["recommended"]
    if name is None:
        return "The recommended mode did not run; no headline."
    s = report["summaries"][name]
    shares = (
        f" Shares within {s['share_error']:.1%} of the weights."
        if s.get("share_error") is not None
        else ""
    )
    wait = (
        f"small-tenant p95 wait {_f(s['small_p95_vs_ideal'], 'x')} of the ideal; "
        if s["small_p95_vs_ideal"] is not None
        else ""
    )
    return (
        f"Headline ({name}): {wait}makespan {_f(s['makespan_vs_plain'], 'x')} of plain "
        f"Celery; throughput {_f(s['throughput_vs_plain'], 'x')} of plain Celery.{shares}"
    )


RATIOS = (
    "small_p95_vs_ideal",
    "small_p95_vs_ideal_at_plain",
    "makespan_vs_plain",
    "throughput_vs_plain",
    "statements_per_job",
    "on_path_per_job",
    "commits_per_job",
    "added_ms",
    "share_error",
)
"""The figures ``--repeat`` reports as median and spread over the runs."""


def aggregate(reports: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode, over several runs' reports: the median, lowest and highest of each of
    :data:`RATIOS` (None where no run has it), and the jobs lost and run twice in all."""
    out: dict[str, dict[str, Any]] = {}
    for name in reports[0]["summaries"]:
        runs = [r["summaries"][name] for r in reports if name in r["summaries"]]
        figures: dict[str, Any] = {"runs": len(runs)}
        for key in RATIOS:
            values = [s[key] for s in runs if s.get(key) is not None]
            figures[key] = (
                {"median": statistics.median(values), "min": min(values), "max": max(values)}
                if values
                else None
            )
        figures["lost"] = sum(s["lost"] for s in runs)
        figures["run_twice"] = sum(s["run_twice"] for s in runs)
        out[name] = figures
    return out


def median_of(figures: dict[str, Any], key: str) -> str:
    """An aggregated figure's median, two decimals, or "n/a"."""
    figure = figures.get(key)
    return "n/a" if figure is None else f"{figure['median']:.2f}"


def _spread(figure: dict[str, float] | None, unit: str, digits: int = 2) -> str:
    if figure is None:
        return "n/a"
    lo, hi = _f(figure["min"], "", digits), _f(figure["max"], "", digits)
    return f"{_f(figure['median'], unit, digits)} ({lo}-{hi})"


def aggregate_table(aggregated: dict[str, dict[str, Any]]) -> str:
    """The markdown table of :func:`aggregate`: each figure's median (lowest-highest)."""
    lines = [
        "| mode | runs | p95 / ideal | p95 / ideal at plain's speed | makespan / plain "
        "| jobs/s / plain | library statements / job | on the job's path "
        "| durable commits / job | added to a job | share gap | lost | run twice |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in aggregated.items():
        gap = a["share_error"]
        lost, twice = ("-", "-") if name in IDEALS else (a["lost"], a["run_twice"])
        lines.append(
            f"| {name} | {a['runs']} | {_spread(a['small_p95_vs_ideal'], 'x')} "
            f"| {_spread(a['small_p95_vs_ideal_at_plain'], 'x')} "
            f"| {_spread(a['makespan_vs_plain'], 'x')} | {_spread(a['throughput_vs_plain'], 'x')} "
            f"| {_spread(a['statements_per_job'], '', 1)} "
            f"| {_spread(a['on_path_per_job'], '', 1)} "
            f"| {_spread(a['commits_per_job'], '', 1)} "
            f"| {_spread(a['added_ms'], ' ms', 1)} "
            f"| {'n/a' if gap is None else _spread({k: v * 100 for k, v in gap.items()}, '%', 1)} "
            f"| {lost} | {twice} |"
        )
    return "\n".join(lines)


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

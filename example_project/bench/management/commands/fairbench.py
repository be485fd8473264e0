"""``manage.py fairbench [SCENARIO]``: plain Celery against each fairness mode, and the ideal.

See docs/benchmarks.md for what each figure means.
"""

from __future__ import annotations

import csv
import os
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import celery
import django
from django.core.management.base import BaseCommand, CommandError, CommandParser

from bench import report, runner
from bench.modes import DEFAULT_MODES, MODES, RECOMMENDED, REFERENCE, Mode
from bench.scenario import Scenario, ScenarioError, builtin_names, load

REPO_DIR = Path(__file__).resolve().parents[4]


class Command(BaseCommand):
    """Run a scenario in every mode through real workers; print, save JSON and a figure."""

    help = (
        "Run a benchmark scenario (flood, steady, overhead, demo, or a .py file) with plain "
        "Celery and each fairness mode, side by side, against a simulated ideal scheduler."
    )

    report: dict[str, Any]
    """The last run's report (see ``bench.report.build``)."""
    tenant_limit: int
    """The tenant slot limit the last run's fair modes used."""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "scenario",
            nargs="?",
            default="flood",
            help=f"A shipped scenario ({', '.join(builtin_names())}) or a .py file defining "
            "SCENARIO (default: flood).",
        )
        parser.add_argument(
            "--modes",
            default=",".join(DEFAULT_MODES),
            help=f"Comma-separated modes to run (default: {','.join(DEFAULT_MODES)}; "
            f"available: {','.join(MODES)}).",
        )
        parser.add_argument(
            "--concurrency", type=int, help="Pool size per worker node (default: the scenario's)."
        )
        parser.add_argument(
            "--nodes", type=int, help="Worker nodes (default: the scenario's, else 1)."
        )
        parser.add_argument(
            "--repeat",
            type=int,
            default=1,
            help="Run every mode this many times and report each figure's median and spread "
            "(default 1).",
        )
        parser.add_argument(
            "--pool",
            default="prefork",
            choices=["prefork", "threads", "solo"],
            help="Celery pool (default prefork).",
        )
        parser.add_argument(
            "--tenant-limit",
            type=int,
            help="Tenant slot limit of the fair modes (default: the scenario's, else half "
            "the total concurrency).",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=600,
            help="Give up on a mode after this many seconds (default 600).",
        )
        parser.add_argument(
            "--db-latency-ms",
            type=float,
            default=0.0,
            help="Put PostgreSQL behind a proxy that delays each packet by this many ms each "
            "way, for every mode, so the run shows what a database across a network costs "
            "(default 0: no proxy).",
        )
        parser.add_argument(
            "--output",
            type=Path,
            default=REPO_DIR / "benchmark-output",
            help="Directory for the JSON, the figure and the worker logs "
            "(default: benchmark-output/ at the repository root).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            scenario = load(options["scenario"])
        except ScenarioError as exc:
            raise CommandError(str(exc)) from exc
        modes = self._modes(options["modes"])
        concurrency = options["concurrency"] or scenario.concurrency
        nodes = options["nodes"] or scenario.nodes
        if concurrency < 1 or nodes < 1 or options["repeat"] < 1:
            raise CommandError("--concurrency, --nodes and --repeat must be at least 1.")
        limit = options["tenant_limit"] or scenario.limit_for(concurrency * nodes)
        if limit < 1:
            raise CommandError("--tenant-limit must be at least 1.")
        self.tenant_limit = limit
        self.report = self.run_benchmark(scenario, modes, concurrency, nodes, limit, options)

    def _modes(self, value: str) -> list[Mode]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODES]
        if unknown or not names:
            raise CommandError(
                f"Unknown mode(s) {', '.join(unknown) or '(none given)'}; "
                f"available: {', '.join(MODES)}."
            )
        return [MODES[n] for n in dict.fromkeys(names)]

    def run_benchmark(
        self,
        scenario: Scenario,
        modes: list[Mode],
        concurrency: int,
        nodes: int,
        limit: int,
        options: dict[str, Any],
    ) -> dict[str, Any]:
        """Run, print the table, write the files; return the report."""
        try:
            runner.check_services()
        except runner.BenchError as exc:
            raise CommandError(str(exc)) from exc
        runner.prepare_database()
        out_dir: Path = options["output"]
        log_dir = out_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        database, broker = runner.describe_database(), runner.describe_broker()
        self.stdout.write(f"Scenario {scenario.name}: {scenario.description}")
        # Plain Celery and fair dispatch take no tenant limit: say it only when a mode does.
        limited = any(mode.name not in ("plain", "dispatch") for mode in modes)
        self.stdout.write(
            f"{len(scenario.jobs)} jobs; {nodes} worker node(s) x {concurrency} "
            f"({options['pool']} pool)"
            + (f"; tenant limit of the modes that take one: {limit}." if limited else ".")
        )
        latency = options["db_latency_ms"]
        if latency < 0 or (latency and not database.startswith("postgresql")):
            raise CommandError("--db-latency-ms takes a number of ms >= 0, on PostgreSQL only.")
        if latency:
            database += f", behind a proxy adding {latency:g} ms each way"
        self.stdout.write(f"Database: {database}. Broker: {broker}.")
        repeat: int = options["repeat"]
        reports: list[dict[str, Any]] = []
        problems: list[str] = []
        job_rows: list[tuple[Any, ...]] = []
        for i in range(repeat):
            if repeat > 1:
                self.stdout.write(f"Run {i + 1} of {repeat}")
            with runner.database_latency(options["db_latency_ms"]):
                built, results = self._run_once(
                    scenario, modes, concurrency, nodes, limit, options, log_dir
                )
            reports.append(built)
            problems += self._problems(built, results)
            job_rows += _job_rows(i + 1, results)
            if repeat > 1:
                self.stdout.write(report.table(built))
                self.stdout.write("")
        meta: dict[str, Any] = {
            "scenario": {
                "name": scenario.name,
                "description": scenario.description,
                "jobs": len(scenario.jobs),
                "nodes": nodes,
                "concurrency": concurrency,
                "pool": options["pool"],
                "tenant_limit": limit,
            },
            "environment": {
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "database": database,
                "db_latency_ms": options["db_latency_ms"],
                "broker": broker,
                "python": platform.python_version(),
                "django": django.get_version(),
                "celery": celery.__version__,
                "machine": f"{platform.machine()}, {os.cpu_count() or 1} CPUs",
            },
            "modes": {
                r.mode.name: {
                    "description": r.mode.description,
                    "publisher_statements": r.publisher_statements,
                    "leftover": r.leftover,
                    "notes": r.notes,
                }
                for r in results
            },
        }
        jobs_path = out_dir / f"{scenario.name}-jobs.csv"
        _write_jobs(jobs_path, job_rows)
        json_path = out_dir / f"{scenario.name}.json"
        png_path = out_dir / f"{scenario.name}.png"
        aggregated = report.aggregate(reports)
        if repeat > 1:
            # The last run's report in full, each run's summaries, and the medians.
            meta["runs"] = [r["summaries"] for r in reports]
            meta["aggregate"] = aggregated
        report.write_json(built, meta, json_path)
        report.write_figure(built, scenario.name, png_path)
        self.stdout.write("")
        if repeat > 1:
            self.stdout.write(f"Median (lowest-highest) of {repeat} runs:")
            self.stdout.write(report.aggregate_table(aggregated))
        else:
            self.stdout.write(report.table(built))
        self.stdout.write("")
        self.stdout.write(report.headline(built) if repeat == 1 else _median_headline(aggregated))
        for p in problems:
            self.stderr.write(f"PROBLEM: {p}")
        self.stdout.write(f"Results: {json_path}")
        self.stdout.write(f"Figure:  {png_path}")
        self.stdout.write(f"Jobs:    {jobs_path}")
        if problems:
            raise CommandError("The benchmark found problems (above).")
        return built

    def _run_once(
        self,
        scenario: Scenario,
        modes: list[Mode],
        concurrency: int,
        nodes: int,
        limit: int,
        options: dict[str, Any],
        log_dir: Path,
    ) -> tuple[dict[str, Any], list[runner.ModeResult]]:
        """Run every mode once; return the report and each mode's result."""
        run = runner.new_run_id()
        results: list[runner.ModeResult] = []
        self._shown = -1
        try:
            for mode in modes:
                self._shown = -1
                results.append(
                    runner.run_mode(
                        mode,
                        scenario,
                        run=run,
                        nodes=nodes,
                        concurrency=concurrency,
                        pool=options["pool"],
                        tenant_limit=limit,
                        timeout=options["timeout"],
                        log_dir=log_dir,
                        progress=self._progress,
                    )
                )
        except runner.BenchError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            runner.cleanup(run)
        nominal = {j.id: (j.tenant, j.offset, j.seconds) for j in scenario.jobs}
        data = [
            report.ModeData(
                r.mode.name,
                r.mode.description,
                r.origin,
                r.records,
                r.statements,
                on_path=r.on_path,
                commits=r.commits,
            )
            for r in results
        ]
        built = report.build(
            data,
            nominal,
            scenario.greedy_tenants,
            concurrency * nodes,
            REFERENCE,
            RECOMMENDED,
            scenario.weights,
        )
        return built, results

    def _problems(self, built: dict[str, Any], results: list[runner.ModeResult]) -> list[str]:
        problems = []
        for r in results:
            s = built["summaries"][r.mode.name]
            if s["lost"] or s["run_twice"]:
                problems.append(f"{r.mode.name}: {s['lost']} lost, {s['run_twice']} run twice")
            left = {k: v for k, v in r.leftover.items() if v}
            if left:
                problems.append(f"{r.mode.name}: library rows left over: {left}")
            problems.extend(f"{r.mode.name}: {n}" for n in r.notes if "gave up" in n)
        return problems

    def _progress(self, mode: Mode, done: int, total: int, elapsed: float) -> None:
        tty = self.stdout.isatty()
        step = done * 4 // max(total, 1)
        # A live bar on a terminal; a line per quarter when the output is a log.
        if not tty and step == self._shown:
            return
        self._shown = step
        bar = "#" * (30 * done // max(total, 1))
        line = f"  {mode.name:8} [{bar:30}] {done}/{total} jobs {elapsed:6.1f} s"
        if tty:
            self.stdout.write("\r" + line, ending="\n" if done >= total else "")
            self.stdout.flush()
        else:
            self.stdout.write(line)


JOB_COLUMNS = ("run", "mode", "job", "tenant", "enqueued", "started", "finished", "pid")
"""The columns of ``SCENARIO-jobs.csv``: one row per execution of a job (a job run twice has
two), its times in seconds from its mode's origin (when the mode's publishing began)."""


def _job_rows(run: int, results: list[runner.ModeResult]) -> list[tuple[Any, ...]]:
    """Every execution of every job of one run, for ``SCENARIO-jobs.csv``."""
    return [
        (run, r.mode.name, rec.job, rec.tenant, round(rec.enqueued_at - r.origin, 6),
         round(rec.started_at - r.origin, 6), round(rec.finished_at - r.origin, 6), rec.pid)
        for r in results
        for rec in sorted(r.records, key=lambda rec: rec.started_at)
    ]  # fmt: skip


def _write_jobs(path: Path, rows: list[tuple[Any, ...]]) -> None:
    """Write ``rows`` (see :data:`JOB_COLUMNS`) to ``path`` as CSV, with a header."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(JOB_COLUMNS)
        writer.writerows(rows)


def _median_headline(aggregated: dict[str, dict[str, Any]]) -> str:
    """The headline of several runs: the recommended mode's medians."""
    a = aggregated.get(RECOMMENDED)
    if a is None:
        return "The recommended mode did not run; no headline."
    parts = [
        f"makespan {report.median_of(a, 'makespan_vs_plain')}x of plain Celery",
        f"throughput {report.median_of(a, 'throughput_vs_plain')}x of plain Celery",
    ]
    if a["small_p95_vs_ideal"] is not None:  # a scenario with small tenants
        parts.insert(
            0, f"small-tenant p95 wait {report.median_of(a, 'small_p95_vs_ideal')}x of the ideal"
        )
    if a["share_error"] is not None:
        parts.append(f"shares within {a['share_error']['median']:.1%} of the weights")
    return f"Headline ({RECOMMENDED}, median of {a['runs']} runs): " + "; ".join(parts) + "."

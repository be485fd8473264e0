"""The example project's commands run against the library as shipped."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from tests.conftest import ROOT, database_url

pytestmark = pytest.mark.django_db(transaction=True)


def run_manage(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DEMO_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "example.settings",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "example_project/manage.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_bench_slots__measures_and_leaves_counters_at_zero(tmp_path: Path) -> None:
    result = run_manage(tmp_path, "bench_slots", "--seconds", "1", "--clients", "2")
    if connection.vendor != "postgresql":
        # It measures PostgreSQL against pgbench; elsewhere it must say so, not crash.
        assert result.returncode != 0
        assert "needs PostgreSQL" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| acquire, slot free | 1 |" in result.stdout
    assert "| release, nobody parked | 1 |" in result.stdout
    assert "Slot counter after the run: 0 (must be 0)." in result.stdout


TINY = """
from bench.scenario import Scenario, Stream, tenants

SCENARIO = Scenario(
    name="tiny",
    description="a greedy tenant and three small ones",
    concurrency=2,
    streams=(
        Stream(tenants=("greedy",), jobs=12, seconds=0.05, greedy=True),
        Stream(tenants=tenants("small", 3), jobs=2, seconds=0.05, at=0.2),
    ),
)
"""


MODES = ("plain", "slots", "reroute", "queue-limits", "planner", "dispatch", "combined")


def processes_of_run(tmp_path: Path) -> list[int]:
    """The processes still alive that a command run by :func:`run_manage` in ``tmp_path``
    started (their environment carries its ``DEMO_DIR``), whatever else runs on the machine
    (another run of the suite, or a benchmark)."""
    mine = f"DEMO_DIR={tmp_path}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if mine in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@pytest.mark.workers
def test_fairbench__runs_every_mode_through_real_workers_and_cleans_up(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.py"
    scenario.write_text(TINY)
    out = tmp_path / "out"
    result = run_manage(tmp_path, "fairbench", str(scenario), "--output", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for mode in MODES:
        assert f"| {mode} |" in result.stdout
    assert "Headline (dispatch): small-tenant p95 wait" in result.stdout
    report = json.loads((out / "tiny.json").read_text())
    assert report["scenario"]["tenant_limit"] == 1  # half of 1 node x 2
    for mode in MODES:
        s = report["summaries"][mode]
        assert (s["jobs"], s["completed"], s["lost"], s["run_twice"]) == (18, 18, 0, 0)
        assert report["modes"][mode]["leftover"] == {
            "leases": 0, "parked": 0, "parked_rows": 0, "slot_jobs": 0, "queue_jobs": 0,
            "planned": 0, "dispatch_rows": 0, "dispatch_in_flight": 0,
        }  # fmt: skip
    # The limit held, by the jobs' own records. Plain Celery jobs send no library statement:
    # what plain workers count is every process's heartbeat and maintenance.
    assert report["summaries"]["slots"]["peak_jobs"] == 1
    per_job = {mode: s["statements_per_job"] for mode, s in report["summaries"].items()}
    assert per_job["slots"] - per_job["plain"] >= 2  # acquire + release
    assert per_job["reroute"] - per_job["plain"] >= 1  # one count per publish
    assert (out / "tiny.png").read_bytes()[:4] == b"\x89PNG"
    # Nothing left behind: records, library rows, worker processes.
    with connection.cursor() as cursor:
        for table in ("bench_jobrecord", "bench_statementcount", "fair_jobs_slotlease"):
            cursor.execute(f"SELECT COUNT(*) FROM {table}")
            assert cursor.fetchone() == (0,), table
    assert processes_of_run(tmp_path) == []


WEIGHTED = """
from bench.scenario import Scenario, Stream

SCENARIO = Scenario(
    name="tinyweighted",
    description="two backlogged tenants of weights 1 and 3, on two nodes of one process",
    concurrency=1,
    nodes=2,
    streams=(
        Stream(tenants=("light",), jobs=32, seconds=0.05, weight=1.0),
        Stream(tenants=("heavy",), jobs=32, seconds=0.05, weight=3.0),
    ),
)
"""


@pytest.mark.workers
def test_fairbench__repeat_weights_and_nodes(tmp_path: Path) -> None:
    scenario = tmp_path / "tinyweighted.py"
    scenario.write_text(WEIGHTED)
    out = tmp_path / "out"
    result = run_manage(
        tmp_path, "fairbench", str(scenario), "--modes", "plain,dispatch", "--repeat", "2",
        "--output", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        result.stdout.count("Run ") >= 2 and "Median (lowest-highest) of 2 runs:" in result.stdout
    )
    assert "Headline (dispatch, median of 2 runs)" in result.stdout
    report = json.loads((out / "tinyweighted.json").read_text())
    assert report["scenario"]["nodes"] == 2  # the scenario's, no --nodes given
    assert (out / "logs" / "dispatch-node2.log").exists()
    assert len(report["runs"]) == 2
    dispatch = report["aggregate"]["dispatch"]
    assert (dispatch["runs"], dispatch["lost"], dispatch["run_twice"]) == (2, 0, 0)
    # The weights reached the dispatching publisher: while both were backlogged, heavy
    # (weight 3) started about three jobs to light's one (0.75); unweighted it would be one
    # to one (0.5). A run counts a few dozen starts, so one run may land near 0.6: the mean
    # of the two runs is the figure compared.
    heavy = [run["dispatch"]["shares"]["heavy"] for run in report["runs"]]
    assert sum(heavy) / len(heavy) > 0.6, heavy
    assert report["weights"] == {"light": 1.0, "heavy": 3.0}
    # Every execution of every job of both runs, in the per-job file the docs' timelines use.
    with (out / "tinyweighted-jobs.csv").open() as f:
        rows = list(csv.DictReader(f))
    per_mode_run = {(r["run"], r["mode"]) for r in rows}
    assert per_mode_run == {(run, mode) for run in ("1", "2") for mode in ("plain", "dispatch")}
    for key in per_mode_run:
        mine = [r for r in rows if (r["run"], r["mode"]) == key]
        assert len({r["job"] for r in mine}) == len(mine) == 64  # the scenario's 32 + 32, once
        assert all(
            0 <= float(r["enqueued"]) <= float(r["started"]) <= float(r["finished"]) for r in mine
        )
        assert {r["tenant"] for r in mine} == {"light", "heavy"} and all(r["pid"] for r in mine)


def test_latency_proxy__a_session_through_it_works__each_round_trip_waits_the_delay() -> None:
    # A lower bound: the delay is what the proxy adds, so this cannot fail on a slow machine.
    import time

    import psycopg

    from bench.latency import Proxy

    if connection.vendor != "postgresql":
        pytest.skip("the proxy stands in front of PostgreSQL")
    s = connection.settings_dict
    proxy = Proxy(s.get("HOST") or "127.0.0.1", int(s.get("PORT") or 5432), 25.0)
    dsn = f"host=127.0.0.1 port={proxy.port} dbname={s['NAME']} user={s.get('USER') or 'postgres'}"
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute("SELECT generate_series(1, 20000)").fetchall()
            assert [r[0] for r in rows] == list(range(1, 20001))  # nothing lost or reordered
            started = time.perf_counter()
            for _ in range(3):
                assert conn.execute("SELECT 1").fetchone() == (1,)
            assert time.perf_counter() - started >= 3 * 2 * 0.025
    finally:
        proxy.stop()
    assert proxy.proc.poll() is not None


@pytest.mark.workers
def test_fairbench__db_latency__every_mode_through_the_proxy(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.py"
    scenario.write_text(TINY)
    out = tmp_path / "out"
    result = run_manage(
        tmp_path, "fairbench", str(scenario), "--modes", "plain,dispatch", "--db-latency-ms",
        "2", "--output", str(out),
    )  # fmt: skip
    if connection.vendor != "postgresql":
        assert result.returncode != 0
        assert "--db-latency-ms takes a number of ms >= 0, on PostgreSQL only." in result.stderr
        return
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "behind a proxy adding 2 ms each way" in result.stdout
    report = json.loads((out / "tiny.json").read_text())
    assert report["environment"]["db_latency_ms"] == 2.0
    for mode in ("plain", "dispatch"):
        s = report["summaries"][mode]
        assert (s["completed"], s["lost"], s["run_twice"]) == (18, 0, 0)
    assert processes_of_run(tmp_path) == []


def test_fairbench__refuses_clearly_when_the_broker_is_down(tmp_path: Path) -> None:
    result = run_manage(
        tmp_path, "fairbench", "demo", env={"CELERY_BROKER_URL": "redis://127.0.0.1:9/0"}
    )
    assert result.returncode != 0
    # kombu 5.7 masks an empty password (redis://:**@host); kombu 5.5 leaves it out.
    assert re.search(
        r"The broker redis://(:\*\*@)?127\.0\.0\.1:9/0 is not reachable", result.stderr
    )
    assert "point CELERY_BROKER_URL at one" in result.stderr


def test_fairbench__rejects_unknown_scenarios_and_modes(tmp_path: Path) -> None:
    result = run_manage(tmp_path, "fairbench", "nope")
    assert result.returncode != 0
    assert "Unknown scenario 'nope'" in result.stderr and "flood" in result.stderr
    result = run_manage(tmp_path, "fairbench", "demo", "--modes", "plain,fast")
    assert result.returncode != 0
    available = "available: plain, slots, reroute, queue-limits, planner, dispatch, combined"
    assert f"Unknown mode(s) fast; {available}" in result.stderr


def test_bench_reroute__flat_window_check_passes_and_cleans_up(tmp_path: Path) -> None:
    from django_fair_jobs.models import TenantWindow

    result = run_manage(
        tmp_path, "bench_reroute", "--jobs", "20", "--rounds", "2", "--big", "5000",
        env={"CELERY_BROKER_URL": os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")},
    )  # fmt: skip
    if connection.vendor != "postgresql":
        assert result.returncode != 0
        assert "needs PostgreSQL" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    # It filled 5,000 enqueues and checked that the count saw each one, then measured.
    assert "counting statement, 5,000 vs 100 in the window:" in result.stdout
    assert "publish with 2 rules vs without:" in result.stdout
    assert not TenantWindow.objects.exists()


def test_bench_costs__measures_every_step_with_its_explain(tmp_path: Path) -> None:
    # Each step's statement is explained with the parameters it is sent with: a statement
    # that gains a parameter fails here until the command names it too.
    result = run_manage(tmp_path, "bench_costs", "--calls", "5", "--rounds", "1")
    if connection.vendor != "postgresql":
        assert result.returncode != 0
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dispatch: enqueue + start + end" in result.stdout, result.stdout


def _local_waldump() -> Path | None:
    """Debian's pg_waldump of the test server's version, if the server runs here and its
    log is readable (it is on this project's test machines; a remote server has none)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('server_version_num')::int / 10000")
        major = cursor.fetchone()[0]
        cursor.execute("SELECT setting FROM pg_settings WHERE name = 'data_directory'")
        wal = Path(cursor.fetchone()[0]) / "pg_wal"
    waldump = Path(f"/usr/lib/postgresql/{major}/bin/pg_waldump")
    return waldump if waldump.exists() and os.access(wal, os.R_OK) else None


def test_bench_dispatch_wal__measures_each_step_and_leaves_the_tables_empty(
    tmp_path: Path,
) -> None:
    if connection.vendor != "postgresql":
        result = run_manage(tmp_path, "bench_dispatch_wal", "--jobs", "40")
        assert result.returncode != 0 and "set DATABASE_URL" in result.stderr
        return
    assert run_manage(tmp_path, "bench_dispatch_wal", "--capacity", "1").returncode != 0
    waldump = _local_waldump()
    args = ["--waldump", str(waldump)] if waldump else []
    result = run_manage(tmp_path, "bench_dispatch_wal", "--jobs", "40", *args)
    assert result.returncode == 0, result.stderr[-2000:]
    written = dict(re.findall(r"  (enqueue|start carrying an end): (\d+) bytes", result.stdout))
    assert int(written["enqueue"]) > 0 and int(written["start carrying an end"]) > 0
    # The data model's row updates: a job's row at its dispatch and its start, its line at
    # its enqueue, at the end before it and at its dispatch. The job's are not HOT (each
    # moves the row between partial indexes); of the line's, the enqueue behind a head is
    # (it changes only the count of jobs waiting, which no index names).
    assert "fair_jobs_dispatchjob: 2.00 row updates a job, 0.00 of them HOT" in result.stdout, (
        result.stdout
    )
    hot = re.search(r"fair_jobs_dispatchtenant: 3\.00 row updates a job, ([\d.]+) of them HOT",
                    result.stdout)  # fmt: skip
    assert hot and 0.5 <= float(hot[1]) <= 1.0, result.stdout
    if waldump:
        assert re.search(r"Btree/INSERT_LEAF: [1-9]", result.stdout), result.stdout
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM fair_jobs_dispatchjob")
        assert cursor.fetchone() == (0,)
        cursor.execute("SELECT count(*) FROM fair_jobs_dispatchreceipt")
        assert cursor.fetchone() == (0,)


def test_bench_dispatch__measures_both_cases_and_leaves_the_tables_empty(tmp_path: Path) -> None:
    result = run_manage(
        tmp_path, "bench_dispatch", "--tenants", "50", "--jobs", "500", "--cycles", "20",
        "--json", str(tmp_path / "d.json"),
    )  # fmt: skip
    if connection.vendor != "postgresql":
        assert result.returncode != 0 and "needs PostgreSQL" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| small | 10 | 100 |" in result.stdout and "| large | 50 | 500 |" in result.stdout
    figures = json.loads((tmp_path / "d.json").read_text())
    # Both cases ran their cycles (the plan on large tables: tests/dispatch/test_rule.py).
    assert figures["small"]["median_us"] > 0 and figures["large"]["median_us"] > 0
    assert figures["ratio"] == figures["large"]["median_us"] / figures["small"]["median_us"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM fair_jobs_dispatchjob")
        assert cursor.fetchone() == (0,)

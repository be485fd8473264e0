"""The benchmark's own arithmetic: the ideal scheduler, the metrics, scenarios, the report.

Hand-computed cases and synthetic records; no timing is asserted anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.metrics import (
    Record,
    peak_overlap,
    percentile,
    process_gaps,
    progress,
    ratio,
    share_error,
    shares,
    summarize,
)
from bench.report import (
    IDEAL,
    IDEAL_AT_PLAIN,
    ModeData,
    aggregate,
    aggregate_table,
    build,
    headline,
    ideal_records,
    table,
    write_figure,
    write_json,
)
from bench.scenario import Scenario, ScenarioError, Stream, load, tenants
from bench.simulate import SimJob, SimRun, simulate


def starts(runs: list[SimRun]) -> dict[int, tuple[float, float]]:
    return {r.id: (r.start, r.end) for r in runs}


# --- the ideal scheduler -------------------------------------------------------------


def test_simulate__a_later_tenant_goes_before_the_backlogged_one() -> None:
    jobs = [SimJob(1, "a", 0, 1), SimJob(2, "a", 0, 1), SimJob(3, "b", 0.5, 1)]
    # One worker: a1 runs 0-1; at 1 both a and b wait, neither runs anything, b never had
    # a turn, so b goes first (round-robin), then a2.
    assert starts(simulate(jobs, 1)) == {1: (0, 1), 3: (1, 2), 2: (2, 3)}


def test_simulate__equalizes_running_jobs_then_stays_busy() -> None:
    jobs = [SimJob(1, "a", 0, 1), SimJob(2, "a", 0, 1), SimJob(3, "a", 0, 1)]
    jobs.append(SimJob(4, "b", 0, 1))
    # Two workers: one job each for a and b (a first by name); at 1 only a has work left,
    # and a work-conserving scheduler gives it both workers.
    assert starts(simulate(jobs, 2)) == {1: (0, 1), 4: (0, 1), 2: (1, 2), 3: (1, 2)}


def test_simulate__idle_until_the_next_arrival() -> None:
    runs = simulate([SimJob(1, "a", 0, 1), SimJob(2, "a", 5, 2)], 1)
    assert starts(runs) == {1: (0, 1), 2: (5, 7)}


def test_simulate__a_worker_freed_at_an_arrival_takes_it_at_once() -> None:
    runs = simulate([SimJob(1, "a", 0, 1), SimJob(2, "b", 1, 1)], 1)
    assert starts(runs) == {1: (0, 1), 2: (1, 2)}


def test_simulate__flood_small_tenant_starts_on_the_next_free_worker() -> None:
    jobs = [SimJob(i, "greedy", 0, 1) for i in range(10)]
    jobs.append(SimJob(10, "small", 0.5, 1))
    runs = starts(simulate(jobs, 2))
    assert runs[10] == (1, 2)  # waits 0.5 s: for the first worker to free, not the flood
    assert max(end for _, end in runs.values()) == 6  # 11 jobs, 2 workers, never idle


def test_simulate__is_deterministic_and_rejects_nonsense() -> None:
    jobs = [SimJob(i, f"t{i % 3}", i * 0.1, 0.3) for i in range(30)]
    assert simulate(jobs, 4) == simulate(list(reversed(jobs)), 4)
    with pytest.raises(ValueError, match="concurrency"):
        simulate(jobs, 0)
    with pytest.raises(ValueError, match="durations"):
        simulate([SimJob(1, "a", 0, -1)], 1)


# --- metrics -------------------------------------------------------------------------


def test_percentile__nearest_rank() -> None:
    values = [float(v) for v in range(10, 0, -1)]
    assert percentile(values, 50) == 5
    assert percentile(values, 95) == 10
    assert percentile(values, 0) == 1
    assert percentile([3.0], 95) == 3
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_peak_overlap__touching_intervals_do_not_overlap() -> None:
    assert peak_overlap([(0, 1), (1, 2), (2, 3)]) == 1
    assert peak_overlap([(0, 2), (1, 3), (1.5, 1.6), (2.5, 4)]) == 3
    assert peak_overlap([]) == 0


def test_summarize__synthetic_records() -> None:
    records = [
        Record(1, "g", 100.0, 100.0, 101.0),
        Record(2, "g", 100.0, 100.5, 102.0),
        Record(2, "g", 100.0, 103.0, 104.0),  # job 2 ran twice
        Record(3, "s1", 100.5, 101.5, 102.5),
        Record(4, "s2", 100.5, 102.5, 103.0),
    ]
    s = summarize(
        records, [1, 2, 3, 4, 5], frozenset({"g"}), origin=100.0, statements=20, on_path=5,
        commits=15,
    )  # fmt: skip
    assert (s.jobs, s.completed, s.lost, s.run_twice) == (5, 4, 1, 1)
    assert (s.small_wait_p50, s.small_wait_p95, s.small_wait_max) == (1.0, 2.0, 2.0)
    assert s.greedy_makespan == 4.0
    assert s.makespan == 4.0
    assert s.throughput == 1.0  # 4 distinct jobs done in 4 s
    assert (s.peak_tenant, s.peak_jobs, s.greedy_peak) == ("g", 2, 2)
    assert s.statements_per_job == 4.0
    assert s.on_path_per_job == 1.0
    assert s.commits_per_job == 3.0


def test_process_gaps__between_a_processs_jobs__idle_time_left_out() -> None:
    records = [
        Record(1, "g", 0.0, 1.0, 2.0, pid=7),
        Record(2, "g", 0.0, 2.5, 3.0, pid=7),  # waiting since 0: a gap of 0.5
        Record(3, "g", 5.0, 5.1, 6.0, pid=7),  # enqueued after 2 ended: idleness, left out
        Record(4, "g", 0.0, 2.0, 4.0, pid=8),
        Record(5, "g", 0.0, 4.25, 5.0, pid=8),  # another process: 0.25
        Record(6, "g", 0.0, 9.0, 9.5),  # no process known (the ideal's): left out
    ]
    assert sorted(process_gaps(records)) == [0.25, 0.5]
    s = summarize(records, range(1, 7), frozenset({"g"}), origin=0.0)
    assert s.job_gap_ms == 375.0


def test_summarize__no_small_tenants_and_no_records() -> None:
    s = summarize([], [1, 2], frozenset(), origin=0.0)
    assert (s.lost, s.completed, s.makespan, s.throughput) == (2, 0, 0.0, 0.0)
    assert s.small_wait_p95 is None and s.peak_tenant is None and s.statements_per_job is None


def test_summarize__no_greedy_tenant__no_small_tenants_either() -> None:
    # "Small" says a tenant is not the greedy one: where no tenant floods (`overhead`,
    # `weighted`) no wait is a small tenant's, so no p95 of theirs makes a ratio.
    records = [Record(1, "only", 0.0, 0.5, 1.0), Record(2, "only", 0.0, 1.0, 1.5)]
    s = summarize(records, [1, 2], frozenset(), origin=0.0)
    assert (s.small_wait_p50, s.small_wait_p95, s.small_wait_max) == (None, None, None)
    assert s.completed == 2 and s.makespan == 1.5


def test_shares__counted_while_every_weighted_tenant_is_backlogged() -> None:
    # "a" starts its last job at t=4: from then on it has nothing left to take its share,
    # so only the starts before t=4 count: a 1 (t=0), b 3 (t=1, 2, 3).
    records = [Record(1, "a", 0, 0, 1), Record(2, "a", 0, 4, 5)]
    records += [Record(10 + i, "b", 0, float(i), i + 1.0) for i in range(1, 7)]
    weights = {"a": 1.0, "b": 3.0}
    assert shares(records, weights) == {"a": 0.25, "b": 0.75}
    assert share_error(shares(records, weights), weights) == 0.0
    # Weights 1:1 would want half each: b took 50% more than its share, a half of it.
    assert share_error({"a": 0.25, "b": 0.75}, {"a": 1.0, "b": 1.0}) == 0.5
    assert shares(records, {"a": 1.0, "c": 1.0}) is None  # c never started
    assert share_error(None, weights) is None
    s = summarize(records, [1, 2, *range(11, 17)], frozenset(), 0.0, weights=weights)
    assert (s.shares, s.share_error) == ({"a": 0.25, "b": 0.75}, 0.0)
    assert summarize(records, [1], frozenset(), 0.0).shares is None


def test_ratio_and_progress() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None
    # A wait of the ideal below a millisecond (one tenant that never waits) is no basis.
    assert ratio(0.5, 0.0002) is None and ratio(0.5, 0.002) == 250.0
    records = [Record(1, "a", 0, 0, 2), Record(2, "a", 0, 1, 1.5), Record(2, "a", 0, 3, 4)]
    assert progress(records, origin=0.5) == {"a": [1.0, 1.5]}


# --- scenarios -------------------------------------------------------------------------


def test_flood_scenario_is_the_specified_one() -> None:
    flood = load("flood")
    greedy = [j for j in flood.jobs if j.tenant == "greedy"]
    small = [j for j in flood.jobs if j.tenant != "greedy"]
    assert flood.concurrency == 4
    assert len(greedy) == 2000 and {(j.offset, j.seconds) for j in greedy} == {(0.0, 0.02)}
    assert len(small) == 100 and {(j.offset, j.seconds) for j in small} == {(0.5, 0.02)}
    assert len({j.tenant for j in small}) == 20
    assert flood.greedy_tenants == {"greedy"}
    assert flood.limit_for(4) == 2
    assert load("overhead").limit_for(4) == 1000
    spread = load("overhead16")
    assert len(spread.jobs) == 2000 and {j.seconds for j in spread.jobs} == {0.0}
    assert len({j.tenant for j in spread.jobs}) == 16 and spread.limit_for(4) == 1000
    long = load("overhead16long")
    assert len(long.jobs) == 12_000 and {j.seconds for j in long.jobs} == {0.0}
    assert {j.tenant for j in long.jobs} == {j.tenant for j in spread.jobs}
    assert long.limit_for(4) == 1000
    longer = load("flood100")
    greedy = [j for j in longer.jobs if j.tenant == "greedy"]
    small = [j for j in longer.jobs if j.tenant != "greedy"]
    assert len(greedy) == 600 and {(j.offset, j.seconds) for j in greedy} == {(0.0, 0.1)}
    assert len(small) == 60 and {(j.offset, j.seconds) for j in small} == {(0.5, 0.1)}
    assert len({j.tenant for j in small}) == 20 and longer.greedy_tenants == {"greedy"}


def test_steady_scenario__poisson_arrivals_are_seeded_and_one_tenant_turns_greedy() -> None:
    steady = load("steady")
    again = load("steady")
    assert [j.offset for j in steady.jobs] == [j.offset for j in again.jobs]
    offsets = [j.offset for j in steady.jobs]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert steady.greedy_tenants == {"tenant-00"}
    assert min(j.offset for j in steady.jobs if j.greedy) > 8.0


def test_weighted_and_nodes_scenarios_are_the_specified_ones() -> None:
    weighted = load("weighted")
    assert weighted.weights == {"weight-1": 1.0, "weight-3": 3.0, "weight-6": 6.0}
    assert {j.tenant for j in weighted.jobs} == set(weighted.weights)
    assert all(j.offset == 0.0 for j in weighted.jobs)  # all backlogged from the start
    nodes, flood = load("nodes"), load("flood")
    assert (nodes.nodes, nodes.concurrency) == (2, 2)
    assert nodes.jobs == flood.jobs and flood.nodes == 1 and flood.weights == {}


def test_scenario__validation_says_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="jobs must be at least 1"):
        Scenario("x", "", (Stream(("a",), jobs=0, seconds=1),))
    with pytest.raises(ScenarioError, match="rate must be > 0"):
        Scenario("x", "", (Stream(("a",), jobs=1, seconds=1, rate=0),))
    with pytest.raises(ScenarioError, match="weight must be a finite number > 0"):
        Scenario("x", "", (Stream(("a",), jobs=1, seconds=1, weight=0),))
    with pytest.raises(ScenarioError, match="concurrency and nodes must be at least 1"):
        Scenario("x", "", (Stream(("a",), jobs=1, seconds=1),), nodes=0)
    with pytest.raises(ScenarioError, match="no streams"):
        Scenario("x", "", ())
    with pytest.raises(ScenarioError, match=r"Unknown scenario 'nope'.*flood"):
        load("nope")
    bad = tmp_path / "bad.py"
    bad.write_text("X = 1\n")
    with pytest.raises(ScenarioError, match="must define SCENARIO"):
        load(str(bad))
    good = tmp_path / "tiny.py"
    good.write_text(
        "from bench.scenario import Scenario, Stream\n"
        "SCENARIO = Scenario('tiny', 'two jobs', (Stream(('a', 'b'), jobs=1, seconds=0),))\n"
    )
    assert [j.tenant for j in load(str(good)).jobs] == ["a", "b"]
    assert tenants("s", 3) == ("s-00", "s-01", "s-02")


# --- the report --------------------------------------------------------------------------


def test_ideal_uses_the_median_measured_arrivals_and_durations() -> None:
    nominal = {1: ("a", 0.0, 9.0), 2: ("b", 0.0, 9.0), 3: ("b", 0.0, 5.0)}
    modes = [
        ModeData("m1", "", 10.0, [Record(1, "a", 10.0, 10.0, 11.0),
                                  Record(2, "b", 10.5, 11.0, 13.0)], None),
        ModeData("m2", "", 20.0, [Record(1, "a", 20.0, 20.0, 23.0),
                                  Record(2, "b", 20.5, 23.0, 25.0)], None),
    ]  # fmt: skip
    runs = {r.job: r for r in ideal_records(modes, nominal, concurrency=1)}
    # Job 1: arrival 0, duration median(1, 3) = 2. Job 2: arrival 0.5, duration 2. Job 3
    # never ran: its planned offset 0 and duration 5. One worker, round-robin: a1, b3, b2.
    assert (runs[1].started_at, runs[1].finished_at) == (0.0, 2.0)
    assert (runs[3].started_at, runs[3].finished_at) == (2.0, 7.0)
    assert (runs[2].started_at, runs[2].finished_at) == (7.0, 9.0)


def test_report__ratios_table_json_and_figure(tmp_path: Path) -> None:
    nominal = {i: ("g" if i < 4 else "s", 0.0, 1.0) for i in range(6)}
    plain = [Record(i, "g", 0.0, float(i), i + 1.0) for i in range(4)]
    plain += [Record(4, "s", 0.0, 4.0, 5.0), Record(5, "s", 0.0, 5.0, 6.0)]
    fair = [Record(4, "s", 0.0, 0.0, 1.0), Record(5, "s", 0.0, 1.0, 2.0)]
    fair += [Record(i, "g", 0.0, i + 2.0, i + 3.0) for i in range(4)]
    modes = [ModeData("plain", "", 0.0, plain, 0), ModeData("slots", "", 0.0, fair, 12)]
    report = build(modes, nominal, frozenset({"g"}), 1, "plain", "slots")
    s = report["summaries"]
    assert list(s) == [IDEAL, "plain", "slots"]
    assert s["plain"]["small_wait_p95"] == 5.0 and s["slots"]["small_wait_p95"] == 1.0
    # The ideal alternates g0, s4, g1, s5, ...: small waits 1 and 3 s, p95 3 s. The "slots"
    # records serve s first, so they beat this ideal (it does not know s is small).
    assert s[IDEAL]["small_wait_p95"] == 3.0
    assert s["slots"]["small_p95_vs_ideal"] == pytest.approx(1 / 3)
    assert s["slots"]["makespan_vs_plain"] == 1.0
    assert s["slots"]["statements_per_job"] == 2.0
    text = table(report)
    assert text.count("\n") == 4 and "| slots | 0.00 s | 1.00 s |" in text
    write_json(report, {"scenario": {"name": "t"}}, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["recommended"] == "slots"
    write_figure(report, "t", tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report__the_ideal_at_plains_speed__each_job_lasts_plains_gap_longer() -> None:
    nominal = {i: ("g" if i < 4 else "s", 0.0, 1.0) for i in range(6)}
    # Plain Celery's one process spends 0.5 s between two jobs: each takes 1.5 s of it.
    order = [0, 4, 1, 5, 2, 3]
    plain = [Record(j, nominal[j][0], 0.0, 1.5 * k, 1.5 * k + 1.0, 7) for k, j in enumerate(order)]
    fair = [Record(j, nominal[j][0], 0.0, 2.0 * k, 2.0 * k + 1.0, 8) for k, j in enumerate(order)]
    modes = [ModeData("plain", "", 0.0, plain, 0), ModeData("dispatch", "", 0.0, fair, 12)]
    report = build(modes, nominal, frozenset({"g"}), 1, "plain", "dispatch")
    s = report["summaries"]
    assert list(s) == [IDEAL, IDEAL_AT_PLAIN, "plain", "dispatch"]
    # The same order as the ideal's, every job 1.5 s instead of 1 s: each wait x1.5.
    assert s[IDEAL_AT_PLAIN]["small_wait_p95"] == pytest.approx(1.5 * s[IDEAL]["small_wait_p95"])
    assert s["plain"]["small_p95_vs_ideal_at_plain"] == pytest.approx(1.0)
    assert s["dispatch"]["small_p95_vs_ideal_at_plain"] == pytest.approx(2.0 / 1.5)
    assert "| ideal at plain's speed |" in table(report)


def test_headline__a_scenario_without_small_tenants__no_wait_figure() -> None:
    nominal = {i: ("g", 0.0, 1.0) for i in range(3)}
    plain = [Record(i, "g", 0.0, float(i), i + 1.0) for i in range(3)]
    fair = [Record(i, "g", 0.0, 2.0 * i, 2.0 * i + 1.0) for i in range(3)]
    modes = [ModeData("plain", "", 0.0, plain, 0), ModeData("dispatch", "", 0.0, fair, 9)]
    text = headline(build(modes, nominal, frozenset({"g"}), 1, "plain", "dispatch"))
    assert text.startswith("Headline (dispatch): makespan 1.67x of plain Celery; ")
    assert "n/a" not in text and "wait" not in text


def test_aggregate__median_and_spread_over_runs() -> None:
    def run(p95: float, lost: int, gap: float | None) -> dict[str, Any]:
        fig = {
            "small_p95_vs_ideal": p95, "makespan_vs_plain": 1.0, "throughput_vs_plain": 1.0,
            "statements_per_job": 3.0, "share_error": gap, "lost": lost, "run_twice": 0,
        }  # fmt: skip
        return {"summaries": {"dispatch": fig}}

    a = aggregate([run(1.2, 0, 0.01), run(1.9, 1, None), run(1.3, 0, 0.03)])["dispatch"]
    assert a["runs"] == 3 and a["lost"] == 1
    assert a["small_p95_vs_ideal"] == {"median": 1.3, "min": 1.2, "max": 1.9}
    assert a["share_error"] == {"median": 0.02, "min": 0.01, "max": 0.03}  # the runs that had one
    text = aggregate_table({"dispatch": a})
    assert "| dispatch | 3 | 1.30x (1.20-1.90) |" in text and "| 2.0% (1.0-3.0) | 1 | 0 |" in text


def counting_from_zero() -> None:
    """The benchmark's statement counts, on this connection, from 0."""
    from django.db import connection

    from bench import statements

    statements.install()
    connection.ensure_connection()
    statements._on_connection(None, connection)  # the signal fired before install()
    statements.reset()


@pytest.mark.django_db(transaction=True)
def test_statements__durable_commits__one_per_writing_transaction() -> None:
    from django.db import transaction

    from bench import statements
    from django_fair_jobs.dispatch.models import DispatchQueue

    counting_from_zero()
    DispatchQueue.objects.create(queue="q1", capacity=1)  # autocommit: one
    assert statements.commits() == 1
    list(DispatchQueue.objects.all())  # a read: none
    assert statements.commits() == 1
    with transaction.atomic():  # three writes, one commit
        DispatchQueue.objects.create(queue="q2", capacity=1)
        DispatchQueue.objects.filter(queue="q1").update(capacity=2)
        DispatchQueue.objects.filter(queue="q2").delete()
        assert statements.commits() == 1
    assert statements.commits() == 2

    def rolled_back() -> None:
        with transaction.atomic():
            DispatchQueue.objects.create(queue="q3", capacity=1)
            raise RuntimeError

    with pytest.raises(RuntimeError):  # rolled back: none
        rolled_back()
    with transaction.atomic():  # and the next transaction counts again
        DispatchQueue.objects.create(queue="q4", capacity=1)
    assert statements.commits() == 3
    assert statements.count() >= 7


@pytest.mark.django_db(transaction=True)
def test_statements__on_the_path__up_to_the_last_jobs_end() -> None:
    # A process's shutdown (retiring its row, a last maintenance pass) sends statements
    # from the thread that ran its jobs, after the last of them: on no job's path.
    from bench import statements
    from django_fair_jobs.dispatch.models import DispatchQueue

    counting_from_zero()
    list(DispatchQueue.objects.all())  # a job's statement
    statements.job_ended()
    list(DispatchQueue.objects.all())  # the shutdown's
    DispatchQueue.objects.create(queue="q1", capacity=1)
    assert (statements.on_path(), statements.on_path_to_last_job()) == (3, 1)
    assert statements.count() == 3

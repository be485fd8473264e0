"""What a benchmark scenario is: tenants, when their jobs arrive, and how long each runs.

A scenario file is a Python module that defines ``SCENARIO``, a :class:`Scenario`. The
shipped ones live in ``bench/scenarios/``; ``manage.py fairbench path/to/file.py`` loads any
other. This module imports nothing from Django, so the tests can use it directly.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Work = Literal["sleep", "cpu"]

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"


class ScenarioError(ValueError):
    """A scenario is missing or invalid; the message says what to fix."""


@dataclass(frozen=True)
class Stream:
    """The jobs that each of ``tenants`` enqueues.

    With ``rate`` unset, each tenant enqueues all ``jobs`` at once, ``at`` seconds after the
    start (a burst). With ``rate`` set, each tenant's jobs arrive as a Poisson process of
    ``rate`` jobs per second starting at ``at``.
    """

    tenants: tuple[str, ...]
    jobs: int
    seconds: float
    at: float = 0.0
    rate: float | None = None
    work: Work = "sleep"
    greedy: bool = False
    weight: float = 1.0
    """The tenants' weight (the ``tenant_weights`` of the modes that weigh tenants)."""


@dataclass(frozen=True)
class Job:
    """One job of a scenario: its planned arrival and duration."""

    id: int
    tenant: str
    offset: float
    seconds: float
    work: Work
    greedy: bool


@dataclass(frozen=True)
class Scenario:
    """A named workload.

    ``concurrency`` is the worker concurrency it is meant for (the command can override
    it), ``nodes`` the worker nodes it runs on. ``tenant_limit`` is the tenant slot limit
    the fair modes use; unset, it is half the total concurrency, so a greedy tenant keeps
    at most half the workers.
    """

    name: str
    description: str
    streams: tuple[Stream, ...]
    concurrency: int = 4
    nodes: int = 1
    tenant_limit: int | None = None
    seed: int = 1
    jobs: tuple[Job, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate(self)
        object.__setattr__(self, "jobs", tuple(expand(self)))

    @property
    def greedy_tenants(self) -> frozenset[str]:
        """The tenants whose streams are marked greedy."""
        return frozenset(j.tenant for j in self.jobs if j.greedy)

    @property
    def weights(self) -> dict[str, float]:
        """Each tenant's weight, if any stream weighs its tenants; else empty (all equal)."""
        if all(s.weight == 1.0 for s in self.streams):
            return {}
        return {t: s.weight for s in self.streams for t in s.tenants}

    def limit_for(self, total_concurrency: int) -> int:
        """The tenant slot limit for fair modes, given the total worker concurrency."""
        if self.tenant_limit is not None:
            return self.tenant_limit
        return max(1, total_concurrency // 2)


def tenants(prefix: str, count: int) -> tuple[str, ...]:
    """``count`` tenant names: ``prefix-00``, ``prefix-01``, ..."""
    return tuple(f"{prefix}-{i:02d}" for i in range(count))


def validate(scenario: Scenario) -> None:
    """Raise :class:`ScenarioError` if ``scenario`` cannot be run."""
    where = f"Scenario {scenario.name!r}"
    if not scenario.streams:
        raise ScenarioError(f"{where} has no streams; add at least one Stream(...).")
    if scenario.concurrency < 1 or scenario.nodes < 1:
        raise ScenarioError(f"{where}: concurrency and nodes must be at least 1.")
    if scenario.tenant_limit is not None and scenario.tenant_limit < 1:
        raise ScenarioError(f"{where}: tenant_limit must be at least 1 (or None).")
    for i, s in enumerate(scenario.streams):
        here = f"{where}, stream {i}"
        if not s.tenants or any(not isinstance(t, str) or not t.strip() for t in s.tenants):
            raise ScenarioError(f"{here}: tenants must be non-empty strings.")
        if s.jobs < 1:
            raise ScenarioError(f"{here}: jobs must be at least 1 per tenant.")
        if s.seconds < 0 or s.at < 0:
            raise ScenarioError(f"{here}: seconds and at must be >= 0.")
        if s.rate is not None and s.rate <= 0:
            raise ScenarioError(f"{here}: rate must be > 0 jobs/s (or None for a burst).")
        if not s.weight > 0 or s.weight == float("inf"):
            raise ScenarioError(f"{here}: weight must be a finite number > 0, not {s.weight!r}.")
        if s.work not in ("sleep", "cpu"):
            raise ScenarioError(f"{here}: work must be 'sleep' or 'cpu', not {s.work!r}.")


def expand(scenario: Scenario) -> list[Job]:
    """Every job of ``scenario``, ordered by planned arrival; deterministic for a seed."""
    rng = random.Random(scenario.seed)
    planned: list[tuple[float, str, float, Work, bool]] = []
    for s in scenario.streams:
        for tenant in s.tenants:
            t = s.at
            for _ in range(s.jobs):
                if s.rate is not None:
                    t += rng.expovariate(s.rate)
                planned.append((t, tenant, s.seconds, s.work, s.greedy))
    planned.sort(key=lambda p: p[0])  # stable: a burst keeps its order
    return [
        Job(id=i, tenant=tenant, offset=offset, seconds=seconds, work=work, greedy=greedy)
        for i, (offset, tenant, seconds, work, greedy) in enumerate(planned)
    ]


def builtin_names() -> list[str]:
    """The shipped scenario names."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.py") if not p.stem.startswith("_"))


def load(name_or_path: str) -> Scenario:
    """Load a shipped scenario by name, or any scenario file by path."""
    path = Path(name_or_path)
    if path.suffix == ".py":
        if not path.is_file():
            raise ScenarioError(f"No scenario file at {path}.")
        spec = importlib.util.spec_from_file_location(f"bench_scenario_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ScenarioError(f"Cannot import {path} as a Python module.")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    elif name_or_path in builtin_names():
        module = importlib.import_module(f"bench.scenarios.{name_or_path}")
    else:
        raise ScenarioError(
            f"Unknown scenario {name_or_path!r}: use one of {', '.join(builtin_names())}, "
            "or the path of a .py file that defines SCENARIO."
        )
    scenario = getattr(module, "SCENARIO", None)
    if not isinstance(scenario, Scenario):
        raise ScenarioError(
            f"{name_or_path} must define SCENARIO = Scenario(...) (from bench.scenario)."
        )
    return scenario

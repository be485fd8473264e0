"""The flood on two worker nodes of two processes each: fairness across nodes."""

from bench.scenario import Scenario
from bench.scenarios.flood import SCENARIO as FLOOD

SCENARIO = Scenario(
    name="nodes",
    description=(
        "flood (1 greedy tenant enqueues 2,000 jobs of 20 ms at t=0; 20 small tenants "
        "5 each at t=0.5 s) on 2 worker nodes x 2 processes."
    ),
    concurrency=2,
    nodes=2,
    streams=FLOOD.streams,
)

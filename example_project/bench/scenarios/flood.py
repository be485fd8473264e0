"""One tenant floods the queue, then twenty small tenants arrive."""

from bench.scenario import Scenario, Stream, tenants

SCENARIO = Scenario(
    name="flood",
    description=(
        "1 greedy tenant enqueues 2,000 jobs of 20 ms at t=0; 20 small tenants enqueue "
        "5 each at t=0.5 s; concurrency 4."
    ),
    concurrency=4,
    streams=(
        Stream(tenants=("greedy",), jobs=2000, seconds=0.02, greedy=True),
        Stream(tenants=tenants("small", 20), jobs=5, seconds=0.02, at=0.5),
    ),
)

"""Three backlogged tenants of weights 1, 3 and 6: does each get its share of the workers?"""

from bench.scenario import Scenario, Stream

SCENARIO = Scenario(
    name="weighted",
    description=(
        "3 tenants of weights 1, 3 and 6 each enqueue 1,000 jobs of 20 ms at t=0; "
        "concurrency 4. Shares are counted over the starts while all three have jobs left."
    ),
    concurrency=4,
    streams=(
        Stream(tenants=("weight-1",), jobs=1000, seconds=0.02, weight=1.0),
        Stream(tenants=("weight-3",), jobs=1000, seconds=0.02, weight=3.0),
        Stream(tenants=("weight-6",), jobs=1000, seconds=0.02, weight=6.0),
    ),
)

"""The cost of fairness spread over 16 tenants, when there is nothing to be fair about."""

from bench.scenario import Scenario, Stream

SCENARIO = Scenario(
    name="overhead16",
    description=(
        "16 tenants enqueue 125 no-op jobs each at t=0 (2,000 in all); no limit is ever "
        "reached, so every difference from plain Celery is the library's own cost, with no "
        "hot tenant row; concurrency 4."
    ),
    concurrency=4,
    # Far above the concurrency: no tenant ever waits for a slot.
    tenant_limit=1000,
    streams=(Stream(tenants=tuple(f"t{i:02}" for i in range(16)), jobs=125, seconds=0.0),),
)

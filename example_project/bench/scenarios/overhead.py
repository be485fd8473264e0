"""The cost of fairness when there is nothing to be fair about."""

from bench.scenario import Scenario, Stream

SCENARIO = Scenario(
    name="overhead",
    description=(
        "1 tenant enqueues 2,000 no-op jobs at t=0; its limit is never reached, so every "
        "difference from plain Celery is the library's own cost; concurrency 4."
    ),
    concurrency=4,
    # Far above the concurrency: the tenant never waits for a slot.
    tenant_limit=1000,
    streams=(Stream(tenants=("only",), jobs=2000, seconds=0.0),),
)

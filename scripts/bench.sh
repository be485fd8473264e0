#!/usr/bin/env bash
# The fairness benchmark on PostgreSQL and a real broker (Redis by default). Creates .venv
# and installs what it needs on first use. Usage:
#
#   bash scripts/bench.sh [--rabbitmq] [SCENARIO] [fairbench options]
#
# SCENARIO is flood (default), steady, overhead, demo, or a .py file; see
# `bash scripts/bench.sh --help` and docs/benchmarks.md. Override the services with
# DATABASE_URL and CELERY_BROKER_URL. Results go to benchmark-output/.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh bench

BROKER=${CELERY_BROKER_URL:-redis://127.0.0.1:6379/2}
if [ "${1:-}" = "--rabbitmq" ]; then
    shift
    BROKER=${CELERY_BROKER_URL:-amqp://guest:guest@127.0.0.1:5672//}
fi
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/fair_jobs_bench}
export CELERY_BROKER_URL=$BROKER
exec .venv/bin/python example_project/manage.py fairbench "$@"

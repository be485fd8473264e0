#!/usr/bin/env bash
# The whole chaos suite (tests/chaos/: the fast subset and the chaos_full tests): faults
# injected into real Celery worker nodes, a throwaway PostgreSQL server it starts itself
# (initdb/pg_ctl on a free port) and RabbitMQ; then regenerates the Faults table of
# docs/reliability.md from the figures of this run. Non-zero if any test failed.
#
# Needs the PostgreSQL server binaries (Debian: postgresql) and RabbitMQ on 127.0.0.1:5672
# (guest/guest; override with FAIR_JOBS_CHAOS_BROKER). Extra arguments go to pytest.
# Restarts RabbitMQ's app once (rabbitmqctl stop_app/start_app): run it on a machine of
# your own.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh dev

FIGURES=$(mktemp)
trap 'rm -f "$FIGURES"' EXIT
status=0
FAIR_JOBS_CHAOS_REPORT=$FIGURES .venv/bin/python -m pytest tests/chaos --chaos-full "$@" \
    || status=1
.venv/bin/python -m tests.chaos.report "$FIGURES" docs/reliability.md || status=1
exit $status

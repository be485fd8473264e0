#!/usr/bin/env bash
# The fairness demo on embedded defaults (SQLite, and kombu's SQLAlchemy transport on SQLite
# as the broker): no service needed. Creates .venv and installs what it needs on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh demo
export DEMO_DIR=${DEMO_DIR:-$PWD/example_project/.demo}
rm -rf "$DEMO_DIR"
exec .venv/bin/python example_project/manage.py run_demo "$@"

#!/usr/bin/env bash
# The whole test suite, twice: against PostgreSQL (the real target) and against SQLite
# (development), both with real Celery worker processes on Redis. Creates .venv and
# installs the package with its dev extras on first use.
#
# Needs PostgreSQL on 127.0.0.1:5432 (role postgres, trust auth) and Redis on
# 127.0.0.1:6379; override with DATABASE_URL / CELERY_BROKER_URL. Extra arguments go to
# pytest (e.g. -k race).
# The chaos suite's fast subset (tests/chaos/) runs on PostgreSQL only, last: it starts
# its own PostgreSQL server (the server binaries must be installed) and needs RabbitMQ on
# 127.0.0.1:5672 (FAIR_JOBS_CHAOS_BROKER). The whole of it: bash scripts/chaos.sh.
# Installs Debian's chromium and chromium-driver (apt-get) if missing, for the admin's
# browser test (tests/test_browser.py), pgbouncer for tests/deploy/test_pgbouncer.py, and
# prometheus (its promtool) for tests/test_alerts.py.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh dev

PG_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/fair_jobs}
BROKER=${CELERY_BROKER_URL:-redis://127.0.0.1:6379/15}
.venv/bin/python - "$PG_URL" "$BROKER" <<'PY' || exit 1
import os
import sys

import kombu
import psycopg
import redis

pg_url, broker = sys.argv[1:3]
try:
    psycopg.connect(pg_url.rsplit("/", 1)[0] + "/postgres", connect_timeout=5).close()
except Exception as exc:
    sys.exit(f"PostgreSQL is not reachable ({exc}); start it (see docs/contributing.md, Running the tests).")
try:
    redis.Redis.from_url(broker, socket_connect_timeout=5).ping()
except Exception as exc:
    sys.exit(f"Redis is not reachable ({exc}); start it (see docs/contributing.md, Running the tests).")
chaos_broker = os.environ.get("FAIR_JOBS_CHAOS_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
try:
    with kombu.Connection(chaos_broker, connect_timeout=5) as conn:
        conn.ensure_connection(max_retries=1)
except Exception as exc:
    sys.exit(f"RabbitMQ is not reachable ({exc}); start it (see docs/contributing.md, Running the tests).")
PY

if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    SUDO=
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then
        SUDO=sudo
    fi
    echo "Installing chromium and chromium-driver for the admin's browser test..."
    # The package lists may be stale or absent (fresh container): update only if needed.
    $SUDO apt-get install -y -q chromium chromium-driver \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q chromium chromium-driver; } \
        || { echo "Could not install chromium and chromium-driver (needed by" \
                  "tests/test_browser.py); install them: apt-get install chromium" \
                  "chromium-driver" >&2; exit 1; }
fi

# Debian's pgbouncer, for the deployment test behind PgBouncer (tests/deploy/test_pgbouncer.py);
# the tests start their own PgBouncer processes, not the package's service.
if [ ! -x /usr/sbin/pgbouncer ] && ! command -v pgbouncer >/dev/null; then
    SUDO=
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then
        SUDO=sudo
    fi
    echo "Installing pgbouncer for the PgBouncer deployment test..."
    $SUDO apt-get install -y -q pgbouncer \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q pgbouncer; } \
        || { echo "Could not install pgbouncer (needed by tests/deploy/test_pgbouncer.py);" \
                  "install it: apt-get install pgbouncer" >&2; exit 1; }
fi

# Prometheus' promtool, for the alert rules' unit tests (tests/test_alerts.py); the package's
# server is not used.
if ! command -v promtool >/dev/null; then
    SUDO=
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then
        SUDO=sudo
    fi
    echo "Installing prometheus (for promtool) for the alert rules' tests..."
    $SUDO apt-get install -y -q --no-install-recommends prometheus \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends prometheus; } \
        || { echo "Could not install prometheus (its promtool is needed by tests/test_alerts.py);" \
                  "install it: apt-get install prometheus" >&2; exit 1; }
    # On a machine run by systemd the package starts its server (port 9090) and enables it
    # at boot; only promtool is wanted, and nothing ran it before this install.
    if [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
fi

SQLITE_DIR=$(mktemp -d)
trap 'rm -rf "$SQLITE_DIR"' EXIT
# The PostgreSQL and SQLite passes run side by side: they share no database and no broker
# number, and both spend most of their time waiting for worker processes. The SQLite pass's
# output follows the PostgreSQL pass's. The chaos subset runs last, alone: it freezes and
# restarts processes against deadlines that load from the other pass would stretch.
DATABASE_URL=sqlite:///$SQLITE_DIR/test.sqlite3 CELERY_BROKER_URL=redis://127.0.0.1:6379/13 \
    CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/12 \
    .venv/bin/python -m pytest -p no:cacheprovider -m "not chaos" "$@" \
    >"$SQLITE_DIR/sqlite.log" 2>&1 &
sqlite=$!
# Ctrl-C or a kill of this script stops the SQLite pass too, and then removes its files.
trap 'kill "$sqlite" 2>/dev/null; wait "$sqlite" 2>/dev/null; rm -rf "$SQLITE_DIR"' EXIT
trap 'exit 130' INT TERM
export DATABASE_URL=$PG_URL CELERY_BROKER_URL=$BROKER
export CELERY_RESULT_BACKEND=${CELERY_RESULT_BACKEND:-redis://127.0.0.1:6379/14}
status=0
echo "=== PostgreSQL ==="
.venv/bin/python -m pytest -m "not chaos" "$@" || status=1
wait "$sqlite" || status=1
echo "=== SQLite ==="
cat "$SQLITE_DIR/sqlite.log"
echo "=== PostgreSQL: the chaos subset ==="
.venv/bin/python -m pytest -m chaos "$@"
chaos=$?
# 5: the arguments selected none of its tests.
if [ "$chaos" != 0 ] && [ "$chaos" != 5 ]; then
    status=1
fi
exit $status

#!/usr/bin/env bash
# The test matrix (noxfile.py): the suite on each supported Python, Django and Celery.
# Creates .venv with the dev extras (nox among them) on first use; nox then builds one
# virtualenv per cell under .nox/. Arguments go to nox, e.g.:
#
#   bash scripts/matrix.sh -l                                  # list the cells
#   bash scripts/matrix.sh                                     # every fast cell
#   bash scripts/matrix.sh -s "tests(py3.13-dj6.1-cel5.7)"     # one whole cell
#   bash scripts/matrix.sh -t ci                               # the cells CI runs
#   bash scripts/matrix.sh --ci                                # the same, two at once
#
# Needs the services of scripts/test.sh, and python3.11, 3.12 and 3.13: on PATH, or
# installed with pyenv (found here even when pyenv does not select them).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh dev

if command -v pyenv >/dev/null; then
    root=$(pyenv root)
    for minor in 3.11 3.12 3.13; do
        # pyenv's shim answers for every version but runs only the selected ones.
        if ! "python$minor" -c '' 2>/dev/null; then
            found=$(ls -d "$root/versions/$minor".* 2>/dev/null | sort -V | tail -n 1)
            [ -n "$found" ] && PATH="$found/bin:$PATH"
        fi
    done
    export PATH
fi
if [ "${1:-}" = "--ci" ]; then
    # The cell with workers spends most of its time waiting for them, so it runs beside the
    # fast cell: each kind has a database and broker numbers of its own (noxfile.py). Its
    # output follows the fast cell's. The cells are installed first, one after the other:
    # two builds of the package at once would write the same egg-info directory.
    shift
    if [ -n "${DATABASE_URL:-}${CELERY_BROKER_URL:-}${CELERY_RESULT_BACKEND:-}" ]; then
        echo "DATABASE_URL or a broker variable is set and every cell would share it:" \
             "the CI cells run one after the other."
        exec .venv/bin/nox -t ci "$@"
    fi
    .venv/bin/nox -t ci --install-only || exit 1
    log=$(mktemp)
    .venv/bin/nox -t ci-workers --no-install "$@" >"$log" 2>&1 &
    workers=$!
    .venv/bin/nox -t ci-fast --no-install "$@"
    fast=$?
    wait "$workers"
    workers_status=$?
    cat "$log"
    rm -f "$log"
    [ "$fast" = 0 ] && [ "$workers_status" = 0 ]
    exit
fi
exec .venv/bin/nox "$@"

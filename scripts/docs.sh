#!/usr/bin/env bash
# The documentation site: builds docs/ with mkdocs-material (mkdocs.yml) into site/, with
# every warning an error (a broken link or anchor, a page missing from the nav). Creates
# .venv and installs the package with its dev extras on first use.
#
# Extra arguments go to mkdocs build (e.g. --verbose). `bash scripts/docs.sh serve` serves
# the site on http://127.0.0.1:8000 instead, rebuilt on every change (extra arguments go to
# mkdocs serve).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh dev

export NO_MKDOCS_2_WARNING=1  # mkdocs-material's banner about its successor
if [ "${1:-}" = "serve" ]; then
    shift
    exec .venv/bin/mkdocs serve --strict "$@"
fi
exec .venv/bin/mkdocs build --strict --site-dir site "$@"

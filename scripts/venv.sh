# Sourced by the other scripts, from the repository root: `. scripts/venv.sh EXTRA`.
# Creates .venv with $PYTHON (default python3) on first use and installs the package with
# that extra, so each script installs what it runs, whichever a newcomer runs first.
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv || exit 1
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$1]" || exit 1

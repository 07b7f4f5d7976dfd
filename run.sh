#!/usr/bin/env bash
# The two commands a new user needs (each installs what it needs into .venv first):
#   ./run.sh demo     plan a GPT for 2×8 DGX-A100, then train the GPT example on 4 local CPU ranks
#   ./run.sh test     the test suite (extra arguments go to pytest)
# and, for maintainers: ./run.sh bench <script> [args]   runs benchmarks/<suite>/<script>.py
#                       ./run.sh lint                    ruff check . (.ci/run runs it before the tests)
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY="$VENV/bin/python"

setup() {
    [ -x "$PY" ] || python3 -m venv "$VENV"
    local stamp="$VENV/.autopar-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
        # torch first, pinned: the CPU build from the machine's local wheel. A looser requirement would
        # pull the newest CUDA build (several GB) from the registry.
        "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
        "$PY" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test,bench]"
        touch "$stamp"
    fi
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    demo) setup; exec "$PY" examples/demo.py "$@" ;;
    test)
        setup
        set +e
        "$PY" -m pytest -q "$@"
        rc=$?
        [ $rc -eq 5 ] && echo "run.sh: pytest collected no tests: that is a failure" >&2
        exit $rc ;;
    lint) setup; exec "$VENV/bin/ruff" check . "$@" ;;
    bench)
        setup
        script="${1:?usage: ./run.sh bench <script> [args]  (benchmarks/README.md lists them)}"; shift
        matches=(benchmarks/*/"$script".py)
        [ -f "${matches[0]}" ] || { echo "run.sh: no benchmarks/<suite>/$script.py (see benchmarks/README.md)" >&2; exit 2; }
        exec "$PY" "${matches[0]}" "$@" ;;
    *) echo "usage: ./run.sh demo | test [pytest args] | lint | bench <script> [args]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The two commands a new user needs (each installs what it needs into .venv first):
#   ./run.sh demo     plan a GPT for 2×8 DGX-A100, then train a GPT built on the meta device in shards on 4 CPU ranks
#   ./run.sh test     the test suite, slow tier left out (extra arguments go to pytest; see run_tests)
#   ./run.sh test --slow    the opt-in slow tier alone (.ci/run runs it after the suite)
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

# The suite in two pytest processes side by side (tests/conftest.py): the process-group tests
# (-m distributed), one launch at a time, stream to the terminal; the fast tier (-m "not distributed") runs
# beside them into a log printed after them. Exit code: the first lane's failure (5, no tests, only when
# neither lane ran one); a last line totals both. With -m/--markexpr among the arguments, or
# AUTOPAR_TEST_LANES=1: one plain pytest run.
# Tiers: tests marked `slow` are opt-in. Without --slow the run leaves them out ("not slow"); with --slow it
# runs them alone ("slow"). A -m expression of your own is combined with the tier ("(EXPR) and not slow")
# unless it names `slow` itself.
run_tests() {
    local tier="not slow" user_mark="" mark
    local args=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --slow) tier="slow" ;;
            -m|--markexpr) user_mark="${2:?run.sh: -m needs an expression}"; shift ;;
            -m*) user_mark="${1#-m}" ;;
            --markexpr=*) user_mark="${1#--markexpr=}" ;;
            *) args+=("$1") ;;
        esac
        shift
    done
    set -- ${args[@]+"${args[@]}"}
    if [ -n "$user_mark" ]; then
        AUTOPAR_TEST_LANES=1
        case "$user_mark" in *slow*) mark="$user_mark" ;; *) mark="($user_mark) and $tier" ;; esac
    fi
    if [ "${AUTOPAR_TEST_LANES:-2}" = 1 ]; then
        "$PY" -m pytest -q -m "${mark:-$tier}" "$@"
        return
    fi
    local dist_rc fast_rc
    LOGS="$(mktemp -d "${TMPDIR:-/tmp}/autopar-test-lanes.XXXXXX")"
    "$PY" -m pytest -q -m "not distributed and $tier" -o cache_dir=.pytest_cache/fast-tier "$@" >"$LOGS/fast" 2>&1 &
    FAST_LANE=$!  # global: the EXIT trap (Ctrl-C too) stops it and removes the logs
    trap 'kill "$FAST_LANE" 2>/dev/null; rm -rf "$LOGS"' EXIT
    echo "run.sh: the process-group tests (-m \"distributed and $tier\") below; the rest runs beside them, printed after"
    PYTHONUNBUFFERED=1 "$PY" -m pytest -q -m "distributed and $tier" "$@" 2>&1 | tee "$LOGS/dist"
    dist_rc=${PIPESTATUS[0]}
    wait "$FAST_LANE"
    fast_rc=$?
    echo "======== -m \"not distributed and $tier\", run beside the above ========"
    cat "$LOGS/fast"
    "$PY" - "$LOGS/dist" "$LOGS/fast" <<'EOF_PY'
import re
import sys

totals = dict.fromkeys(("passed", "failed", "skipped"), 0)
for path in sys.argv[1:]:
    summaries = [line for line in open(path, errors="replace") if re.search(r"\bin [0-9.]+s\b", line)]
    for count, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summaries[-1] if summaries else ""):
        totals["failed" if word.startswith("error") else word] += int(count)
print(f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
EOF_PY
    for rc in "$dist_rc" "$fast_rc"; do
        [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && return "$rc"
    done
    [ "$dist_rc" -eq 5 ] && [ "$fast_rc" -eq 5 ] && return 5
    return 0
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    demo) setup; exec "$PY" examples/demo.py "$@" ;;
    test)
        setup
        set +e
        run_tests "$@"
        rc=$?
        [ $rc -eq 5 ] && echo "run.sh: pytest collected no tests: that is a failure (tests marked slow run with --slow)" >&2
        exit $rc ;;
    lint) setup; exec "$VENV/bin/ruff" check . "$@" ;;
    bench)
        setup
        script="${1:?usage: ./run.sh bench <script> [args]  (benchmarks/README.md lists them)}"; shift
        matches=(benchmarks/*/"$script".py)
        [ -f "${matches[0]}" ] || { echo "run.sh: no benchmarks/<suite>/$script.py (see benchmarks/README.md)" >&2; exit 2; }
        exec "$PY" "${matches[0]}" "$@" ;;
    *) echo "usage: ./run.sh demo | test [--slow] [pytest args] | lint | bench <script> [args]" >&2; exit 2 ;;
esac

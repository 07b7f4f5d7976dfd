"""The test tiers: ``./run.sh test`` leaves the opt-in ``slow`` tier out, ``--slow`` runs it alone, a -m of
one's own is combined with the tier, pytest's exit code 5 (no tests) is a failure in every lane, and no parity
test is opt-in.

run.sh's ``run_tests`` is run by bash as written, with ``PY`` a stub that records its arguments and exits
with the code the test asks for, so the lanes' marker expressions and exit codes are checked without pytest.
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARITY_WORDS = re.compile(r"parity|single_device|one_device|negative_control")


def run_tests(tmp_path, args: list[str], exit_code: int = 0, lanes: str = "2") -> tuple[int, list[str]]:
    """(run_tests's exit code, the -m expression of every pytest call, in call order)."""
    body = re.search(r"^run_tests\(\) \{.*?^\}", (ROOT / "run.sh").read_text(), re.M | re.S).group(0)
    log = tmp_path / "calls"
    stub = tmp_path / "py"
    stub.write_text(f'#!/usr/bin/env bash\n[ "$1 $2" = "-m pytest" ] && shift 2\n'  # "$PY" -m pytest -m EXPR ...
                    f'while [ $# -gt 0 ]; do [ "$1" = -m ] && echo "$2" >> {log}; shift; done\nexit {exit_code}\n')
    stub.chmod(0o755)
    script = f'set -uo pipefail\nPY={stub}\n{body}\nrun_tests "$@" >/dev/null 2>&1\n'
    env = {"AUTOPAR_TEST_LANES": lanes, "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    rc = subprocess.run(["bash", "-c", script, "run.sh", *args], env=env).returncode
    calls = log.read_text().splitlines() if log.exists() else []
    return rc, calls


def test_the_default_run_leaves_the_slow_tier_out(tmp_path):
    rc, marks = run_tests(tmp_path, [])
    assert rc == 0 and sorted(marks) == ["distributed and not slow", "not distributed and not slow"]


def test_slow_runs_the_slow_tier_alone_in_both_lanes(tmp_path):
    rc, marks = run_tests(tmp_path, ["--slow", "tests/test_zoo.py"])
    assert rc == 0 and sorted(marks) == ["distributed and slow", "not distributed and slow"]


@pytest.mark.parametrize("args,expected", [
    (["-m", "not distributed and not browser"], "(not distributed and not browser) and not slow"),
    (["-mnot browser"], "(not browser) and not slow"),
    (["--markexpr=distributed", "--slow"], "(distributed) and slow"),
    (["-m", "slow and distributed"], "slow and distributed"),  # names the tier itself: taken as written
])
def test_an_own_marker_expression_is_combined_with_the_tier(tmp_path, args, expected):
    rc, marks = run_tests(tmp_path, args)
    assert rc == 0 and marks == [expected]


def test_no_tests_is_a_failure_in_every_lane(tmp_path):
    assert run_tests(tmp_path, [], exit_code=5)[0] == 5, "both lanes empty"
    assert run_tests(tmp_path, ["--slow"], exit_code=5)[0] == 5, "the slow tier empty"
    assert run_tests(tmp_path, [], exit_code=5, lanes="1")[0] == 5, "one lane"
    assert run_tests(tmp_path, [], exit_code=1)[0] == 1, "a failure is a failure"


def slow_marked_tests() -> list[str]:
    """module::function for every test function decorated with pytest.mark.slow."""
    out = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any("mark.slow" in ast.unparse(d) for d in node.decorator_list):
                out.append(f"{path.stem}::{node.name}")
    return out


def test_no_parity_test_is_opt_in():
    """The default run keeps every parity suite: a slow-marked parity test or negative control would leave it."""
    slow = slow_marked_tests()
    assert slow, "the walk found the slow tier"
    assert not [name for name in slow if PARITY_WORDS.search(name)], slow
    assert PARITY_WORDS.search("test_zoo::test_zoo_training_matches_single_device")  # negative control

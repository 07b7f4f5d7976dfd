"""Every file the CLI reads fails with exit code 1 and one stderr line on bad bytes, never a traceback.

Files: a plan (`autopar show FILE`), a cluster (`autopar plan ... --cluster FILE`), a model factory
(`autopar plan FILE.py:factory`). Bad bytes: binary, UTF-16, truncated JSON, empty, a directory, and
wrong JSON types: every field of a real plan and cluster, down to three levels, replaced in turn by a
value of another type. Negative control: the unedited files succeed (exit 0). One case runs the real
``autopar`` console script in a subprocess.
"""
import contextlib
import copy
import io
import json
import subprocess
import sys

import pytest

import autopar
from autopar.cli import main
from tests.models import make_mlp

FACTORY = "tests/models.py:make_mlp"


@pytest.fixture(scope="module")
def good():
    model, batch = make_mlp()
    plan = json.loads(autopar.plan(model, autopar.Cluster.local(2), batch).to_json())
    return {"plan": plan, "cluster": json.loads(autopar.Cluster.local(2).to_json())}


def command(kind: str, path) -> list[str]:
    return ["show", str(path)] if kind == "plan" else ["plan", FACTORY, "--cluster", str(path)]


def run(args: list[str]) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(args)
    return code, err.getvalue()


def assert_one_line_error(code: int, err: str, case) -> None:
    assert code == 1, (case, code, err[-400:])
    assert err.count("\n") == 1 and err.startswith("autopar: error: "), (case, err[-400:])


def wrong_types(root: dict, path=(), depth: int = 3):
    """(path, document with the value at path replaced by one of another type), for every path."""
    node = root
    for key in path:
        node = node[key]
    for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
        bad = [1] if isinstance(value, str) else "x"
        changed = copy.deepcopy(root)
        target = changed
        for k in path:
            target = target[k]
        target[key] = bad
        yield path + (key,), changed
        if isinstance(value, (dict, list)) and value and len(path) + 1 < depth:
            yield from wrong_types(root, path + (key,), depth)


def test_negative_control_good_files_succeed(good, tmp_path):
    for kind, document in good.items():
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps(document))
        assert run(command(kind, path))[0] == 0, kind


@pytest.mark.parametrize("kind", ["plan", "cluster"])
@pytest.mark.parametrize("bytes_case", ["binary", "utf16", "truncated", "empty", "directory"])
def test_bad_bytes_in_a_json_file(good, tmp_path, kind, bytes_case):
    text = json.dumps(good[kind])
    data = {"binary": bytes(range(256)) * 4, "utf16": text.encode("utf-16"),
            "truncated": text.encode()[:len(text) // 2], "empty": b""}
    path = tmp_path / "file.json"
    if bytes_case == "directory":
        path.mkdir()
    else:
        path.write_bytes(data[bytes_case])
    assert_one_line_error(*run(command(kind, path)), (kind, bytes_case))


@pytest.mark.parametrize("kind", ["plan", "cluster"])
def test_every_field_of_the_wrong_type(good, tmp_path, kind):
    path = tmp_path / "file.json"
    cases = 0
    for where, document in wrong_types(good[kind]):
        path.write_text(json.dumps(document))
        code, err = run(command(kind, path))
        if code != 0:  # a field nothing reads may take any value (e.g. a plan's "planner" notes)
            assert_one_line_error(code, err, where)
        cases += 1
    assert cases > (50 if kind == "plan" else 20)


def test_a_factory_file_that_is_not_python(tmp_path):
    path = tmp_path / "model.py"
    path.write_bytes(bytes(range(256)))
    assert_one_line_error(*run(["plan", f"{path}:make", "--cluster", "dgx-a100"]), "binary .py")


def test_the_console_script_exits_1_with_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    done = subprocess.run([sys.executable, "-m", "autopar.cli", "show", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "not UTF-8" in done.stderr, done.stderr


@pytest.mark.parametrize("kind", ["plan", "cluster"])
@pytest.mark.parametrize("special", ["/dev/zero", "fifo", "huge"])
def test_files_it_would_not_finish_reading_are_refused_before_reading(tmp_path, kind, special):
    """/dev/zero never ends, a FIFO blocks, a sparse file past the size limit is no plan: each is refused
    from its ``stat`` alone (a read of /dev/zero or the FIFO would not return)."""
    import os

    from autopar.ir.text_files import MAX_JSON_BYTES

    path = tmp_path / "file.json"
    if special == "fifo":
        os.mkfifo(path)
    elif special == "huge":
        with open(path, "wb") as f:
            f.truncate(MAX_JSON_BYTES + 1)
    else:
        path = special
    code, err = run(command(kind, path))
    assert_one_line_error(code, err, special)
    assert ("not a regular file" if special != "huge" else "more than any") in err, err

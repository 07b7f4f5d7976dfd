"""The ``autopar`` command: plan a model for a cluster, show a saved plan, profile a cluster, run the demo.

    autopar plan examples/gpt.py:make_gpt --cluster dgx-a100 --nodes 2 --html plan.html

Exit codes (for scripts): 0 ok; 1 an ``AutoparError`` (bad preset, model, plan file, ...), its message on
one stderr line and no traceback; 2 a usage error (argparse); 3 anything else, with its traceback.
stdout carries only the plan summary; progress and "wrote ..." lines go to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from autopar.errors import AutoparError
from autopar.profiling.profiler_device import KINDS as DEVICE_KINDS

EXIT_OK, EXIT_AUTOPAR_ERROR, EXIT_USAGE, EXIT_UNEXPECTED = 0, 1, 2, 3

EPILOG = """examples:
  autopar plan examples/gpt.py:make_gpt --cluster dgx-a100 --nodes 2 --html plan.html
  autopar plan mypkg.models:build --cluster cluster.json --out plan.json --trace trace.json
  autopar show plan.json --html plan.html
  autopar profile --nprocs 4 --out cluster.json --quick
  autopar demo

exit codes: 0 ok, 1 autopar error (one line on stderr), 2 usage error, 3 unexpected error (traceback)
"""

PLAN_EPILOG = """MODULE is a dotted module path importable from the current directory, or a path to a .py file;
FACTORY() must return (model, example_inputs). The model may live on the meta device.

examples:
  autopar plan examples/gpt.py:make_gpt --cluster dgx-a100 --nodes 2 --html plan.html
  autopar plan examples.gpt:make_gpt --cluster p3.16xlarge --nodes 8 --out plan.json --trace trace.json
  autopar plan mymodel.py:build --cluster cluster.json --out plan.json   # a cluster from `autopar profile`
"""


class FactoryError(AutoparError):
    """MODULE:FACTORY could not be imported, found, or called as documented."""


# ---- entry point -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default sys.argv[1:]), run the subcommand, return the exit code (module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check_args(parser, args)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return int(args.run(args) or EXIT_OK)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return EXIT_AUTOPAR_ERROR
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - the documented "anything else" exit code
        traceback.print_exc()
        return EXIT_UNEXPECTED


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="autopar", description="Auto-parallelize PyTorch models: plan, inspect, "
                                     "profile.", epilog=EPILOG, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("plan", help="plan MODULE:FACTORY for a cluster", epilog=PLAN_EPILOG, formatter_class=fmt)
    p.add_argument("factory", metavar="MODULE:FACTORY")
    p.add_argument("--cluster", required=True, metavar="PRESET|FILE",
                   help="a preset name (dgx-a100, dgx-h100, p3.16xlarge) or a cluster JSON file")
    p.add_argument("--nodes", type=int, help="nodes of the preset (default 1; presets only)")
    p.add_argument("--time-limit", type=float, help="seconds each ILP may take")
    p.add_argument("--optimizer", help="training optimizer, for memory (default adamw)")
    _add_outputs(p, json_out=True)
    p.set_defaults(run=cmd_plan)
    s = sub.add_parser("show", help="print a saved plan (and draw it)", formatter_class=fmt,
                       epilog="examples:\n  autopar show plan.json\n  autopar show plan.json --html plan.html "
                              "--trace trace.json")
    s.add_argument("plan", metavar="PLAN.json")
    _add_outputs(s, json_out=False)
    s.set_defaults(run=cmd_show)
    f = sub.add_parser("profile", help="measure this machine's compute and links into a cluster JSON",
                       formatter_class=fmt, epilog="examples:\n  autopar profile --nprocs 4 --out cluster.json "
                                                   "--quick\n  torchrun ... -m autopar.cli profile --out cluster.json")
    f.add_argument("--nprocs", type=int, help="local processes to measure with (default: WORLD_SIZE under "
                   "torchrun, else the number of cores)")
    f.add_argument("--out", required=True, help="where to write the cluster JSON")
    f.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (seconds, rougher fits)")
    f.add_argument("--device", choices=DEVICE_KINDS, default="auto", help="cuda: one GPU per rank "
                   "over NCCL, timed with CUDA events; auto (default): cuda when there is a GPU per rank")
    f.set_defaults(run=cmd_profile)
    d = sub.add_parser("demo", help="run examples/demo.py (plan GPT for 2×DGX-A100, train on 4 CPU ranks)",
                       formatter_class=fmt, epilog="examples:\n  autopar demo")
    d.set_defaults(run=cmd_demo)
    return parser


def _add_outputs(p: argparse.ArgumentParser, json_out: bool) -> None:
    if json_out:
        p.add_argument("--out", metavar="PLAN.json", help="save the plan (reload with `autopar show`)")
    p.add_argument("--html", metavar="REPORT.html", help="write the self-contained HTML picture of the plan")
    p.add_argument("--trace", metavar="TRACE.json", help="write the pipeline schedule as a Chrome trace (Perfetto)")
    p.add_argument("--force", action="store_true", help="replace existing --html/--trace files (otherwise an "
                   "existing file is an error and is left as it was)")


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Usage errors argparse cannot see on its own; parser.error exits with code 2."""
    if args.command == "plan":
        if args.nodes is not None and _is_cluster_file(args.cluster):
            parser.error("--nodes applies to presets only; a cluster file already says how many nodes it has")
        if args.nodes is not None and args.nodes < 1:
            parser.error(f"--nodes must be a positive integer, got {args.nodes}")
    if args.command in ("plan", "show"):
        named = [v for v in (getattr(args, "out", None), args.html, args.trace) if v]
        if len({os.path.abspath(v) for v in named}) < len(named):
            parser.error("--out, --html and --trace must name different files")
    if args.command == "profile" and args.nprocs is not None and args.nprocs < 1:
        parser.error(f"--nprocs must be a positive integer, got {args.nprocs}")


# ---- subcommands -----------------------------------------------------------------------------------

def cmd_plan(args) -> int:
    import autopar

    refuse_existing_outputs(args)  # before planning, which may take minutes
    cluster = load_cluster(args.cluster, args.nodes)
    model, example_inputs = call_factory(load_factory(args.factory), args.factory)
    options = {k: v for k, v in (("time_limit", args.time_limit), ("optimizer", args.optimizer)) if v is not None}
    with progress(f"planning {type(model).__name__} for {cluster.name} ({cluster.num_devices} devices)"):
        plan = autopar.plan(model, cluster, example_inputs, **options)
    print(plan.summary())
    write_outputs(plan, args)
    return EXIT_OK


def cmd_show(args) -> int:
    from autopar.plan import Plan

    refuse_existing_outputs(args)
    plan = Plan.from_json(args.plan)
    print(plan.summary())
    write_outputs(plan, args)
    return EXIT_OK


def cmd_profile(args) -> int:
    try:
        from autopar.profiling.profiler import profile_cluster
    except ModuleNotFoundError as e:
        if e.name not in ("autopar.profiling.profiler",):
            raise
        raise AutoparError("`autopar profile` needs autopar.profiling.profiler, which this installation lacks; "
                           "update autopar, or describe the cluster with a preset") from None
    # profile_cluster shows its own progress bar
    cluster = profile_cluster(nprocs=args.nprocs, quick=args.quick, out=args.out, device=args.device)
    print(f"wrote {args.out}: {cluster.name}, {cluster.num_devices} device(s) (use it with: autopar plan "
          f"MODULE:FACTORY --cluster {args.out})", file=sys.stderr)
    return EXIT_OK


def cmd_demo(args) -> int:
    candidates = [Path(__file__).resolve().parent.parent / "examples" / "demo.py", Path("examples") / "demo.py"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise AutoparError(f"the demo lives in a source checkout (examples/demo.py), not found at "
                           f"{[str(p) for p in candidates]}; run it from a clone of the autopar repository")
    # A child process, not an import: the demo starts ranks with multiprocessing, which must re-import the
    # demo's functions by module name in each child, as it does when the script runs on its own.
    return subprocess.run([sys.executable, str(path)], check=False).returncode


# ---- helpers ---------------------------------------------------------------------------------------

def _is_cluster_file(value: str) -> bool:
    return value.endswith(".json") or os.sep in value or os.path.isfile(value)


def load_cluster(value: str, nodes: int | None):
    """A preset name (with ``nodes``) or a cluster JSON file; errors are ClusterErrors naming the choices."""
    from autopar.hardware.cluster import Cluster

    if _is_cluster_file(value):
        return Cluster.from_json(value)
    return Cluster.preset(value, nodes=nodes if nodes is not None else 1)


def import_file(path: Path):
    """Import a .py file as a fresh module (registered in sys.modules, so dataclasses in it work)."""
    name = f"_autopar_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:  # bad bytes: not Python source
        del sys.modules[name]
        raise FactoryError(f"{str(path)!r} is not a Python source file ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); give a .py file defining the "
                           f"factory") from None
    return module


def load_factory(text: str):
    """Resolve "MODULE:FACTORY" (dotted path or .py file) to a callable; FactoryError says what is wrong."""
    module_name, sep, attr = text.rpartition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"expected MODULE:FACTORY (e.g. examples/gpt.py:make_gpt or mypkg.models:build), "
                           f"got {text!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise FactoryError(f"no such file {module_name!r} (from {text!r}); give a path to a .py file or a "
                               f"dotted module name")
        module = import_file(path)
    else:
        module = _import_dotted(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))[:12]
        raise FactoryError(f"{module_name} has no callable {attr!r}; callables there: {found}")
    return factory


def _import_dotted(name: str):
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise FactoryError(f"cannot import module {name!r} ({e}); give a module importable from the current "
                               f"directory or a path to a .py file") from None
        raise FactoryError(f"importing {name!r} failed: {e}; install the missing package") from None


def call_factory(factory, text: str):
    """Call FACTORY(); it must return (model: nn.Module, example_inputs); a lone tensor input is wrapped."""
    import torch

    result = factory()
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise FactoryError(f"{text}() must return (model, example_inputs) with an nn.Module first, got "
                           f"{type(result).__name__}"
                           + (f" of {len(result)}" if isinstance(result, (tuple, list)) else ""))
    model, inputs = result
    return model, (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def refuse_existing_outputs(args) -> None:
    """Without --force, an existing --html/--trace file is an AutoparError naming --force (checked again,
    atomically, when writing: ``text_files.write_new_text``)."""
    for path, what in ((args.html, "HTML report"), (args.trace, "schedule trace")):
        if path and not args.force and os.path.lexists(path) and not os.path.isdir(path):
            raise AutoparError(f"{what} {path!r} exists; autopar does not overwrite it: pass --force to replace "
                               f"it, or write to another path")


def write_outputs(plan, args) -> None:
    """Write whichever of --out, --html, --trace were given; an unwritable path is an AutoparError. --out
    replaces only an earlier plan file (``Plan.to_json``); --html and --trace never replace a file without
    --force, and are written whole or not at all."""
    from autopar.ir.text_files import write_new_text
    from autopar.views.trace import schedule_to_chrome_trace
    from autopar.views.visualize import plan_to_html

    def text_writer(make, what):
        return lambda p: write_new_text(p, make(), what, AutoparError, force=args.force)

    def trace_text() -> str:
        return json.dumps(schedule_to_chrome_trace(plan), indent=1) + "\n"

    writers = [(getattr(args, "out", None), plan.to_json, "plan (reload: autopar show)"),
               (args.html, text_writer(lambda: plan_to_html(plan), "HTML report"), "HTML report (open in a browser)"),
               (args.trace, text_writer(trace_text, "schedule trace"), "schedule trace (open in ui.perfetto.dev)")]
    for path, write, what in writers:
        if path:
            try:
                write(path)
            except OSError as e:
                raise AutoparError(f"cannot write {path!r}: {e.strerror}") from None
            print(f"wrote {path}: {what}", file=sys.stderr)


@contextlib.contextmanager
def progress(desc: str):
    """A live elapsed-time counter on stderr while the body runs (tqdm shows it only on a terminal), then one
    "done" line, so a long plan never looks hung and logs stay clean."""
    from tqdm import tqdm

    start = time.perf_counter()
    bar = tqdm(total=None, desc=desc, bar_format="{desc} … {elapsed}", file=sys.stderr, disable=None, leave=False)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.25):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        bar.close()
    print(f"{desc}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

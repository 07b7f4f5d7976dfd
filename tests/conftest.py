"""Shared test set-up: the repository root on sys.path (for ``examples``), quiet, deterministic torch, and the
test tiers.

Markers (registered in pyproject.toml):
  distributed  starts a process group (autopar.launch, torchrun, or an in-process gloo group)
  browser      needs chromium
  slow         opt-in: what a developer need not run on every change (memory-scale or multi-minute runs,
               a second world size of a case the default run already covers, whole-script smoke runs)
Tiers:
  ./run.sh test                 everything but ``slow`` (every parity suite included); <= 12 min on the
                                2-core machine, idle
  ./run.sh test --slow          the ``slow`` tier alone (``.ci/run`` runs it after the suite)
  ./run.sh test -m "not distributed and not browser"   the fast tier (no process groups, no chromium)
A -m expression is combined with the tier (``(EXPR) and not slow``) unless it names ``slow`` itself.
Never mark a parity test (or its negative control) ``slow``: ``tests/test_tiers.py`` checks it.
Tests mark themselves with ``@pytest.mark.distributed`` etc.; ``pytest_collection_modifyitems`` adds the marks
for the tests below, which start their process groups in a shared module-scoped fixture (one launch serves
many cases).

``./run.sh test`` runs the suite as two pytest processes side by side: ``-m distributed`` (one process group
at a time: launches on a 2-core machine are CPU-bound, and several at once would stretch collective
timeouts) and ``-m "not distributed"`` (the fast tier, on the core the launches leave idle while rank 0
plans). A test that starts processes without the mark would run beside a launch.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# module -> fixtures that start a process group: every test using one is `distributed`.
PROCESS_GROUP_FIXTURES = {
    "test_bad_inputs": {"mistakes"},
    "test_baselines": {"runs"},
    "test_checkpoint": {"runs"},
    "test_faults": {"dead_rank"},
    "test_local_data": {"runs"},
    "test_train_lm": {"two_then_one"},
    "test_parity": {"results"},
    "test_pipeline_parity": {"results"},
    "test_profiler": {"quick_profile"},
    "test_user_mistakes": {"one_rank", "two_ranks"},
}
# module -> tests that start processes themselves.
PROCESS_GROUP_TESTS = {
    "test_faults": {"test_a_stuck_rank_makes_its_peers_time_out_instead_of_hanging",
                    "test_a_plan_that_differs_on_one_rank_is_refused",
                    "test_a_script_calling_launch_at_import_time_is_told_to_add_the_main_guard"},
    "test_cli": {"test_profile_writes_the_cluster_file", "test_demo_runs_examples_demo",
                 "test_the_demo_trains_on_four_ranks_as_on_one_device"},
    "test_profiler": {"test_gpu_profile_uses_nccl_and_cuda_events"},
    "test_user_mistakes": {"test_launch_with_nccl_and_no_gpu_says_use_gloo",
                           "test_launch_of_a_lambda_says_define_it_at_module_level",
                           "test_launch_at_import_time_says_add_the_main_guard"},
}
BROWSER_TESTS = {"test_visualize": {"test_chromium_renders_a_non_blank_page"}}


def _listed(table: dict, module: str, name: str) -> bool:
    return name in table.get(module, ())


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        name = item.originalname
        if set(item.fixturenames) & PROCESS_GROUP_FIXTURES.get(module, set()) or \
                _listed(PROCESS_GROUP_TESTS, module, name):
            item.add_marker(pytest.mark.distributed)
        if _listed(BROWSER_TESTS, module, name):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def parity_runs(request) -> dict:
    """{case: every rank's results} for the parity cases of every module with a selected test
    (``tests/parity_launch.py``'s ``launch_modules``: one launch per world size serves all of them)."""
    from tests.parity_launch import launch_modules

    modules = {getattr(item, "module", None) for item in request.session.items}
    return launch_modules(sorted((m for m in modules if hasattr(m, "PARITY_CASES")), key=lambda m: m.__name__))

"""Every planner option mistake is one OptionError naming the option, the value and the valid values,
before any planning; so are compile's and launch's own arguments, and a model whose output shapes depend
on tensor values. No process group is needed: each check runs before any collective or spawn.

Negative control: the same options with valid values plan (``test_valid_values_of_every_option_plan``).
"""
import json

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.errors import CaptureError, OptionError, UsageError
from autopar.planner.options import PlanOptions
from tests.models import make_mlp

BAD_VALUES = [  # (options, words the message must hold)
    ({"stages": "two"}, ["stages='two'", "positive int"]),
    ({"stages": 0}, ["stages=0", "positive int"]),
    ({"stages": -1}, ["stages=-1"]),
    ({"stages": True}, ["stages=True"]),
    ({"stages": []}, ["stages=[]"]),
    ({"pin": "p_*"}, ["pin='p_*'", "dict {node-name glob: spec text}"]),
    ({"pin": {"p_*": "X(0)"}}, ["bad sharding spec 'X(0)'", "'S(0)R'"]),
    ({"pin": {"p_*": 0}}, ["pin={'p_*': 0}"]),
    ({"zero": True}, ["zero=True", "[0, 1, 2, 3]"]),
    ({"zero": 4}, ["zero=4"]),
    ({"zero": {"fc*": "2"}}, ["zero={'fc*': '2'}"]),
    ({"time_limit": -1}, ["time_limit=-1", "positive number of seconds"]),
    ({"time_limit": "60"}, ["time_limit='60'"]),
    ({"time_limit": float("nan")}, ["time_limit=nan"]),
    ({"bucket_bytes": -5}, ["bucket_bytes=-5", "positive number of bytes"]),
    ({"bucket_bytes": 0}, ["bucket_bytes=0"]),
    ({"microbatches": 0}, ["microbatches=0", "positive int"]),
    ({"microbatches": "4"}, ["microbatches='4'"]),
    ({"layers": 0}, ["layers=0"]),
    ({"virtual_stages": 0}, ["virtual_stages=0"]),
    ({"schedule": "1F1B"}, ["schedule='1F1B'", "'1f1b'"]),
    ({"optimizer": "adam_w"}, ["optimizer='adam_w'", "'adamw'"]),
    ({"debug": "yes"}, ["debug='yes'", "True or False"]),
    ({"recompute": "some"}, ["recompute='some'", "'full'"]),
]


@pytest.mark.parametrize("options,needles", BAD_VALUES, ids=[str(o) for o, _ in BAD_VALUES])
def test_a_bad_value_of_any_option_is_one_option_error(options, needles):
    with pytest.raises(OptionError) as err:
        PlanOptions(**options)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_an_unknown_option_name_says_did_you_mean():
    model, batch = make_mlp()
    with pytest.raises(OptionError, match="unknown option 'stage' \\(did you mean 'stages'\\?\\)"):
        autopar.plan(model, autopar.Cluster.local(2), batch, stage=2)
    with pytest.raises(OptionError, match="unknown option 'timout' \\(did you mean 'timeout'\\?\\)"):
        autopar.compile(model, autopar.Cluster.local(2), batch, timout=30)


@pytest.mark.parametrize("options,needles", [
    ({"pin": {"nothing_*": "RR"}}, ["pin glob 'nothing_*' matches no node", "'p_fc1_weight'"]),
    ({"zero": {"encoder.*": 2}}, ["zero glob 'encoder.*' matches no parameter", "'fc1.weight'"]),
    ({"recompute": {"blocks.*": "full"}}, ["recompute glob 'blocks.*' matches no layer", "'fc1'"]),
    ({"stages": 5}, ["stages=5 needs at least 5 devices", "has 2"]),
])
def test_options_that_match_nothing_in_the_model_are_refused(options, needles):
    model, batch = make_mlp()
    with pytest.raises(OptionError) as err:
        autopar.plan(model, autopar.Cluster.local(2), batch, time_limit=5, **options)
    message = str(err.value)
    assert "memory" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)


def test_valid_values_of_every_option_plan():
    """Negative control: the globs above, spelled to match, plan."""
    model, batch = make_mlp()
    plan = autopar.plan(model, autopar.Cluster.local(2), batch, time_limit=5, pin={"p_fc1_*": "RR"},
                        zero={"fc2.*": 0}, recompute={"fc1": "none"}, stages=1, bucket_bytes=2 ** 20)
    assert plan.stages[0].shardings["p_fc1_weight"].out == "RR"


@pytest.mark.parametrize("kwargs,error,needle", [
    ({"timeout": -1}, OptionError, "timeout=-1"),
    ({"timeout": "60"}, OptionError, "timeout='60'"),
    ({"plan": "plan.json"}, UsageError, "autopar.Plan.from_json(path)"),
    ({"share_with": torch.nn.Linear(2, 2)}, UsageError, "module returned by autopar.compile"),
])
def test_compile_arguments_are_checked_before_any_collective(kwargs, error, needle):
    model, batch = make_mlp()
    with pytest.raises(error) as err:
        autopar.compile(model, autopar.Cluster.local(1), batch, **kwargs)
    assert needle in str(err.value), str(err.value)


def test_compile_of_a_model_class_and_options_beside_a_plan():
    model, batch = make_mlp()
    with pytest.raises(UsageError, match="got the class MLP"):
        autopar.compile(type(model), autopar.Cluster.local(1), batch)
    plan = autopar.plan(model, autopar.Cluster.local(1), batch, time_limit=5)
    with pytest.raises(UsageError, match=r"planner options \['stages'\] would be ignored"):
        autopar.compile(model, autopar.Cluster.local(1), batch, plan=plan, stages=1)


class Nonzero(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 16)

    def forward(self, x, y):
        picked = (y > 0).nonzero()
        return self.fc(x)[picked[:, 0], picked[:, 1]].sum()


class BooleanMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 16)

    def forward(self, x, y):
        return (self.fc(x)[y > 0] ** 2).mean()


class MaskedByWhere(BooleanMask):
    def forward(self, x, y):
        mask = y > 0
        return (torch.where(mask, self.fc(x), 0) ** 2).sum() / mask.sum()


@pytest.mark.parametrize("model,op,line", [(Nonzero(), "aten.nonzero", "(y > 0).nonzero()"),
                                           (BooleanMask(), "aten.index.Tensor", "self.fc(x)[y > 0]")])
def test_ops_whose_output_shape_depends_on_values_name_the_op_and_the_line(model, op, line):
    _, batch = make_mlp()
    with pytest.raises(CaptureError) as err:
        autopar.plan(model, autopar.Cluster.local(2), batch, time_limit=5)
    message = str(err.value)
    assert op in message and line in message and "torch.where" in message, message
    plan = autopar.plan(MaskedByWhere(), autopar.Cluster.local(2), batch, time_limit=5)  # the fix plans
    assert plan.stages


def test_the_user_line_of_a_model_error_is_not_inside_the_standard_library():
    model, (x, _) = make_mlp()
    with pytest.raises(CaptureError) as err:
        autopar.plan(model, autopar.Cluster.local(2), (x,))
    assert "missing a required argument: 'y'" in str(err.value) and "inspect.py" not in str(err.value)


def no_rank() -> int:
    return 1


@pytest.mark.parametrize("args,kwargs,needle", [
    ((no_rank, 0), {}, "nprocs must be a positive int"),
    ((no_rank, "2"), {}, "nprocs must be a positive int"),
    ((no_rank, 2), {"backend": "glo"}, "backend='glo' is not a torch.distributed backend"),
    ((no_rank, 2), {"timeout": -1}, "timeout must be a positive number"),
    (("train", 2), {}, "fn must be a function that takes the rank"),
    ((no_rank, 2), {}, "no_rank() -> int cannot take 1 positional argument"),
    ((F.relu, 2, 1, 2, 3), {}, "cannot take 4 positional argument"),
])
def test_launch_arguments_are_checked_before_any_process_starts(args, kwargs, needle):
    with pytest.raises(UsageError) as err:
        autopar.launch(*args, **kwargs)
    assert needle in str(err.value), str(err.value)


def test_a_cluster_argument_given_as_an_option_names_the_cluster():
    model, batch = make_mlp()
    with pytest.raises(OptionError, match=r"memory_per_device is an argument of the cluster.*Cluster.local"):
        autopar.plan(model, autopar.Cluster.local(2), batch, memory_per_device=2 ** 30)


def test_plan_from_json_of_a_dict_says_pass_text():
    model, batch = make_mlp()
    text = autopar.plan(model, autopar.Cluster.local(2), batch, time_limit=5).to_json()
    with pytest.raises(autopar.errors.PlanError, match=r"JSON text or a file path, got a dict; .*json.dumps"):
        autopar.Plan.from_json(json.loads(text))
    assert autopar.Plan.from_json(text).to_json() == text  # negative control

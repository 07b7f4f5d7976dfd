"""autopar: a graph compiler that auto-parallelizes PyTorch models for training.

    plan = autopar.plan(model, cluster, example_inputs)      # inspect: plan.summary(), plan.to_json()
    pm = autopar.compile(model, cluster, example_inputs)     # on every rank: pm.train_step(*batch)
"""
from autopar.api import compile, plan
from autopar.errors import AutoparError
from autopar.hardware.cluster import Cluster
from autopar.launch import launch
from autopar.plan import Plan
from autopar.runtime.checkpoint import export_state_dict
from autopar.runtime.initialize import init_weights

__all__ = ["plan", "compile", "launch", "Cluster", "Plan", "AutoparError", "export_state_dict", "init_weights"]
__version__ = "0.1.0"

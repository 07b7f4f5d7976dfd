"""The DP's stages re-chosen at another microbatch count (``inter_op.restaged``): a (data, tensor) mesh whose data
axis cannot split the smallest reference microbatch is also solved at the smallest one it can
(``inter_op.own_reference``), so Megatron's dp × tp stage at one sequence per replica is priced. No process group."""
import torch

import autopar
from autopar.passes.batch_dims import batch_dims, rescale
from autopar.passes.capture import capture
from autopar.passes.cluster_layers import cluster_layers, find_repeated_blocks
from autopar.passes.inter_op import ChosenStage, MeshOption, StageChoice, StageCosts, own_reference, restaged
from autopar.passes.intra_op_groups import is_light
from autopar.planner.options import PlanOptions, training_spec
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)
BATCH = 64
DP_TP = MeshOption((1, 4), (2, 2))
ONE_AXIS = MeshOption((1, 4), (1, 4))


def test_only_a_data_axis_that_cannot_split_the_smallest_reference_gets_its_own():
    """lcm(data axis, smallest reference), where it divides the batch; one axis, or a smallest reference the data
    axis already splits, gets none (controls)."""
    assert own_reference(DP_TP, 1, 64) == 2
    assert own_reference(MeshOption((1, 8), (4, 2)), 2, 64) == 4
    assert own_reference(ONE_AXIS, 1, 64) is None
    assert own_reference(DP_TP, 2, 64) is None, "the smallest already splits over the data axis"
    assert own_reference(MeshOption((2, 8), (8, 2)), 1, 12) is None, "8 does not divide the batch"


def _costs(rescaled: bool):
    """(StageCosts of the model at the driver's two references 1 and 8 on 4 local devices, restricted to the two
    logical meshes of one 1 × 4 submesh, able to solve other references when ``rescaled``; its layers)."""
    with torch.device("meta"):
        model = GPT(CFG)
    graph = capture(model, make_batch(CFG, BATCH, device="meta"))
    blocks = find_repeated_blocks(graph)
    layers = cluster_layers(graph, blocks, None, is_light)
    costs = StageCosts({b0: rescale(graph, BATCH // b0) for b0 in (1, 8)}, layers, blocks, autopar.Cluster.local(4),
                       training_spec(graph, PlanOptions()), batch_dims(graph), 60.0,
                       rescaled=(lambda b0: rescale(graph, BATCH // b0)) if rescaled else None)
    costs.options = [ONE_AXIS, DP_TP]
    return costs, layers


def test_restaged_prices_the_dp_tp_mesh_at_its_own_reference_and_moves_the_stage_there():
    """The DP's one stage on (1, 4) at B = 16, re-staged at B = 32 (microbatch 2): (2, 2) is solved at microbatch 2
    too, where its data axis splits the batch, which prices it below what the reference at 1 gave, and the stage
    moves to it. Control: without that solve (no rescaled graphs) no solution of (2, 2) splits a microbatch of 2,
    the two meshes price alike and the stage stays on (1, 4)."""
    for rescaled, expected in ((True, DP_TP), (False, ONE_AXIS)):
        costs, layers = _costs(rescaled)
        choice = StageChoice(16, [ChosenStage(0, layers.count - 1, ONE_AXIS, 1)], 0.0)
        before = float(costs.table(BATCH, 32, 1)[0, layers.count - 1, 1, 0])
        again = restaged(costs, choice, BATCH, 32, "1f1b")
        after = float(costs.table(BATCH, 32, 1)[0, layers.count - 1, 1, 0])
        splits = [(c.reference_batch, c.batch_split) for c in costs.costs(1)]
        assert again.microbatches == 32 and [s.option for s in again.stages] == [expected], (rescaled, splits)
        assert ((2, 2) in splits) == rescaled and (after < before) == rescaled, (splits, before, after)
        assert not any(b0 == 1 and split > 1 for b0, split in splits), "no batch split at microbatch 1"

"""The stage DP's reference microbatches (``inter_op.references_of``): a (data, tensor) mesh whose data axis cannot
split the smallest reference is also solved at the smallest microbatch it can split, so Megatron's dp × tp stage at
one sequence per replica is priced. No process group."""
import torch

import autopar
from autopar.passes.batch_dims import batch_dims, rescale
from autopar.passes.capture import capture
from autopar.passes.cluster_layers import cluster_layers, find_repeated_blocks
from autopar.passes.inter_op import MeshOption, StageCosts, outer_axis_microbatches, references_of
from autopar.passes.intra_op_groups import is_light
from autopar.planner.options import PlanOptions, training_spec
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)
BATCH = 64
DP_TP = MeshOption((1, 4), (2, 2))
ONE_AXIS = MeshOption((1, 4), (1, 4))


def test_only_meshes_whose_data_axis_cannot_split_the_smallest_reference_get_their_own():
    """(2, 2) and (4, 2) add the smallest size their data axis divides; one axis, or a smallest reference the data
    axis already splits, adds nothing (control); nothing is added at or beyond the largest reference."""
    assert references_of(DP_TP, [1, 2, 4, 8]) == [1, 2, 8]
    assert references_of(MeshOption((1, 8), (4, 2)), [1, 2, 4, 8]) == [1, 4, 8]
    assert references_of(ONE_AXIS, [1, 2, 4, 8]) == [1, 8]
    assert references_of(DP_TP, [2, 4, 8]) == [2, 8], "the smallest already splits over the data axis"
    assert outer_axis_microbatches([DP_TP, ONE_AXIS], [1, 2, 4, 8]) == [2]
    assert outer_axis_microbatches([DP_TP, ONE_AXIS], [2, 4, 8]) == []
    assert outer_axis_microbatches([MeshOption((2, 8), (8, 2))], [1, 2, 4, 8]) == [], "8 is the largest already"


def _costs(references: list[int]):
    """(StageCosts of the model at ``references`` on 4 local devices, its layers)."""
    with torch.device("meta"):
        model = GPT(CFG)
    graph = capture(model, make_batch(CFG, BATCH, device="meta"))
    blocks = find_repeated_blocks(graph)
    layers = cluster_layers(graph, blocks, None, is_light)
    return StageCosts({b0: rescale(graph, BATCH // b0) for b0 in references}, layers, blocks,
                      autopar.Cluster.local(4), training_spec(graph, PlanOptions()), batch_dims(graph), 60.0), layers


def _dp_tp_price(references: list[int]) -> tuple[float, list[tuple[int, int]]]:
    """The whole model as one stage on (2, 2) at B = 32 (microbatch 2), priced from ``references``; and each of the
    option's solutions as (reference microbatch, batch split)."""
    costs, layers = _costs(references)
    costs.options = [DP_TP]
    table = costs.table(BATCH, 32, 1)
    return float(table[0, layers.count - 1, 0, 0]), [(c.reference_batch, c.batch_split) for c in costs.costs(0)]


def test_the_dp_tp_mesh_is_priced_with_its_data_axis_splitting_a_small_microbatch():
    """With references 1 and 8 (the driver's shared pair), (2, 2) at microbatch 2 is priced only from the solution at
    1, whose data axis shards no batch; with its own reference 2 it is priced from a solution that splits the batch
    in two there, faster. Control: without it, no solution of the option splits a microbatch of 2."""
    with_own, solutions = _dp_tp_price([1, 2, 8])
    shared_only, old_solutions = _dp_tp_price([1, 8])
    assert (2, 2) in solutions, solutions
    assert not any(b0 <= 2 and split == 2 for b0, split in old_solutions), old_solutions
    assert with_own < shared_only, (with_own, shared_only)


def test_restaged_puts_each_stage_on_the_logical_mesh_its_new_microbatch_prices_cheapest():
    """The DP's one stage on (1, 4) at B = 16, re-staged at B = 32 (microbatch 2): on (2, 2) with that mesh's own
    reference (cheapest there), and kept on (1, 4) without it, where the two price alike (control)."""
    from autopar.passes.inter_op import ChosenStage, StageChoice, restaged

    for references, expected in (([1, 2, 8], DP_TP), ([1, 8], ONE_AXIS)):
        costs, layers = _costs(references)
        costs.options = [ONE_AXIS, DP_TP]
        choice = StageChoice(16, [ChosenStage(0, layers.count - 1, ONE_AXIS, 1)], 0.0)
        again = restaged(costs, choice, BATCH, 32, "1f1b")
        assert again.microbatches == 32 and [s.option for s in again.stages] == [expected], references

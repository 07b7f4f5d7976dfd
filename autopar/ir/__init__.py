"""The IR: the captured graph's types and the vocabulary every layer shares. It imports nothing from autopar
but ``autopar.errors``, ``autopar.placement`` and ``autopar.redistribute`` (the spec vocabulary, which the
layering test ranks with the IR).

A package rather than one module because its parts are read by different layers for different reasons:

    graph     ModelGraph, PlaceholderInfo   the captured model (built by passes.capture)
    ops       OpView, node_signature,       what rules, cost models, codegen and the runtime read of a node
              is_free_view, requires_grad_nodes
    schedule  stage_order, device_order,  the pipeline order the runtime executes and the planner replays
              simulate_schedule             (1F1B, GPipe, interleaved 1F1B)
    shard_boxes forward_pieces, wire_spec   which rank sends which slice across stages (runtime + cost model)
    units     fmt_bytes, fmt_seconds        quantities in messages and reports
    precision PrecisionPolicy, POLICIES     dtypes of compute and gradient reduction, loss scaling
    buckets   deferrable_syncs, sync_buckets  the gradient-sync buckets planner and runtime both build

Dependencies point one way: api -> driver -> passes -> cost_models -> (Plan, Cluster) -> IR, and the
runtime -> (Plan, Cluster) + IR. ``tests/test_architecture.py`` enforces it.
"""

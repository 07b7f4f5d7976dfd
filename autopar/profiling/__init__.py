"""Measuring a machine and the model against it: the profiler (a ``Cluster`` from timed probes over
``autopar.launch``) and the statistics that compare predictions with measurements.

    profiler           profile_cluster         n local ranks measured at once -> Cluster (``autopar profile``)
    profiler_device    ProbeDevice, KINDS      where probes run (CPU/gloo or GPU/NCCL) and how they are timed
    profiler_training  measure_rank, ...       collectives, op overhead and matmul factor in training conditions
    profiler_pipeline  measure_pipeline, ...   the pipeline runtime's host time per (chunk, microbatch)
    probes             seconds_per_call, fit_alpha_beta, ...   the timing primitives and α-β fit they share
    fidelity           spearman, peak_allocated_bytes   prediction-vs-measurement statistics (benchmarks, tests)

A tool on top of the stack: it compiles probe models with ``autopar.compile``, so nothing below the public
API imports it (``Cluster.profile`` is a deferred alias, the one documented exception).
"""

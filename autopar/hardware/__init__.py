"""What autopar plans for: the cluster description, plain frozen data the planner and cost models read.

    cluster   Cluster                        the 2-D device mesh and its costs, validated (JSON in and out)
    links     Link, CollectiveFit            the interconnect classes and measured α-β fits
    presets   PRESETS, preset, local_cpu     described GPU clusters and this machine's CPU ranks as a
                                             cluster's fields, each constant with its source

One way: cluster -> presets -> links (presets return plain fields; ``Cluster.preset``/``Cluster.local`` build
the Cluster). It imports nothing else from autopar but ``autopar.errors``. The profiler, which measures a
machine into a ``Cluster``, lives above the public API in ``autopar.profiling``.
"""

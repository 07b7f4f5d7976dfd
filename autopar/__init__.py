"""autopar: auto-parallelize PyTorch models (intra-op sharding by ILP, pipeline stages by DP)."""

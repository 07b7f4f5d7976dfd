"""Data for training runs: a resumable, re-shardable sampler and byte-level text samples.

``GlobalSampler`` orders each epoch by a seeded permutation of the whole data set and keeps one global
cursor, so a run saved at any step resumes on any number of data shards (``pm.data_shard``) with no
sample seen twice or skipped. ``TextSamples`` cuts local text files into fixed-length token samples with
a byte-level tokenizer that needs no download.
"""
from autopar.data.sampler import GlobalSampler
from autopar.data.text import ByteTokenizer, TextSamples

__all__ = ["GlobalSampler", "ByteTokenizer", "TextSamples"]

"""The variable partitioners a job names, without TensorFlow.

`strategy.make_partitioner` makes TensorFlow's partitioner from a name;
`job.JobConfig` and the launch script's `--partitioner` check the name before
TensorFlow loads.
"""

from __future__ import annotations

# `min_size` / `max_size`: shards of `shard_bytes`, at most one per ps
# (`MinSizePartitioner` / `MaxSizePartitioner`); `fixed`: one shard per ps
# (`FixedShardsPartitioner`).
PARTITIONERS = ("min_size", "max_size", "fixed")
# A shard smaller than this is not worth its RPC: TensorFlow's own suggested
# value for `MinSizePartitioner` (256 KiB).
DEFAULT_MIN_SHARD_BYTES = 256 << 10

"""Tensor parallelism inside a replica: the model split over shard processes (docs/serving.md#tensor-parallelism).

``group`` holds the collectives the sharded layers call; ``sharding`` checks that a model splits;
``shards`` starts the worker processes and drives them from rank 0 (the engine process);
``worker`` is a worker process's entry.
"""

from tokenmill.parallel.group import TensorParallelGroup, single_process_group
from tokenmill.parallel.sharding import SplitInput, TensorParallelError, check_shardable

__all__ = ["SplitInput", "TensorParallelError", "TensorParallelGroup", "check_shardable", "single_process_group"]

"""Load balancing across data-parallel ranks: workload model, partitioning, micro-batch packing."""

from yatt.balance.partition import (
    PARTITIONERS,
    get_partitioner,
    greedy_partition,
    imbalance,
    karmarkar_karp,
)
from yatt.balance.workload import sample_workload

__all__ = [
    "PARTITIONERS",
    "get_partitioner",
    "greedy_partition",
    "imbalance",
    "karmarkar_karp",
    "sample_workload",
]

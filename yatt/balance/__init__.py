"""Load balancing across data-parallel ranks: workload model, partitioning, DP exchange, micro-batch packing."""

from yatt.balance.exchange import Plan, exchange, gather_lengths, plan_rebalance, rebalance, restore_order
from yatt.balance.micro_batches import micro_batch_rows, pack_by_tokens, padded_tokens
from yatt.balance.partition import PARTITIONERS, get_partitioner, greedy_partition, imbalance, karmarkar_karp
from yatt.balance.workload import sample_workload

__all__ = [
    "Plan",
    "exchange",
    "gather_lengths",
    "micro_batch_rows",
    "pack_by_tokens",
    "padded_tokens",
    "plan_rebalance",
    "rebalance",
    "restore_order",
    "PARTITIONERS",
    "get_partitioner",
    "greedy_partition",
    "imbalance",
    "karmarkar_karp",
    "sample_workload",
]

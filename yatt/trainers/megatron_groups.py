"""What the ranks of one megatron model-parallel group agree on around a pass: that they were handed the same
batch, and the last pipeline stage's outputs (log-probs, loss sums), which only that stage computes.

Both run over megatron's own groups with tensors on the rank's device (its groups are NCCL-only on GPUs), as the
model's tensor and pipeline collectives do; yatt's metadata collectives stay in yatt.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from yatt.tensors import TokenBatch


def from_last_stage(pp: int, device: torch.device, obj: Any) -> Any:
    """The last pipeline stage's `obj` on every stage of this rank's pipeline (of `pp` stages)."""
    if pp == 1:
        return obj
    from megatron.core import parallel_state as ps

    box = [obj]
    dist.broadcast_object_list(
        box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group(), device=device
    )
    return box[0]


def outputs_from_last_stage(pp: int, device: torch.device, outputs: list) -> list:
    """The last stage's per-micro-batch outputs (rows, log-probs or values, entropies or None), on the host, on
    every stage of this rank's pipeline."""
    return from_last_stage(pp, device, [(r, lp.cpu(), e if e is None else e.cpu()) for r, lp, e in outputs])


def check_same_batch(batch: TokenBatch, group_size: int, device: torch.device) -> None:
    """The ranks of one model-parallel (TP x PP = `group_size`) group must compute on the same samples; a mismatch
    would silently mix different sequences inside one forward. A fingerprint of the batch, compared by min and
    max over the group, catches it."""
    if group_size == 1:
        return
    from megatron.core import parallel_state as ps

    ids = batch.input_ids.double()
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.float64).reshape(ids.shape)
    sums = [float(ids.shape[0]), float(ids.shape[1]), float((ids * weights).sum()), float(batch.mask.sum())]
    fingerprint = torch.tensor([*sums, batch.temperature], dtype=torch.float64, device=device)
    # the max of (x, -x) gives max and min in one all-reduce
    both = torch.cat([fingerprint, -fingerprint])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ps.get_model_parallel_group())
    if not torch.equal(both[: len(fingerprint)], -both[len(fingerprint) :]):
        raise RuntimeError(
            "the ranks of one tensor/pipeline-parallel group were handed different batches; "
            "they must train on the same samples (one data-parallel rank's)"
        )

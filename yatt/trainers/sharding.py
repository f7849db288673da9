"""`trainer.torch.parallel`: how the ranks hold the torch backend's model, a transform applied once it is built.

- ddp: every rank holds the whole model, its gradients and AdamW's moments (~16 bytes a parameter in float32);
  DistributedDataParallel all-reduces the gradients. Checkpoints store the state once, from rank 0.
- fsdp2: torch's `fully_shard` (FSDP2): each rank holds 1/N of every parameter, gradient and moment as a DTensor
  sharded on dim 0. Each decoder layer (the classes the model's `_no_split_modules` names) is a unit whose
  parameters are all-gathered for its forward and backward and freed after (`reshard_after_forward`); the
  scorer around the model is the root unit, holding the rest (embeddings, final norm, output head). Gradients
  are reduce-scattered, averaged over ranks as DDP averages them. Every forward is then a collective: ranks run
  the same number of them, also without gradients (`TorchTrainer._per_token` pads with empty passes). Each rank
  checkpoints its own rows of each DTensor, which a resume on another number of ranks cuts again
  (yatt.checkpoint.snapshot), and weights leave one parameter at a time, gathered (`full`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from yatt.distributed import World
from yatt.trainers.torch_config import TorchConfig


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the submodules of the classes its `_no_split_modules` names (a Hugging Face
    model's own list of what must not be split across devices; its decoder layers, a VL model's vision layers)."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"trainer.torch.parallel=fsdp2: {type(module).__name__} names no decoder layer class "
            "(_no_split_modules), so yatt cannot tell which blocks to shard one by one"
        )
    return layers


def fully_shard_model(module: nn.Module, scorer: nn.Module, world: World, cfg: TorchConfig) -> None:
    """FSDP2 in place: each decoder layer of `module`, then `scorer` (which holds `module`) as the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    on_gpu = world.device.type == "cuda"
    if cfg.cpu_offload and not on_gpu:
        raise ValueError("trainer.torch.cpu_offload keeps a GPU run's shards in host memory; this run is on CPU")
    bf16 = on_gpu or cfg.autocast == "bfloat16"  # CPU: float32 unless trainer.torch.autocast says otherwise
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options: dict[str, Any] = {
        "mesh": init_device_mesh(world.device.type, (world.size,)),
        "mp_policy": mixed or MixedPrecisionPolicy(),
        **({"offload_policy": CPUOffloadPolicy()} if cfg.cpu_offload else {}),
    }
    # DDP starts every rank from rank 0's weights; fully_shard keeps each rank's own rows, so a weight initialised at
    # random (LoRA's A, a critic's new value head) would start differently on each rank: broadcast what trains
    import torch.distributed as dist

    for p in scorer.parameters():
        if p.requires_grad:
            dist.broadcast(p.data, src=world.global_rank(0), group=world.group)
    for layer in decoder_layers(module):
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, **options)
    fully_shard(scorer, **options)


def full(t: Tensor) -> Tensor:
    """A parameter's whole value: gathered from every rank if it is a shard (a collective), else itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: Any) -> Any:
    """This rank's shard of a sharded tensor (what it checkpoints), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def like(param: Tensor, value: Tensor) -> Tensor:
    """`value`, a rank's shard (a checkpoint's rows), sharded as `param` is (itself if `param` is not sharded or
    `value` already is)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or isinstance(value, DTensor):
        return value
    return DTensor.from_local(
        value.to(param.device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )

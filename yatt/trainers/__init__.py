"""Training backends: own a model + optimizer and turn a loss function into parameter updates.

`TRAINERS` names the backends `trainer.backend` may choose; each implements `yatt.trainers.base.Trainer`.
An entry may own a section beside `backend` (`trainer.torch`, `trainer.megatron`) and declare hooks (`yatt.backends`):
`preflight(trainer: TrainerConfig, world_size)` raises ValueError for what the config alone cannot tell; its
section's `model_parallel` (tensor, pipeline) says how many ranks hold one copy of the model; `lora` says whether
it trains LoRA adapters (model.lora; a trainer that does takes `lora=` and has `reference()`).
"""

from yatt.registry import Registry

TRAINERS: Registry = Registry(
    "trainer.backend",
    {"torch": "yatt.trainers.torch_config:TORCH", "megatron": "yatt.trainers.megatron_config:MEGATRON"},
)

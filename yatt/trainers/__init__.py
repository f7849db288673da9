"""Training backends: own a model + optimizer and turn a loss function into parameter updates.

`TRAINERS` names the backends `trainer.backend` may choose; each implements `yatt.trainers.base.Trainer`.
"""

from yatt.registry import Registry

TRAINERS: Registry = Registry("trainer.backend", {
    "torch": "yatt.trainers.torch_trainer:TorchTrainer",
    "megatron": "yatt.trainers.megatron_trainer:MegatronTrainer",
})

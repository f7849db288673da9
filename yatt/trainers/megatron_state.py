"""The megatron trainer's own state: what a checkpoint holds of each rank's shard, and handing the device to
another role (offload/onload). Mixed into `yatt.trainers.megatron_trainer.MegatronTrainer`, whose attributes it
reads (gpt, model, optimizer, tp/pp/dp_size/ep, trainable, world, optimizer_steps, weight_changes, _set_lr).
"""

from __future__ import annotations

from typing import Any

import torch


class MegatronState:
    # ---- checkpoint state --------------------------------------------------------------------------------
    def _parallel(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp_size, "ep": self.ep}

    def _optimizers(self) -> list:
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer]) if self.optimizer else []

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: its megatron parameters, and per optimizer its Adam state and float32 master
        weights (its 1/DP slice), the lr schedule's position."""
        state: dict[str, Any] = {
            "model": {k: p.detach() for k, p in self.gpt.named_parameters()},
            "optimizer_steps": self.optimizer_steps,
            "parallel": self._parallel(),
        }
        if self.trainable:
            state["optimizer"] = [
                {
                    "inner": opt.optimizer.state_dict(),
                    "main": [p.detach() for group in getattr(opt, "shard_fp32_from_float16_groups", []) for p in group],
                }
                for opt in self._optimizers()
            ]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        want = self._parallel()
        if {"ep": 1, **state["parallel"]} != want:
            raise ValueError(f"checkpoint shard was saved as {state['parallel']}, this run is split as {want}")
        params = dict(self.gpt.named_parameters())
        if set(params) != set(state["model"]):
            raise ValueError("checkpoint shard does not fit this model")
        for name, p in params.items():
            p.copy_(state["model"][name])
        self.weight_changes += 1
        self.optimizer_steps = state["optimizer_steps"]
        if self.trainable:
            for opt, saved in zip(self._optimizers(), state["optimizer"]):
                opt.optimizer.load_state_dict(saved["inner"])
                mains = [p for group in getattr(opt, "shard_fp32_from_float16_groups", []) for p in group]
                for p, t in zip(mains, saved["main"]):
                    p.copy_(t)
            self._set_lr(self.optimizer_steps)

    # ---- device ownership --------------------------------------------------------------------------------
    def _state_bytes(self) -> int:
        tensors = [p for p in self.gpt.parameters()]
        for opt in self._optimizers():
            tensors += [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
            tensors += [p for group in getattr(opt, "shard_fp32_from_float16_groups", []) for p in group]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _move_optimizer_state(self, device: torch.device) -> int:
        moved = 0
        for opt in self._optimizers():
            for s in opt.optimizer.state.values():
                for k, v in s.items():
                    if torch.is_tensor(v) and k != "step":
                        s[k] = v.to(device, non_blocking=True)
                        moved += v.numel() * v.element_size()
        return moved

    def offload(self) -> dict[str, Any]:
        """Hand the device to another role. On CPU nothing moves (the report says what this rank's shard
        holds). On GPU megatron DDP frees its gradient buffers and the Adam state goes to host memory; the
        weights stay (they are views into DDP's parameter buffer, which the distributed optimizer updates)."""
        nbytes = self._state_bytes()
        if self.world.device.type == "cpu":
            return {"moved_bytes": 0, "resident_bytes": nbytes, "freed_bytes": 0}
        before = torch.cuda.memory_allocated(self.world.device)
        moved = self._move_optimizer_state(torch.device("cpu")) if self.trainable else 0
        if self.trainable:
            self.model.offload_grad_buffers(synchronize=True, empty_cache=True)
        torch.cuda.empty_cache()
        return {"moved_bytes": moved, "freed_bytes": before - torch.cuda.memory_allocated(self.world.device)}

    def onload(self) -> dict[str, Any]:
        if self.world.device.type == "cpu" or not self.trainable:
            return {"moved_bytes": 0}
        self.model.restore_grad_buffers(synchronize=True)
        return {"moved_bytes": self._move_optimizer_state(self.world.device)}

"""What megatron-core 0.16 needs to run on CPU over gloo: every patch in one place, each applied only on CPU.

megatron-core is written for CUDA: it allocates its runtime buffers on `torch.cuda.current_device()` or on a
literal `device="cuda"`, and keeps its dropout RNG streams as CUDA generator states. The model math itself
(linear layers, RMSNorm, rotary embeddings, the local `DotProductAttention`) and its collectives
(torch.distributed, which gloo serves on CPU) are device-agnostic. So four redirections are enough for a
GPTModel with tensor, pipeline and data parallelism, megatron's DDP, its distributed optimizer and its pipeline
schedules:

1. `torch.cuda.current_device()` -> the CPU device. megatron asks it where to put the tensors it allocates
   at run time (the global memory buffer, rotary `inv_freq` moved "to the GPU" on the first forward, the
   receive buffers of tensor-parallel gathers and pipeline p2p, DDP's contiguous gradient buffers, the
   distributed optimizer's shards). On a machine without CUDA the real function raises, so no working code
   path depends on it; returning the CPU device keeps each of those tensors where the model lives.
2. The CUDA RNG state tracker -> one that keeps CPU generator states. megatron forks a named RNG stream around
   dropout and initialisation (`get_cuda_rng_tracker().fork()`); its tracker reads and writes CUDA generator
   states (`torch.cuda.get_rng_state`, `torch.cuda.default_generators`), which do not exist on CPU. The CPU
   tracker does the same bookkeeping with `torch.get_rng_state`/`set_rng_state`, so a forked region draws from
   its own stream and leaves the default one as it was, as on GPU.
3. `torch.cuda.synchronize()` -> nothing. megatron waits for the GPU between exchanging tensor shapes and
   tensors in pipeline p2p (variable sequence lengths); CPU ops and gloo's are already complete when they
   return, so there is nothing to wait for, and the real function raises without CUDA.
4. `device="cuda"` literals and `Tensor.cuda()` -> the CPU, inside `on_cpu()` only. megatron writes small
   bookkeeping tensors straight to "cuda" (the default causal mask, the grad-norm and found-inf scalars of
   the optimizer and `clip_grads`, the token counter of the pipeline schedules) and moves the tied output
   weight of the last pipeline stage with `.cuda()` before all-reducing it with the first stage's copy.
   Likewise megatron's optimizers sort parameters by `param.type()` against the CUDA type names
   ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor"), so inside `on_cpu()` a CPU tensor's `.type()`
   answers with the CUDA name of the same dtype.
   A `TorchFunctionMode` sees every torch call's arguments before they run, so it can rewrite exactly those
   device arguments; it is scoped to `on_cpu()`, which the megatron trainer enters around its own calls
   into megatron, so no other code in the process is touched. (Autograd keeps the mode for backward.)
   The mode costs ~3 us a torch call, so the hot code that names no CUDA device runs with it popped
   (`off_cpu()`): the model's forward, the loss, the optimizer's update, and megatron's backward step, which
   `apply()` wraps (the backward's buffers come from patch 1).

5. Tensor-parallel collectives -> shared memory, when the trainer asks (`use_host_collectives`):
   `torch.distributed.all_reduce` and `all_gather` on the tensor-parallel group (megatron's row-parallel
   outputs, column-parallel input gradients and vocabulary-parallel embedding; yatt's vocabulary-parallel
   softmax sums and its weight gathers) go through `yatt.trainers.megatron_collectives` instead of gloo when the
   group's ranks share a host. megatron calls `torch.distributed.all_reduce` itself (some calls asynchronous,
   whose handle is then already complete), so the functions are replaced in `torch.distributed`; calls on any
   other group go to the originals.

6. megatron's unfused rotary embedding (the path without Transformer Engine) -> the same, with cos and sin of
   the rotary table computed once per forward. It recomputes them, and scales and casts them, for the queries
   and again for the keys of every layer, though every layer gets the same table: 16 passes of cos/sin over
   [tokens, head dim] per forward on the quickstart, done on every token by each tensor-parallel rank. The
   last table (the same tensor object, held here so its identity cannot be reused) keeps its cos and sin;
   the arithmetic applied to the queries and keys is megatron's, so results are bit-identical.

7. The MoE all-to-all token dispatcher's device-to-host copies -> plain CPU values. It builds a CUDA stream
   (`torch.cuda.Stream()`, which raises without CUDA) and copies its split sizes to the host on it, as numpy
   arrays, with events to wait on. On CPU the values already are on the host: the class gets a placeholder
   stream, and `_maybe_dtoh_and_synchronize` turns the split sizes into numpy arrays as the GPU path does
   (what `all_to_all` takes), with nothing to wait for.

`apply()` is idempotent and does nothing when CUDA is available (megatron then runs unpatched); so is
`on_cpu()`, which is then a null context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_HOST: dict = {}  # process group -> HostGroup or None (patch 5)


class CpuRNGStatesTracker:
    """megatron's `CudaRNGStatesTracker` contract (add / fork / get_states / set_states / reset) over the CPU
    generator: each named stream is a saved `torch.get_rng_state()`."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng stream {name} (seed {seed}) already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng stream {name} was never added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Patch 4: `device=` arguments naming CUDA become the CPU; `.cuda()` and `.to("cuda")` stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)  # pinning needs CUDA; a CPU tensor does not need it
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def on_cpu() -> contextlib.AbstractContextManager:
    """The context every call into megatron runs in: patch 4 on a CPU machine, nothing on a CUDA one."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaToCpu()


def off_cpu() -> contextlib.AbstractContextManager:
    """Inside `on_cpu()`: patch 4 off for code that names no CUDA device (the model's forward)."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    return _pop_mode_temporarily() if isinstance(_get_current_function_mode(), _CudaToCpu) else contextlib.nullcontext()


def _nothing(*args, **kwargs) -> None:
    return None


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def apply() -> None:
    """Patch megatron-core for CPU (see the module docstring); a no-op on CUDA machines and when done."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = _cpu_device  # patch 1
    torch.cuda.synchronize = _nothing  # patch 3
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # patch 2: what initialize_rng_tracker builds
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    backward_step = schedules.backward_step  # patch 4's mode off for the backward (the schedules look it up)

    def backward_off_cpu(*args, **kwargs):
        with off_cpu():
            return backward_step(*args, **kwargs)

    schedules.backward_step = backward_off_cpu
    rope_utils._apply_rotary_pos_emb_bshd = _rotary_once(rope_utils._apply_rotary_pos_emb_bshd)  # patch 6
    from megatron.core.transformer.moe import token_dispatcher  # patch 7

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"  # set: the constructor builds none
    token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_splits
    _APPLIED = True


def _host_splits(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
    """Patch 7: the dispatcher's split sizes as numpy arrays at its device-to-host point; nothing to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _rotary_once(bshd: Any) -> Any:
    """Patch 6: megatron's `_apply_rotary_pos_emb_bshd` with the last table's cos and sin kept."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    last: list = [None, None, None]  # the table, (mscale, dtype), (cos, sin)

    def apply_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if multi_latent_attention or freqs.requires_grad:
            return bshd(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        if last[0] is not freqs or last[1] != (mscale, t.dtype):
            cos, sin = (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype)
            last[:] = [freqs, (mscale, t.dtype), (cos, sin)]
        cos, sin = last[2]
        rot_dim = freqs.shape[-1]
        t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
        t = (t * cos) + (_rotate_half(t, rotary_interleaved) * sin)
        return torch.cat((t, t_pass), dim=-1) if t_pass.numel() else t

    return apply_bshd


class _Done:
    """The work handle of an `async_op=True` collective that is already complete."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def use_host_collectives(group: Any) -> None:
    """Patch 5 for `group` (collective over it; CPU only): `torch.distributed.all_reduce` and `all_gather` on
    that group go through shared memory where its ranks share a host; every other call is unchanged."""
    import torch.distributed as dist

    from yatt.trainers.megatron_collectives import OPS, HostGroup

    if torch.cuda.is_available() or group in _HOST:
        return
    _HOST[group] = HostGroup.create(group)
    if hasattr(dist.all_reduce, "__wrapped_by_yatt__"):
        return
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def host_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        host = _HOST.get(group)
        if host is None or not host.serves(tensor) or op not in OPS:
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        host.all_reduce(tensor, op)
        return _Done() if async_op else None

    def host_all_gather(tensor_list, tensor, group=None, async_op=False):
        host = _HOST.get(group)
        if host is None or not all(map(host.serves, [tensor, *tensor_list])):
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        host.all_gather(tensor_list, tensor)
        return _Done() if async_op else None

    host_all_reduce.__wrapped_by_yatt__ = all_reduce
    host_all_gather.__wrapped_by_yatt__ = all_gather
    dist.all_reduce, dist.all_gather = host_all_reduce, host_all_gather

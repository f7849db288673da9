"""GPU check of the megatron trainer backend in the whole RL loop on one GPU: scripts/gpu_check_e2e.py with
`trainer.backend=megatron` (TP=1, PP=1), the `hf` rollout engine, bfloat16, 10 steps by default.

    python scripts/gpu_check_megatron.py [--steps 10] [--out DIR] [the other options of gpu_check_e2e.py]
    python scripts/gpu_check_megatron.py --composed   # + GenRM judge (hf engine), balancing, export_hf

Checks what gpu_check_e2e.py checks (finite loss and no skipped step, weights moving, engine/trainer log-prob
agreement, offload freeing GPU memory, NCCL for the process group), here for megatron's GPTModel, DDP and
distributed optimizer unpatched on CUDA: bfloat16 weights and gradients, float32 master weights, the policy
gathered back to Hugging Face names for the engine after every step and for the exported folder. It needs
models/quickstart-policy like gpu_check_e2e.py. Writes gpu_check_megatron.json into --out.

--composed is the composed configuration on one GPU (TP=1, full placement): configs/quickstart_genrm.yaml, its
judge (models/quickstart-judge, carried too) on an hf engine, balancing and `checkpoint.export_hf` on; it adds the
checks that every step was judged and that the exported policy folder loads (gpu_check_e2e.py).

megatron-core on the GPU machine (it has torch but no network and no megatron-core; a carried folder holds at
most 64 MiB): carry megatron-core 0.16.1 from a machine with network, without its dependencies (torch is
there; numpy and packaging are its only other needs), either as
- a wheel (the GPU machine must run Python 3.11 on x86_64, as the wheel is cp311 manylinux):
  `pip download megatron-core==0.16.1 --no-deps -d wheels`, carry `wheels/`, and there
  `pip install --no-deps wheels/megatron_core-0.16.1-*.whl`; or
- a plain folder on PYTHONPATH (nothing installed there; the child ranks inherit PYTHONPATH):
  `pip install --no-deps --target vendor megatron-core==0.16.1` (about 17 MB), carry `vendor/`, and run
  `PYTHONPATH=vendor python scripts/gpu_check_megatron.py`. The modules yatt imports are pure Python (the
  wheel's one compiled module, megatron's dataset helpers, is never imported), so this way does not tie the
  GPU machine to Python 3.11.

Without a GPU it runs on the CPU in float32 (megatron patched for CPU/gloo by yatt.trainers.megatron_compat),
with the GPU-only checks (offload frees memory, NCCL) reported as skipped and the engine/trainer agreement
held to float32's 1e-3: tests/test_gpu_check_e2e.py runs it that way.
"""

import importlib.util
import sys

from gpu_check_e2e import main

if __name__ == "__main__":
    if importlib.util.find_spec("megatron") is None:
        print(
            "megatron-core is not importable: see this script's docstring for how to carry it to this machine",
            file=sys.stderr,
        )
        sys.exit(2)
    import torch

    sys.exit(
        main(
            name="gpu_check_megatron",
            doc=__doc__,
            trainer_backend="megatron",
            steps=10,
            dtype="bfloat16" if torch.cuda.is_available() else "float32",
        )
    )

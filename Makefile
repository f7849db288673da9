# Two commands on a fresh machine:
#   make quickstart   set up, build the tiny policy (once), train it with GRPO on 2 CPU ranks
#   make test         set up, run the test suite (CI runs this)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.yatt-setup
export OMP_NUM_THREADS := 1

PLACEMENT ?= partial

.PHONY: setup quickstart quickstart-moe quickstart-genrm quickstart-distill quickstart-vl quickstart-vl-genrm quickstart-tools lint format test test-all clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh environments/vf-reasoning-gym/pyproject.toml
	bash scripts/setup.sh
	touch $(STAMP)

quickstart: setup
	$(PY) launch/sft.py --config configs/sft_quickstart.yaml
	$(PY) launch/train.py --nproc 2 --config configs/quickstart.yaml --placement full

# The MoE quickstart: a tiny Qwen3-MoE (8 experts, top-2) SFT'd once, then GRPO with routing replay R3.
quickstart-moe: setup
	$(PY) launch/sft.py --config configs/sft_quickstart_moe.yaml
	$(PY) launch/train.py --nproc 2 --config configs/quickstart_moe.yaml --placement full

# The quickstart with a generative reward model: also builds the tiny judge once (launch/sft.py skips
# a model folder that exists). PLACEMENT=full runs rollout, GenRM and training one after the other.
quickstart-genrm: setup
	$(PY) launch/sft.py --config configs/sft_quickstart.yaml
	$(PY) launch/sft.py --config configs/sft_judge.yaml
	$(PY) launch/sft.py --config configs/sft_judge_near_miss.yaml
	$(PY) launch/train.py --nproc 2 --config configs/quickstart_genrm.yaml --placement $(PLACEMENT)

# On-policy distillation: the quickstart's student learns from a larger tiny teacher SFT'd to >= 0.95 (built once),
# served like a judge; partial placement by default (PLACEMENT=full: rollout, teacher, training in turn).
quickstart-distill: setup
	$(PY) launch/sft.py --config configs/sft_quickstart.yaml
	$(PY) launch/sft.py --config configs/sft_quickstart_teacher.yaml
	$(PY) launch/train.py --nproc 2 --config configs/quickstart_distill.yaml --placement $(PLACEMENT)

# The visual quickstart: writes the counting-squares images and SFTs a tiny VL policy once, then GRPO on 2 ranks.
quickstart-vl: setup
	test -f data/shapes/train.jsonl || $(PY) -m yatt.quickstart.shapes --out data/shapes
	test -d models/quickstart-vl || $(PY) -m yatt.quickstart.sft_vl --data data/shapes --out models/quickstart-vl
	$(PY) launch/train.py --nproc 2 --config configs/quickstart_vl.yaml --placement full

# The visual quickstart with a GenRM judge that sees the images: data, policy and the tiny VL judge once each,
# then GRPO on the judge's verdicts with partial placement (PLACEMENT=full runs rollout, GenRM, training in turn).
quickstart-vl-genrm: setup
	test -f data/shapes/train.jsonl || $(PY) -m yatt.quickstart.shapes --out data/shapes
	test -d models/quickstart-vl || $(PY) -m yatt.quickstart.sft_vl --data data/shapes --out models/quickstart-vl
	test -d models/quickstart-vl-judge || $(PY) -m yatt.quickstart.shapes_judge --data data/shapes --out models/quickstart-vl-judge
	$(PY) launch/train.py --nproc 2 --config configs/quickstart_vl_genrm.yaml --placement $(PLACEMENT)

# The tool quickstart: writes the 4-digit x 2-digit products (again when their code changed), SFTs the tiny
# policy to call the calculator on part of them once (launch/sft.py skips a folder trained from the same config),
# then GRPO over tool conversations on 2 ranks.
data/products/train.jsonl: yatt/quickstart/products.py
	$(PY) -m yatt.quickstart.products --out data/products

quickstart-tools: setup data/products/train.jsonl
	$(PY) launch/sft.py --config configs/sft_quickstart_tools.yaml
	$(PY) launch/train.py --nproc 2 --config configs/quickstart_tools.yaml --placement full

# ruff (configured in pyproject.toml): lint, and a format check; `make format` rewrites the files
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# One line per test file with its time, and the slowest tests at the end: a slow or stuck file shows in the log.
test: lint
	$(PY) -m pytest -m "not slow" -o console_output_style=times --durations=20

test-all: lint
	$(PY) -m pytest -o console_output_style=times --durations=20

# Removes only what the quickstarts made: runs/<run.name> of each configs/quickstart*.yaml, their models and data.
clean:
	rm -rf runs/quickstart runs/quickstart_moe runs/quickstart_genrm runs/quickstart_vl runs/quickstart_vl_genrm runs/quickstart_tools \
		runs/quickstart_distill models/quickstart-teacher \
		runs/quickstart_rloo runs/quickstart_reinforce_pp runs/quickstart_gspo runs/quickstart_ppo runs/quickstart_is \
		models/quickstart-policy models/quickstart-judge-base models/quickstart-judge models/quickstart-vl \
		models/quickstart-vl-judge models/quickstart-tools-policy models/quickstart-moe-policy data/shapes data/products

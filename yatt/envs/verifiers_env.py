"""A `verifiers` environment and its taskset in this process, and its tasks as prompt rows.

verifiers (v0.4, `verifiers.v1`) builds an environment from a config naming its taskset (`vf.resolve_env_config`,
`vf.load_environment`). yatt declares its agent with the `null` harness and the subprocess runtime but never
starts either: the agent loop plays the model's side of `Env.run` itself (yatt.envs.episode). An environment is
built once per process and taskset config (`load_env`), by the data source on every rank and then reused by
the loop. A task travels in its row's metadata as its taskset config and its TaskData (JSON) and is rebuilt
through the taskset's own task class (`task_of`), so the package's own task generation, prompts and reward are
used. What the in-process route does not run is refused when the environment is built (`check_in_process`) or
its first task read (`check_task`).

textarena's games call `nltk.download`, which goes to GitHub; `offline_nltk` points nltk at a local folder
(yatt.envs.nltk_data builds one) and makes a download a lookup there that fails naming the command to run. They
also rebuild their English dictionary for every game; `share_dictionaries` builds it once per process.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

from yatt.data.errors import DataError
from yatt.data.rows import PromptRow, shard_indices
from yatt.envs import require_verifiers

ENV_PREFIX = "verifiers/"  # a row's data_source: its reward is the environment's own
META = "verifiers"  # the row metadata key holding {taskset, task, nltk_data}
NLTK_KINDS = ("corpora", "taggers", "tokenizers", "models", "chunkers", "stemmers", "misc", "sentiment", "grammars")

_envs: dict[str, Any] = {}
_lock = threading.Lock()
_dictionaries_lock = threading.Lock()


def env_config(taskset: dict) -> dict:
    """The environment config yatt builds: the taskset's, each of its environment's agents declared with a harness
    that is never run (the seat names are the environment's: `agent` for a plain taskset, `player` for TextArena)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type

    seats = [n for n, f in env_config_type(taskset["id"]).model_fields.items() if isinstance(f.default, AgentConfig)]
    player = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    return {"taskset": taskset, **{seat: player for seat in seats}}


def load_env(taskset: dict, nltk_data: str | None = None) -> Any:
    """The environment of `taskset` ({id, its config fields}), built once in this process."""
    key = json.dumps(taskset, sort_keys=True)
    with _lock:
        if key not in _envs:
            vf = require_verifiers()
            offline_nltk(nltk_data)
            share_dictionaries()
            try:
                env = vf.load_environment(vf.resolve_env_config(env_config(taskset)))
            except Exception as err:  # a wrong taskset id or option: verifiers' message, on one line
                raise ValueError(f"verifiers taskset {taskset}: {' '.join(str(err).split())}") from None
            check_in_process(env)
            _envs[key] = env
        return _envs[key]


def check_in_process(env: Any) -> None:
    """Refuse, naming why, an environment whose protocol needs more than the in-process loop runs: several
    agents, a taskset's shared tools (only a harness calls them), or a cross-agent `finalize`."""
    from verifiers.v1.configs.agent import agent_config_fields

    vf = require_verifiers()
    name = type(env).__name__
    agents = agent_config_fields(env.config)
    if len(agents) != 1:
        raise ValueError(
            f"{name} has {len(agents)} agents ({', '.join(agents)}); yatt plays single-agent environments only"
        )
    if type(env.taskset).toolsets(env.taskset.config):
        raise ValueError(
            f"{name}: its taskset offers tools, which only a verifiers harness calls; yatt plays "
            "environments whose turns are plain messages (e.g. textarena)"
        )
    if type(env).finalize is not vf.Env.finalize:
        raise ValueError(f"{name} judges episodes in finalize(), which yatt does not run yet")


def check_task(task: Any) -> None:
    """Refuse, naming why, a task whose rollout needs what the in-process route does not provide: a runtime (its
    `setup`/`finalize` hooks, scoring functions that take one, a container), judges (they call a model server),
    its own tools, or hooks that read model requests. Its `@reward`, `@metric` and `@stop` functions over the
    trace run as in a verifiers rollout (yatt.envs.episode)."""
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    vf = require_verifiers()
    cls, name = type(task), type(task).__name__
    hooks = [h for h in ("setup", "finalize", "stage_verifier") if getattr(cls, h) is not getattr(vf.Task, h)]
    if hooks or cls.NEEDS_CONTAINER or task.data.image:
        why = f"{', '.join(hooks)} hook" if hooks else "container"
        raise ValueError(
            f"task {name} needs a runtime ({why}), which yatt does not provision; it plays tasks scored from the "
            "trace alone"
        )
    if task.plugged_judges():
        raise ValueError(f"task {name} is scored by judges, which call a model server yatt does not serve")
    if cls.toolsets(task.config):
        raise ValueError(f"task {name} offers tools, which only a verifiers harness calls")
    takes_runtime = [fn.__name__ for fn in task.hooks("reward") + task.hooks("metric") if _needs_runtime(fn)]
    if takes_runtime:
        raise ValueError(
            f"task {name}: {', '.join(takes_runtime)} score(s) with a runtime, which yatt does not provision"
        )
    reads_requests = [fn.__name__ for fn in discover_decorated(task, "intercept")] + [
        fn.__name__ for fn in task.hooks("stop") if hook_boundary(fn, allow_trace=True) is not vf.Trace
    ]
    if reads_requests:
        raise ValueError(
            f"task {name}: {', '.join(reads_requests)} read(s) model requests, which this route never makes"
        )


def _needs_runtime(fn: Any) -> bool:
    """As verifiers decides whether a scoring function needs the rollout's runtime: a `runtime` parameter
    without a default."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def offline_nltk(folder: str | Path | None) -> None:
    """Point nltk at `folder` (also as NLTK_DATA, for anything that reads it later) and make `nltk.download`
    a lookup in its search path: True when the resource is there, else an error naming how to build it."""
    if folder is not None:
        os.environ["NLTK_DATA"] = str(folder)
    try:
        import nltk
    except ImportError:
        return
    if folder is not None and str(folder) not in nltk.data.path:
        nltk.data.path.insert(0, str(folder))
    nltk.download = _nltk_lookup


def share_dictionaries() -> None:
    """Build each of textarena's `EnglishDictionary`s once per process. Its games build one from the bundled
    hunspell lists and nltk's words every time a game is made, i.e. every episode: 2.2 s of a 2.4 s Wordle
    episode here. The games only read it (`is_english_word`, `get_all_words`), so one per set of arguments and
    nltk search path serves them all."""
    try:
        from textarena.envs.utils import word_lists
    except ImportError:  # no textarena: no textarena games
        return
    cls = word_lists.EnglishDictionary
    if getattr(cls, "_yatt_shared", False):
        return
    build, built = cls.__init__, {}

    def shared(klass, *args: Any, **kwargs: Any) -> Any:
        import nltk

        key = (klass, args, tuple(sorted(kwargs.items())), tuple(map(str, nltk.data.path)))
        with _dictionaries_lock:
            if key not in built:
                built[key] = object.__new__(klass)
                build(built[key], *args, **kwargs)
            return built[key]

    cls.__new__ = shared
    cls.__init__ = lambda self, *args, **kwargs: None  # built once, in shared()
    cls._yatt_shared = True


def _nltk_lookup(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
    import nltk

    for kind in NLTK_KINDS:
        try:
            nltk.data.find(f"{kind}/{info_or_id}")
            return True
        except LookupError:
            continue
    raise LookupError(
        f"nltk resource {info_or_id!r} is not in {nltk.data.path} and nothing is downloaded: build the folder with "
        "`python -m yatt.envs.nltk_data --out DIR` and set data.<split>.nltk_data (or NLTK_DATA) to it"
    )


def task_row(taskset: dict, task: Any, index: int, nltk_data: str | None) -> PromptRow:
    """A task as a chat row: the taskset's system prompt and opening message; the task in its metadata."""
    data = task.data
    where = f"{ENV_PREFIX}{taskset['id']} task {index} ({data.name or data.id or data.idx})"
    if isinstance(data.prompt, str):
        messages = [{"role": "user", "content": data.prompt}]
    elif data.prompt and all(isinstance(getattr(m, "content", None), str) for m in data.prompt):
        messages = [{"role": m.role, "content": m.content} for m in data.prompt]
    else:
        raise DataError(f"{where}: only tasks whose prompt is text are supported (the model opens the exchange)")
    if data.system_prompt:
        messages = [{"role": "system", "content": data.system_prompt}] + messages
    meta = {"taskset": taskset, "task": data.model_dump(mode="json"), "nltk_data": nltk_data}
    return PromptRow(
        index=index,
        prompt=None,
        messages=messages,
        answer=None,
        data_source=ENV_PREFIX + taskset["id"],
        metadata={META: meta},
        origin=where,
    )


def read_task_shard(
    taskset: str,
    options: dict,
    start: int,
    size: int,
    rank: int,
    world_size: int,
    limit: int | None = None,
    nltk_data: Path | None = None,
) -> list[PromptRow]:
    """This rank's rows of tasks [start, start + size) of the taskset's stream (a stride, like every source).
    The stream is the taskset's own, generated from its seeds: every rank walks it and keeps its slice."""
    config = {"id": taskset, **options}
    folder = str(nltk_data) if nltk_data is not None else None
    try:
        env = load_env(config, folder)
    except (ImportError, ValueError, LookupError) as err:
        raise DataError(f"data: {err}") from None
    count = size if limit is None else min(size, limit)
    mine = set(shard_indices(count, rank, world_size))
    rows = []
    for i, task in enumerate(itertools.islice(iter(env.taskset), start, start + count)):
        if i == 0:
            try:
                check_task(task)
            except ValueError as err:
                raise DataError(f"data: {err}") from None
        if i in mine:
            rows.append(task_row(config, task, start + i, folder))
    return rows


def task_of(row: PromptRow) -> tuple[Any, Any]:
    """The environment and the task a row of `read_task_shard` holds."""
    meta = (row.metadata or {}).get(META) if row is not None else None
    if meta is None:
        where = row.where if row is not None else "a prompt"
        raise ValueError(
            f"{where} is no verifiers task: rollout.agent.kind=verifiers plays rows of a "
            "data source with kind: verifiers"
        )
    env = load_env(meta["taskset"], meta.get("nltk_data"))
    task_cls = type(env.taskset).task_type()
    data = task_cls.data_type().model_validate(meta["task"])
    return env, task_cls(data, env.taskset.config.task)

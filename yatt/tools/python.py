"""The python tool: runs the model's code in a sandboxed child interpreter (`yatt.tools.sandbox`).

The output is what the code printed (stdout and stderr interleaved, as a terminal shows them), plus the value
of a last bare expression; every failure (a limit, a refused action, an uncaught exception) is a one-line
error that starts with "python: ".
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from yatt.tools.base import ToolConfig, ToolResult, string_argument


class PythonConfig(ToolConfig):
    """The sandbox's limits. Validation only checks the values: whether the interpreter, the user and a network
    namespace are usable is found on the first call (`yatt.tools.sandbox.plan`)."""

    kind: Literal["python"] = "python"
    timeout_s: float = Field(
        5.0, gt=0, description="Wall-clock limit of one call; then the whole process group is killed."
    )
    cpu_s: int = Field(3, gt=0, description="CPU-time limit in seconds (RLIMIT_CPU; SIGXCPU, then SIGKILL 1 s later).")
    memory_mb: int = Field(
        256, ge=32, description="Address-space limit in MiB (RLIMIT_AS): an allocation beyond it is a MemoryError."
    )
    output_bytes: int = Field(
        4096, gt=0, description="stdout + stderr kept; more output kills the call (the first bytes are shown)."
    )
    file_mb: int = Field(16, gt=0, description="Largest file the code may write, in MiB (RLIMIT_FSIZE).")
    open_files: int = Field(64, ge=16, description="Open file descriptors (RLIMIT_NOFILE).")
    processes: int = Field(
        16,
        gt=0,
        description="RLIMIT_NPROC: processes and threads the code may have. The kernel counts them per user, per "
        "user namespace: per call when the sandbox makes one (network_namespace), else shared by every process of "
        "the sandbox's user. Root is exempt, hence `user`.",
    )
    max_code_bytes: int = Field(65536, gt=0, description="Longest code accepted, in bytes (UTF-8).")
    allow_processes: bool = Field(
        False,
        description="Let the code start processes (subprocess, os.fork); RLIMIT_NPROC and the wall clock still "
        "bound them. False: the audit hook refuses them with a clear error.",
    )
    user: str | None = Field(
        "nobody",
        description="When yatt runs as root, the code runs as this user, so that RLIMIT_NPROC applies and files "
        "are protected by their permissions; null: as root (not recommended). Ignored when yatt is not root.",
    )
    interpreter: str | None = Field(
        None,
        description="Python that runs the code (stdlib only: it runs with -I -S). null: this process's "
        "interpreter if `user` can run it, else /usr/bin/python3 or /usr/local/bin/python3.",
    )
    network_namespace: Literal["auto", "require", "off"] = Field(
        "auto",
        description="Run the code in an empty network namespace (`unshare -n`, or `unshare -r -n` without root). "
        "auto: when this machine allows it; require: fail every call when it does not. The audit hook refuses "
        "sockets either way.",
    )
    workdir_root: str | None = Field(
        None,
        description="Where each call's temporary working directory is made (null: the system temp dir); `user` "
        "must be able to reach it (e.g. not under a 0700 directory of root's) for the code's own temp files.",
    )


class PythonTool:
    """Runs ``{"code": "..."}``."""

    config: ClassVar[type[ToolConfig]] = PythonConfig
    description = (
        "Run Python 3 code (standard library only) and return what it prints; the value of a last bare "
        "expression is printed too. No network; files only in the current directory."
    )
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run"}},
        "required": ["code"],
    }

    def __init__(self, cfg: PythonConfig):
        self.cfg = cfg

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        from yatt.tools.sandbox import run_code  # subprocess machinery, only when a call is made

        code = string_argument(arguments, "code", "python")
        if isinstance(code, ToolResult):
            return code
        if len(code.encode("utf-8", "replace")) > self.cfg.max_code_bytes:
            return ToolResult.failed(f"python: code longer than {self.cfg.max_code_bytes} bytes")
        return run_code(code, self.cfg).result

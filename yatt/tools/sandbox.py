"""Running untrusted code in a child interpreter: limits, isolation, output cap, wall clock, cleanup.

Read `run_code` first, then `plan`. One call:
1. makes a fresh temporary working directory (the only place the code may write), owned by the sandbox user;
2. starts ``[unshare -r -n --] python -I -S -B -u -c <sandbox_child.py> <limits> <code file>`` in a new session
   (its own process group), with a minimal environment (nothing of yatt's, e.g. no run secret), stdin from
   /dev/null and stdout + stderr on one pipe;
3. reads that pipe until EOF, the output cap or the wall clock, whichever comes first, so a flood of output
   neither deadlocks nor fills memory;
4. kills the whole process group (anything the code left behind too), reaps the child, removes the directory,
   and turns what happened into a `ToolResult` with a one-line error.

Protections and what enforces each (the kernel where this machine allows it; the audit hook in
`sandbox_child.py` gives the clear message, and is the only guard where noted):
- CPU time, memory, file size, open files, processes: rlimits set in the child before the code runs (RLIMIT_NPROC
  does not bind root, so as root the code runs as `user`, default nobody);
- wall clock: killpg from here;
- output: the cap in this module;
- network: an empty network namespace (`unshare`) when `plan` finds one works, and the hook refusing sockets;
- writes outside the directory: file permissions when the code runs as another user, and the hook (the only guard
  for world-writable places such as /tmp, and for everything when yatt is not root);
- reads outside the directory and the standard library: the hook only (a user's file permissions still apply).

Not covered: total disk use (many files, each under file_mb, until the wall clock), and native code that skips
the hook (e.g. a fresh instance of a C module built through importlib's internals): there the rlimits, the user
and the namespace are all there is. Linux only (waitid, unshare, RLIMIT_NPROC).
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from yatt.tools.base import ToolConfig, ToolResult


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

    @field_validator("network_namespace", mode="before")
    @classmethod
    def _bare_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` (file or command line) as false

    workdir_root: str | None = Field(
        None,
        description="Where each call's temporary working directory is made (null: the system temp dir); `user` "
        "must be able to reach it (e.g. not under a 0700 directory of root's) for the code's own temp files.",
    )


CHILD_SOURCE = (Path(__file__).parent / "sandbox_child.py").read_text()
EXIT_MEMORY, EXIT_REFUSED, EXIT_EXCEPTION = 85, 86, 87  # as sandbox_child.py exits
FALLBACK_INTERPRETERS = ("/usr/bin/python3", "/usr/local/bin/python3")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
PYTHON_FLAGS = ("-I", "-S", "-B", "-u")  # isolated (no env, no user site, no cwd on sys.path), no site, no .pyc


class SandboxUnavailable(RuntimeError):
    """The configured sandbox cannot run on this machine (reported as every call's error)."""


@dataclass(frozen=True)
class Plan:
    """How calls run on this machine, found once per setting by trying it (`plan`)."""

    argv: tuple[str, ...]  # everything before the child's -c
    uid: int | None  # the user the child runs as (None: this process's)
    gid: int | None
    network: str  # "namespace" or "audit hook"

    def describe(self) -> str:
        who = "this process's user" if self.uid is None else f"uid {self.uid}"
        return f"{' '.join(self.argv)} as {who}; network blocked by {self.network}"


@dataclass(frozen=True)
class SandboxRun:
    """One call as it happened: its result, and what tests and logs check (the group was killed, the time)."""

    result: ToolResult
    pid: int | None
    returncode: int | None
    wall_s: float
    cpu_s: float


def run_code(code: str, cfg: PythonConfig) -> SandboxRun:
    try:
        how = plan(cfg.interpreter, cfg.user, cfg.network_namespace)
    except SandboxUnavailable as err:
        return SandboxRun(ToolResult.failed(f"python: sandbox unavailable: {err}"), None, None, 0.0, 0.0)
    try:
        workdir = Path(tempfile.mkdtemp(prefix="yatt-python-", dir=cfg.workdir_root))
    except OSError as err:
        return SandboxRun(ToolResult.failed(f"python: no working directory: {err}"), None, None, 0.0, 0.0)
    try:
        return _run_in(workdir, code, cfg, how)
    except OSError as err:  # the child could not start (e.g. the machine is out of processes)
        return SandboxRun(ToolResult.failed(f"python: could not start: {err}"), None, None, 0.0, 0.0)
    finally:
        _remove(workdir)


def _run_in(workdir: Path, code: str, cfg: PythonConfig, how: Plan) -> SandboxRun:
    code_file = workdir / "main.py"
    code_file.write_text(code, encoding="utf-8")
    if how.uid is not None:  # the child (another user) must own its directory and read, then delete, the code
        for path in (workdir, code_file):
            os.chown(path, how.uid, how.gid)
    limits = {
        "cpu_s": cfg.cpu_s,
        "memory_mb": cfg.memory_mb,
        "file_mb": cfg.file_mb,
        "open_files": cfg.open_files,
        "processes": cfg.processes,
        "allow_processes": cfg.allow_processes,
    }
    # relative to its working directory: the sandbox user may not be able to traverse the directories above it
    argv = [*how.argv, "-c", CHILD_SOURCE, json.dumps(limits), code_file.name]
    start = time.monotonic()
    deadline = start + cfg.timeout_s
    proc = subprocess.Popen(
        argv,
        cwd=workdir,
        env={**ENV, "HOME": str(workdir), "TMPDIR": str(workdir)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as a whole
        **_user_kwargs(how),
    )
    try:
        output, truncated, timed_out = _read(proc, cfg.output_bytes, deadline)
        if not (truncated or timed_out):
            timed_out = not _exited(proc.pid, deadline)
    finally:
        # the leader is alive or an unreaped zombie here, so its group id cannot have been reused
        _kill_group(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
    cpu = usage.ru_utime + usage.ru_stime
    text = output.decode("utf-8", "replace")
    result = _result(text, proc.returncode, cpu, truncated, timed_out, cfg)
    return SandboxRun(result, proc.pid, proc.returncode, time.monotonic() - start, cpu)


def _result(text: str, rc: int, cpu: float, truncated: bool, timed_out: bool, cfg: PythonConfig) -> ToolResult:
    """The call's result: the first cause that applies, in the order they cut the run short. The output loses its
    final newlines (the tool response adds its own)."""
    text = text.rstrip("\n")
    if timed_out:
        return ToolResult.failed(f"python: killed after {cfg.timeout_s:g} s wall clock", text)
    if truncated:
        return ToolResult.failed(f"python: output truncated at {cfg.output_bytes} bytes", text)
    last = text.rpartition("\n")[2]
    if rc in (EXIT_MEMORY, EXIT_REFUSED) and last.startswith("python: "):
        return ToolResult.failed(last, text)  # the child printed it: the code's last line of output
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and cpu >= cfg.cpu_s):
        return ToolResult.failed(f"python: CPU time limit of {cfg.cpu_s} s exceeded", text)
    if rc == EXIT_EXCEPTION:  # the traceback is the output; its last line names the exception
        return ToolResult(output=text, error=f"python: {last}")
    if rc < 0:
        return ToolResult.failed(f"python: killed by {signal.Signals(-rc).name}", text)
    if rc != 0:
        return ToolResult.failed(f"python: exit status {rc}", text)
    return ToolResult(output=text)


def _read(proc: subprocess.Popen, cap: int, deadline: float) -> tuple[bytes, bool, bool]:
    """(the first `cap` bytes of output, more came, the deadline passed). Stops at EOF, or once the leader has
    exited and nothing more is waiting (a process it left behind may hold the pipe open)."""
    fd = proc.stdout.fileno()
    kept = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept), False, True
            if not selector.select(min(left, 0.1)):
                if not _exited(proc.pid, 0.0):
                    continue
                # exited: what it wrote before is readable now, what strays write later is not waited for
                if not selector.select(0):
                    return bytes(kept), False, False
            data = os.read(fd, 65536)
            if not data:
                return bytes(kept), False, False
            room = cap - len(kept)
            kept += data[:room]
            if len(data) > room:
                return bytes(kept), True, False


def _exited(pid: int, deadline: float) -> bool:
    """Whether `pid` has exited by `deadline` (0: now), without reaping it."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove(workdir: Path) -> None:
    """Delete the directory whatever the code did to its permissions."""
    shutil.rmtree(workdir, ignore_errors=True)
    if workdir.exists():
        for root, dirs, _ in os.walk(workdir):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o700)
        os.chmod(workdir, 0o700)
        shutil.rmtree(workdir, ignore_errors=True)


def _user_kwargs(how: Plan) -> dict:
    return {} if how.uid is None else {"user": how.uid, "group": how.gid, "extra_groups": []}


@functools.cache
def plan(interpreter: str | None, user: str | None, network_namespace: str) -> Plan:
    """How calls run here: the interpreter (the configured one, else the first of this process's and the
    fallbacks that `user` can start), the user (as root only), and an empty network namespace when one can be
    made. Each choice is tried once, by starting it; SandboxUnavailable says what is missing."""
    uid = gid = None
    if os.geteuid() == 0 and user is not None:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise SandboxUnavailable(f"user {user!r} does not exist (rollout.agent.tools.<name>.user)") from None
        uid, gid = entry.pw_uid, entry.pw_gid
    candidates = [interpreter] if interpreter else list(dict.fromkeys([sys.executable, *FALLBACK_INTERPRETERS]))
    python = next((c for c in candidates if _starts([c, *PYTHON_FLAGS], uid, gid)), None)
    if python is None:
        who = "this user" if uid is None else f"user {user!r}"
        raise SandboxUnavailable(f"no Python that {who} can run among {', '.join(candidates)} (set interpreter)")
    base = (python, *PYTHON_FLAGS)
    if network_namespace != "off" and shutil.which("unshare"):
        # without root (or after switching to `user`) a network namespace needs a user namespace too (-r)
        unshare = ("unshare", "-n", "--") if os.geteuid() == 0 and uid is None else ("unshare", "-r", "-n", "--")
        if _starts([*unshare, *base], uid, gid):
            return Plan(unshare + base, uid, gid, "namespace")
    if network_namespace == "require":
        raise SandboxUnavailable("no network namespace can be made here (unshare -n failed); network_namespace=require")
    return Plan(base, uid, gid, "audit hook")


def _starts(argv: list[str], uid: int | None, gid: int | None) -> bool:
    try:
        done = subprocess.run(
            [*argv, "-c", "pass"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            env=ENV,
            cwd="/",
            **_user_kwargs(Plan((), uid, gid, "")),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0

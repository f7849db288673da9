"""Runs inside the sandboxed interpreter, before the model's code: limits, audit hook, then the code.

`yatt.tools.sandbox` starts ``python -I -S -B -u -c <this file's source> <limits as JSON> <code file>`` in a
fresh working directory. This module imports only the standard library (it runs in an isolated interpreter,
maybe not yatt's). In order, it:
1. reads the code file and deletes it, so the working directory starts empty;
2. lowers the resource limits (RLIMIT_CPU, AS, NPROC, FSIZE, NOFILE, CORE) to the configured values, soft and
   hard, so the code cannot raise them again;
3. replaces the C functions that fork or open files without an audit event (`_posixsubprocess.fork_exec`,
   the dbm modules' `open`) and installs an audit hook (PEP 578) that refuses sockets, process creation, signals
   to other processes, ctypes, rlimit changes, object-graph walking (gc), reads outside the working directory
   and the standard library, and every write outside the working directory (sqlite files included);
4. runs the code as ``__main__``, printing the value of a last bare expression as a notebook cell would.

The audit hook is what turns a refused action into a clear one-line error; it is not a security boundary on
its own (CPython says so: C code and some builtins bypass it). The kernel-enforced layers are set up by the
parent: the rlimits below, an unprivileged user when yatt runs as root, and a network namespace.

Exit status: the code's own (0, or what it passed to sys.exit), 85 after MemoryError (the memory limit), 86
after a refused action, whose message is the last line on stderr, 87 after any other uncaught exception.
"""

from __future__ import annotations

import ast
import builtins
import json
import linecache
import os
import resource
import sys
import traceback

EXIT_MEMORY, EXIT_REFUSED, EXIT_EXCEPTION = 85, 86, 87
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_DEVICES_READ = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen")
# events that change the file system at their first argument (the source of a move or link is checked too)
_MUTATIONS = tuple(
    "os.remove os.rmdir os.mkdir os.chmod os.chown os.truncate os.utime os.chflags os.lchflags os.mkfifo os.mknod "
    "shutil.rmtree os.setxattr os.removexattr".split()
)
_TWO_PATHS = ("os.rename", "os.link")


class SandboxRefused(BaseException):
    """A refused action. A BaseException so that the code's own `except Exception` does not swallow it."""


def main() -> None:
    limits = json.loads(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as f:
        source = f.read()
    os.unlink(sys.argv[2])
    sys.argv = ["<code>"]
    _set_limits(limits)
    workdir = os.path.realpath(os.getcwd())
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    # C functions that fork or open files without an audit event: replaced in the modules the code will import
    if not limits["allow_processes"]:
        _disable("_posixsubprocess", "fork_exec", "starting processes")
    _disable("_gdbm", "open", "the dbm module")
    _disable("_dbm", "open", "the dbm module")
    sys.addaudithook(_hook(workdir, stdlib, bool(limits["allow_processes"])))
    builtins.exit = builtins.quit = sys.exit  # -S leaves these undefined; models call them
    sys.exit(_run(source, limits["memory_mb"]))


def _disable(module: str, attribute: str, what: str) -> None:
    try:
        loaded = __import__(module)
    except ImportError:  # not built into this interpreter
        return

    def refused(*args: object, **kwargs: object) -> None:
        raise SandboxRefused(f"python: {what} is not allowed")

    setattr(loaded, attribute, refused)


def _set_limits(limits: dict) -> None:
    mb = 1 << 20
    for which, value in (
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, limits["file_mb"] * mb),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_CORE, 0),  # a SIGXCPU would otherwise dump a core the size of the process
    ):
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        # CPU: SIGXCPU at the soft limit, SIGKILL one second later if the code ignores it
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))


def _hook(workdir: str, stdlib: str, allow_processes: bool):  # type: ignore[no-untyped-def]
    """The audit hook. Its state is in this closure's immutable locals; the code cannot reach them without the
    gc and frame walking the hook refuses."""
    readable, writable = (workdir, stdlib), (workdir,)
    realpath, fsdecode, sep, own_pid = os.path.realpath, os.fsdecode, os.sep, os.getpid()

    def inside(path: object, roots: tuple[str, ...]) -> bool:
        resolved = realpath(fsdecode(path))
        return any(resolved == root or resolved.startswith(root + sep) for root in roots)

    def refuse(what: str) -> None:
        raise SandboxRefused(f"python: {what} is not allowed")

    def check_path(path: object, roots: tuple[str, ...], verb: str) -> None:
        if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, roots):
            refuse(f"{verb} {fsdecode(path)!r}")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, _, flags = args
            if isinstance(path, int):  # an fd already opened, hence already checked
                return
            if flags & _WRITE_FLAGS:
                if fsdecode(path) != "/dev/null":
                    check_path(path, writable, "writing")
            elif fsdecode(path) not in _DEVICES_READ:
                check_path(path, readable, "reading")
        elif event.startswith("socket."):
            refuse("network access")
        elif event in _PROCESS_EVENTS:
            if not allow_processes:
                refuse("starting processes")
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if args[0] != own_pid or event == "os.killpg":
                refuse("signalling other processes")
        elif event.startswith("ctypes."):
            refuse("ctypes")
        elif event in ("resource.setrlimit", "resource.prlimit"):
            refuse("changing resource limits")
        elif event.startswith("gc.get_") or event == "sys._current_frames":
            refuse(event)
        elif event == "sqlite3.connect":  # sqlite opens its file in C, unaudited
            database = fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
            if database.startswith("file:"):
                refuse("an sqlite URI")
            if database not in ("", ":memory:"):
                check_path(database, writable, "opening")
        elif event in ("os.listdir", "os.scandir"):
            check_path(args[0] if args[0] is not None else ".", readable, "listing")
        elif event in _MUTATIONS:
            check_path(args[0], writable, "changing")
        elif event in _TWO_PATHS:
            check_path(args[0], writable, "changing")
            check_path(args[1], writable, "changing")
        elif event == "os.symlink":  # where a link points is checked when it is opened
            check_path(args[1], writable, "changing")

    return hook


def _run(source: str, memory_mb: int) -> int:
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")  # source lines in tracebacks
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        tree = ast.parse(source, "<code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<code>", "eval"), namespace)
            if value is not None:
                print(repr(value))
        return 0
    except SandboxRefused as err:
        print(err, file=sys.stderr)
        return EXIT_REFUSED
    except MemoryError:
        namespace.clear()  # free what the code holds, so that reporting it does not run out of memory too
        print(f"python: memory limit of {memory_mb} MB exceeded", file=sys.stderr)
        return EXIT_MEMORY
    except SystemExit:
        raise
    except BaseException as err:  # as python prints it, without this module's frames
        tb = None if isinstance(err, SyntaxError) else err.__traceback__.tb_next
        traceback.print_exception(type(err), err, tb)
        return EXIT_EXCEPTION
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    main()

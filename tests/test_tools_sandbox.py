"""The python tool's sandbox against hostile code: a fork bomb, an infinite loop, a sleep, a flood of output, a
memory bomb, reads outside its directory, a socket, writes outside its directory. Each is a clear one-line
error of that call, and the next call works. Each test starts a few short child interpreters."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from yatt.tools.python import PythonConfig, PythonTool
from yatt.tools.sandbox import SandboxRun, plan, run_code

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs POSIX processes")


@pytest.fixture
def tmp_root():
    """A directory the sandbox's user can traverse (pytest's tmp_path is under a 0700 directory of root's)."""
    root = Path(tempfile.mkdtemp(prefix="yatt-sandbox-test-"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root)


@pytest.fixture
def cfg(tmp_root):
    (tmp_root / "work").mkdir(mode=0o711)
    return PythonConfig(workdir_root=str(tmp_root / "work"), timeout_s=10, cpu_s=5)


def run(code: str, cfg: PythonConfig, **limits) -> SandboxRun:
    done = run_code(code, cfg.model_copy(update=limits))
    if done.pid is not None:  # the whole process group is gone after every call (once init has reaped it)
        deadline = time.monotonic() + 5
        while _group_alive(done.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _group_alive(done.pid)
    assert [p for p in os.listdir(cfg.workdir_root) if p.startswith("yatt-python-")] == []  # and its directory
    return done


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (a zombie waiting for init to reap it does not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rpartition(")")[2].split()[:3]
        except OSError:  # it ended while we looked
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def still_works(cfg: PythonConfig) -> None:
    done = run("print(6 * 7)", cfg)
    assert (done.result.output, done.result.error) == ("42", None)


def test_code_runs_and_prints(cfg):
    done = run("import math\nprint('pi', round(math.pi, 2))\nx = 6\nx * 7", cfg)
    assert (done.result.output, done.result.error) == ("pi 3.14\n42", None)
    assert run("None", cfg).result.output == ""


def test_an_exception_is_the_calls_error_with_its_traceback(cfg):
    done = run("def f():\n    return 1 / 0\nf()", cfg)
    assert done.result.error == "python: ZeroDivisionError: division by zero"
    assert 'File "<code>", line 2, in f' in done.result.output and "return 1 / 0" in done.result.output
    assert "sandbox_child" not in done.result.output and "<string>" not in done.result.output
    assert run("sys.exit(3)", cfg).result.error == "python: NameError: name 'sys' is not defined"
    assert run("import sys\nsys.exit(3)", cfg).result.error == "python: exit status 3"
    assert run("def (:", cfg).result.error.startswith("python: SyntaxError")
    still_works(cfg)


def test_a_fork_bomb_is_refused(cfg):
    for code in (
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['ls'])",
        "import importlib\nimportlib.import_module('_posixsubprocess').fork_exec(*range(23))",
        "import os\nos.posix_spawn('/bin/sh', ['sh'], {})",
        "import os\nos.system('ls')",
    ):
        assert run(code, cfg).result.error == "python: starting processes is not allowed"
    still_works(cfg)


def test_a_fork_bomb_with_processes_allowed_is_bounded_by_rlimit_nproc(cfg):
    """The kernel's layer under the audit hook: RLIMIT_NPROC stops the forks (as root, only because the code runs
    as `user`), and the process group is killed with everything in it."""
    count_forks = (
        "import os, time\nn = 0\nwhile n < 200:\n    try:\n        pid = os.fork()\n    except OSError as err:\n"
        "        print('refused after', n, err.errno)\n        break\n    if pid == 0:\n        time.sleep(60)\n"
        "    n += 1"
    )
    done = run(count_forks, cfg, allow_processes=True, processes=8)
    words = done.result.output.split()
    assert words[:2] == ["refused", "after"] and int(words[2]) < 8, done.result
    assert done.result.error is None and done.wall_s < 5  # the sleeping children did not hold the call
    # the classic bomb: every process forks forever; contained by the rlimits and the wall clock
    bomb = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", cfg,
               allow_processes=True, processes=8, cpu_s=1, timeout_s=2)  # fmt: skip
    assert bomb.result.error in ("python: CPU time limit of 1 s exceeded", "python: killed after 2 s wall clock")
    still_works(cfg)


def test_an_infinite_loop_hits_the_cpu_limit(cfg):
    done = run("while True:\n    pass", cfg, cpu_s=1)
    assert done.result.error == "python: CPU time limit of 1 s exceeded" and done.wall_s < 5
    still_works(cfg)


def test_a_sleep_hits_the_wall_clock(cfg):
    done = run("import time\nprint('start')\ntime.sleep(60)", cfg, timeout_s=1)
    assert done.result.error == "python: killed after 1 s wall clock" and done.wall_s < 3
    assert done.result.output == "start\npython: killed after 1 s wall clock"
    still_works(cfg)


def test_huge_output_is_cut_at_the_cap(cfg):
    done = run("while True:\n    print('x' * 1000)", cfg, output_bytes=4096)
    assert done.result.error == "python: output truncated at 4096 bytes"
    assert done.result.output.startswith("x" * 1000) and len(done.result.output) == 4096 + 1 + len(done.result.error)
    still_works(cfg)


def test_a_memory_bomb_hits_the_memory_limit(cfg):
    done = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))", cfg, memory_mb=128)
    assert done.result.error == "python: memory limit of 128 MB exceeded"
    assert run("x = bytearray(1 << 34)", cfg, memory_mb=128).result.error == "python: memory limit of 128 MB exceeded"
    still_works(cfg)


def test_reading_outside_the_directory_is_refused(cfg, tmp_root):
    (tmp_root / "secret.txt").write_text("the secret")  # beside the work directories' parent
    (tmp_root / "work" / "secret.txt").write_text("the secret")  # in the parent of the call's directory
    cases = {
        "print(open('/etc/passwd').read())": "python: reading '/etc/passwd' is not allowed",
        "print(open('../secret.txt').read())": "python: reading '../secret.txt' is not allowed",
        f"print(open({str(tmp_root / 'secret.txt')!r}).read())": f"python: reading {str(tmp_root / 'secret.txt')!r}",
        "import os\nos.chdir('..')\nprint(open('secret.txt').read())": "python: reading 'secret.txt' is not allowed",
        "import os\nprint(os.listdir('..'))": "python: listing '..' is not allowed",
        "import os\nos.symlink('/etc/passwd', 'p')\nprint(open('p').read())": "python: reading 'p' is not allowed",
        "import pathlib\nprint(pathlib.Path('/etc/hostname').read_text())": "python: reading '/etc/hostname'",
    }
    for code, error in cases.items():
        done = run(code, cfg)
        assert done.result.error.startswith(error), (code, done.result)
        assert "the secret" not in done.result.output and "root:" not in done.result.output
    os.remove(tmp_root / "work" / "secret.txt")
    still_works(cfg)


def test_a_socket_is_refused(cfg):
    for code in (
        "import socket\nsocket.create_connection(('127.0.0.1', 9))",
        "import socket\nsocket.socket()",
        "import socket\nsocket.getaddrinfo('localhost', 80)",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')",
    ):
        assert run(code, cfg).result.error == "python: network access is not allowed", code
    still_works(cfg)


def test_writing_outside_the_directory_is_refused(cfg):
    outside = os.path.join(tempfile.gettempdir(), f"yatt-escape-{uuid.uuid4().hex}")
    cases = {
        f"open({outside!r}, 'w').write('x')": f"python: writing {outside!r} is not allowed",
        f"import os\nos.open({outside!r}, os.O_CREAT | os.O_WRONLY)": f"python: writing {outside!r} is not allowed",
        f"import shutil\nshutil.copy('/dev/null', {outside!r})": f"python: writing {outside!r} is not allowed",
        f"import os\nos.mkdir({outside!r})": f"python: changing {outside!r} is not allowed",
        f"open('a', 'w').close()\nimport os\nos.rename('a', {outside!r})": f"python: changing {outside!r} is not "
        "allowed",
        "import os\nos.remove('/etc/hostname')": "python: changing '/etc/hostname' is not allowed",
    }
    for code, error in cases.items():
        assert run(code, cfg).result.error == error, code
        assert not os.path.exists(outside)
    still_works(cfg)


def test_writing_inside_the_directory_works_and_is_removed_after(cfg):
    code = (
        "open('a.txt', 'w').write('hi')\nimport os\nos.mkdir('d')\nprint(open('a.txt').read(), sorted(os.listdir('.')))"
    )
    done = run(code, cfg)  # `run` checks the directory is gone afterwards
    assert (done.result.output, done.result.error) == ("hi ['a.txt', 'd']", None)


def test_other_escapes_are_refused(cfg, monkeypatch):
    monkeypatch.setenv("YATT_RUN_SECRET", "0" * 64)
    assert "YATT_RUN_SECRET" not in run("import os\nprint(dict(os.environ))", cfg).result.output
    assert run("import ctypes", cfg).result.error == "python: ctypes is not allowed"
    assert run("import os\nos.kill(1, 9)", cfg).result.error == "python: signalling other processes is not allowed"
    assert run("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", cfg).result.error == (
        "python: changing resource limits is not allowed"
    )
    assert run("import gc\ngc.get_objects()", cfg).result.error == "python: gc.get_objects is not allowed"
    sqlite = "import sqlite3\nsqlite3.connect({!r}).execute('create table t (x)')"
    outside = os.path.join(tempfile.gettempdir(), "x.db")
    assert run(sqlite.format(outside), cfg).result.error == f"python: opening {outside!r} is not allowed"
    assert run(sqlite.format("file:/etc/x?mode=ro"), cfg).result.error == "python: an sqlite URI is not allowed"
    assert run(sqlite.format(":memory:"), cfg).result.ok and run(sqlite.format("in.db"), cfg).result.ok
    assert run("import dbm\ndbm.open('x', 'c')", cfg).result.error == "python: the dbm module is not allowed"
    still_works(cfg)


def test_the_tool_checks_its_arguments_and_never_raises(cfg, tmp_root):
    tool = PythonTool(cfg)
    assert tool.call({"code": "print('ok')"}).output == "ok"
    assert tool.call({}).error == "python: missing argument 'code' (a string)"
    assert tool.call({"code": "x" * 100}).ok is False  # a NameError
    assert PythonTool(cfg.model_copy(update={"max_code_bytes": 10})).call({"code": "x" * 11}).error == (
        "python: code longer than 10 bytes"
    )
    missing = PythonTool(cfg.model_copy(update={"interpreter": str(tmp_root / "no-python")})).call({"code": "1"})
    assert missing.error.startswith("python: sandbox unavailable: no Python that")


def test_the_plan_is_what_this_machine_allows():
    """Which kernel layers this machine gives (printed with -s): a network namespace where unshare works."""
    how = plan(None, "nobody", "auto")
    print(how.describe())
    unshare = ["unshare", "-n", "true"] if os.geteuid() == 0 and how.uid is None else ["unshare", "-r", "-n", "true"]
    if shutil.which("unshare") and subprocess.run(unshare, capture_output=True).returncode == 0:
        assert how.network == "namespace"
    if os.geteuid() == 0:
        assert how.uid is not None and how.uid != 0  # RLIMIT_NPROC binds only a non-root user


def test_concurrent_calls_do_not_mix(cfg):
    """Many conversations call tools at once (one thread each): every call gets its own output and error."""
    from concurrent.futures import ThreadPoolExecutor

    codes = [f"print({i} * 2)" for i in range(6)] + ["import time\ntime.sleep(30)"]
    with ThreadPoolExecutor(len(codes)) as pool:
        results = list(pool.map(lambda code: run_code(code, cfg.model_copy(update={"timeout_s": 2})).result, codes))
    assert [r.output for r in results[:6]] == [str(2 * i) for i in range(6)]
    assert results[6].error == "python: killed after 2 s wall clock"
    assert os.listdir(cfg.workdir_root) == []

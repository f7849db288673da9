"""The launcher's pieces without processes: one-line messages, each rank's command line under --nproc, and how the
agent picks the one line to print from the ranks' torchelastic error files (tests/test_operator_e2e.py runs it)."""

import signal

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from yatt.launcher import AGENT_ENV, ERROR_FILE_ENV, first_failure, one_line, parse_args, rank_argv, report


def test_a_multi_line_message_becomes_one_line():
    assert (
        one_line("exp.yaml: invalid config\n  a.b: bad\n  c: unknown key\n")
        == "exp.yaml: invalid config: a.b: bad; c: unknown key"
    )
    assert one_line("already one line") == "already one line"


def test_each_rank_gets_the_command_line_without_nproc():
    argv = [
        "--nproc",
        "2",
        "--config",
        "c.yaml",
        "trainer.lr=0.1",
        "--resume",
        "none",
        "--overwrite",
        "--placement",
        "full",
        "run.steps=3",
    ]
    args = parse_args(argv)
    again = parse_args(rank_argv(args))
    assert "--nproc" not in rank_argv(args) and again.nproc is None
    assert vars(again) | {"nproc": 2} == vars(args)


def _failure(tmp_path, monkeypatch, rank: int, line: str | None, code: int, quiet: bool = False) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if line is not None:
        monkeypatch.setenv(ERROR_FILE_ENV, str(path))
        assert report(line, quiet=quiet, code=code) == code
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(path))


def test_the_agent_prints_the_first_report_and_exits_with_its_code(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(AGENT_ENV, "1")
    failures = {
        1: _failure(tmp_path, monkeypatch, 1, "error (rank 1): data.jsonl:4: not valid UTF-8", 2),
        2: _failure(tmp_path, monkeypatch, 2, "error (rank 2): never shown", 2, quiet=True),
        0: _failure(tmp_path, monkeypatch, 0, "error (rank 0): RuntimeError: Connection closed by peer", 1),
        3: _failure(tmp_path, monkeypatch, 3, None, -signal.SIGTERM),
    }  # stopped by the agent: no report
    assert first_failure(failures) == ("error (rank 1): data.jsonl:4: not valid UTF-8", 2)
    assert capsys.readouterr().err == ""  # under the agent a rank prints nothing itself
    assert not (tmp_path / "error2.json").exists()  # a quiet rank writes no report


def test_a_rank_that_died_without_a_report_is_named(tmp_path, monkeypatch):
    failures = {1: _failure(tmp_path, monkeypatch, 1, None, -signal.SIGKILL)}
    line, code = first_failure(failures)
    assert line == "error (rank 1): the process ended with signal SIGKILL and no report (its output is above)"
    assert code == 1


def test_under_plain_torchrun_the_rank_prints_its_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(AGENT_ENV, raising=False)
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    assert report("error (rank 0): bad", quiet=False, code=2) == 2
    assert report("error (rank 1): bad", quiet=True, code=2) == 2
    assert capsys.readouterr().err == "error (rank 0): bad\n"

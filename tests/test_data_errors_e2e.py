"""Bad data through the launcher (torchrun, 2 ranks): one line naming the file and row, a non-zero exit, and no
engine started."""

import pytest
from e2e import experiment, torchrun


@pytest.mark.parametrize("case", ["non_utf8", "empty_train", "empty_eval"])
def test_bad_data_fails_with_one_line_before_engines(tmp_path, case):
    config = experiment(tmp_path, f"run: {{name: bad, output_dir: {tmp_path / 'runs'}, steps: 2}}\n")
    train, evalset = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    if case == "non_utf8":  # line 4 belongs to rank 1: only that rank can see it
        lines = train.read_bytes().splitlines(keepends=True)
        train.write_bytes(b"".join(lines[:3]) + b'{"prompt": "1+\xff="}\n' + b"".join(lines[4:]))
        expected = f"{train}:4: not valid UTF-8 (byte 0xff at column 15)"
    elif case == "empty_train":
        train.write_text("")
        expected = f"data.train: no rows in {train}"
    else:
        evalset.write_text("\n")
        expected = f"data.eval: no rows in {evalset}"
    proc = torchrun(config, cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    # torchrun prints its own traceback when a rank exits non-zero; none may come from a rank
    assert 'launch/train.py", line' not in proc.stderr and "/yatt/" not in proc.stderr, proc.stderr[-3000:]
    assert not list((tmp_path / "runs" / "bad" / "logs").glob("engine-*")), "an engine was started"

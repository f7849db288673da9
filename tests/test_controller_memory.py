"""Parallel controllers hold only their own images: benchmarks/controller_memory.py on a handful of small images,
DP = 2 controller processes (torchrun) and the central driver; benchmarks/results/controller_memory.md has the
full-size measurement (RSS is not asserted here: at this size it is allocator noise)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_controllers_each_open_and_hold_half_of_what_the_central_driver_holds(tmp_path):
    out = tmp_path / "controller_memory"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "controller_memory.py"),
            "--prompts",
            "8",
            "--image-size",
            "56",
            "--group-size",
            "2",
            "--response-tokens",
            "8",
            "--dp",
            "2",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    result = json.loads(out.with_suffix(".json").read_text())
    by = {r["variant"]: r for r in result["runs"]}
    ranks, (driver,) = by["parallel"]["processes"], by["central"]["processes"]
    assert sorted(p["rank"] for p in ranks) == [0, 1]
    # each image file read by exactly one controller, 4 each (the start-up check and the step: 2 reads a file)
    assert by["parallel"]["opened_disjoint_and_complete"]
    assert [(p["opened_files"], p["opens"], p["prompts"], p["rollouts"]) for p in ranks] == [(4, 8, 4, 8)] * 2
    assert (driver["opened_files"], driver["prompts"], driver["rollouts"]) == (8, 8, 16)
    # the pixel tensors: exactly half of the driver's each; the encoded bytes: together the driver's, which are the
    # image files' bytes
    assert [p["held"]["pixels"] * 2 for p in ranks] == [driver["held"]["pixels"]] * 2 and driver["held"]["pixels"] > 0
    assert (
        sum(p["held"]["encoded_images"] for p in ranks)
        == driver["held"]["encoded_images"]
        == result["workload"]["total_file_bytes"]
    )
    # the driver handed each of its 2 workers 4 prompts
    assert [s["prompts"] for s in driver["shares"]] == [4, 4]

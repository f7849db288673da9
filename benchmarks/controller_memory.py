"""Controller memory for image prompts: parallel controller shards vs one central driver, at one global batch.

    OMP_NUM_THREADS=1 python benchmarks/controller_memory.py [--prompts 512] [--image-size 448] [--dp 1 2 4]
        [--group-size 8] [--response-tokens 256] [--repeats 3] [--out benchmarks/results/controller_memory]

Why: DESIGN principle 1 says no process holds the whole batch's data: each torchrun rank's controller shard
reads, encodes and holds only its own rows' images, so its peak data memory falls as 1/DP at a fixed global
batch. A central driver (veRL's single controller) loads every image of the step and hands each rank its
share, so it holds the whole batch whatever DP is. This measures both with real processes.

Workload (benchmarks/image_workload.py, written to a temporary folder): --prompts textured JPEG images of
--image-size squared pixels, one per prompt, and a JSONL of yatt rows that reference them; a VL policy folder from
yatt.models.tiny_vl with image_size = --image-size, patch 14 and pixel shuffle 4 (64 image tokens at 448), so that
its real Idefics3 processor keeps the images at full size (no splitting, no downscaling) and gives per image what
a real policy's would: a float32 pixel_values of 3 x 448 x 448 (2.4 MB) and a pixel_attention_mask of 448 x 448
(bool as yatt.models.vision keeps it, 0.2 MB). Its weights are tiny and random: no model runs here.

Variants, each in fresh processes, one after the other:
- parallel, DP = N: `torchrun --nproc_per_node N` of this file; each rank runs a controller shard's data path
  with yatt's own code: load_rank_data (its JSONL shard by line striding, the start-up image check), its
  PromptStream, one step's batch of prompts/N rows, encode_prompts, load_batch_images with the real processor, and
  the step's rollouts built by group_rollouts (G samples per prompt sharing the prompt's one PromptImages),
  held until the step's end.
- central, DP = N (the single-controller baseline): one driver process runs the same code as a world of one for
  the whole global batch (every row, every image), hands each of N receiver processes its contiguous share (each
  prompt's ids and PromptImages pickled over a pipe, as a central driver's dispatch serialises its batch), and
  holds the batch and every rollout until the step's end, as a driver that gathers the responses and computes the
  advantages does. The receivers count and drop what they get: their memory is not the figure, and holding it
  would only add the batch's size again to this shared box.

Not run: engines, generation and training. The responses are a stand-in: G completions of --response-tokens
token ids per prompt (drawn from the tiny policy's vocabulary, so the ids are small cached ints, as for any
vocabulary below 257 ids; a real vocabulary's ids cost 28 more bytes each) with log-probs, turned into rollouts
by group_rollouts, the code generation uses. Not built: the trainer's TokenBatch, which holds each prompt's
pixels once more (stack_pixels; benchmarks/vl_step.py measures it).

Measured per process, in MiB above its idle size: the process imports everything, joins its process group,
builds the tokenizer and processor and encodes one throwaway image (lazy imports, allocator warm-up); then it reads
its idle size, runs the step's data path and holds the result:
- peak anon (the acceptance figure): the peak of RssAnon, the process's own data pages, sampled every 5 ms from
  /proc (and read once more at the step's end, which is the peak here: everything is still held). It includes the
  transients: decoded images, processor intermediates, pickled shares.
- peak RSS: VmHWM after resetting it (/proc/self/clear_refs) minus the idle VmRSS; also counts file pages
  (library code) the kernel faults in; here it has stayed within 1 MiB of peak anon.
- held (accounted): the sizes of what the step holds at its end: encoded image bytes, pixel tensors, expanded
  prompt ids, and the rollouts' response ids, log-probs and text (sys.getsizeof). tracemalloc is not used: it
  does not see torch's tensor allocator or PIL's buffers, and tracing ~10^6 small objects would inflate the RSS
  being measured.
- after step / after trim: RssAnon once the rollouts are dropped, then after glibc's malloc_trim.
- images opened: the files each process read, counted at yatt.data.images.read_image_bytes (the one reader).

Each variant runs --repeats times in fresh processes and the tables give medians: the peak is held plus glibc heap
fragmentation, which varies from process to process with the same code and data (0 to ~0.6 MB per 448-pixel
image, freed chunks the heap keeps between the held tensors; malloc_trim returns them), so one run is one draw.

Writes <out>.json (everything), <out>.md (the table, the DP=2 ratio, the model) and <out>.png; --report-from
JSON rewrites the tables and plot of an earlier run without measuring.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing; spawned receivers import it too

# benchmarks/ is on the path: this file runs as a script
from harness import pyplot  # noqa: E402
from image_workload import PATCH, SHUFFLE, textured_image, write_policy, write_workload  # noqa: E402
from proc_memory import PeakSampler, reset_peak, trim_heap, vm_kib  # noqa: E402

MIB = 2**20
VARIANTS = ("parallel", "central")
ACCEPT = 0.55  # issue 14: at DP = 2 each controller holds <= 0.55 of what the single controller holds


def experiment(policy: Path, data: Path, prompts: int, group: int, response_tokens: int) -> dict:
    """The config every process reads: one step of `prompts` prompts is the whole data set."""
    return {
        "model": {"path": str(policy)},
        "data": {
            "train": {"kind": "jsonl", "files": [str(data / "train.jsonl")]},
            "prompts_per_step": prompts,
            "max_prompt_tokens": 64,
        },
        "rollout": {"group_size": group, "max_new_tokens": response_tokens},
    }


# ---- what a step holds (both kinds of process run this) ---------------------------------------


class DataPath:
    """The step's data path of one controller: its parts are built before the idle size is read."""

    def __init__(self, config: Path):
        from transformers import AutoTokenizer

        from yatt.config import ExperimentConfig
        from yatt.data import images as image_files
        from yatt.models.vision import ImageInputs

        self.cfg = ExperimentConfig.model_validate(json.loads(config.read_text()))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.cfg.model.path))  # as build_components does
        self.inputs = ImageInputs(self.cfg.model.path)  # as ControllerShard does for a VL policy
        self.opened: list[str] = []
        real = image_files.read_image_bytes

        def counted(ref: str, where: str) -> bytes:  # the one reader of image bytes: count what this process opens
            self.opened.append(Path(ref).name)
            return real(ref, where)

        image_files.read_image_bytes = counted
        self._warm_up()

    def _warm_up(self) -> None:
        """Encode a throwaway image of the workload's size, so lazy imports (PIL's JPEG plugin, the processor's
        code paths) and first-use allocations happen before the idle size is read, not inside the measurement."""
        import io

        import numpy as np

        size = self.inputs.processor.image_processor.size["longest_edge"]
        buffer = io.BytesIO()
        textured_image(np.random.default_rng(1), size).save(buffer, "JPEG", quality=90)
        self.inputs.encode([self.inputs.image_token_id], [buffer.getvalue()])
        self.tokenizer.decode(list(range(8)), skip_special_tokens=True)
        gc.collect()

    def step(self, world, prompts: int) -> list:
        """This world's rank's rows of one step, read, encoded and turned into rollouts, as a step holds them."""
        from yatt.controllers.images import load_batch_images
        from yatt.controllers.rollouts import encode_prompts, group_rollouts
        from yatt.data.prepare import load_rank_data
        from yatt.data.stream import PromptStream
        from yatt.engines.base import Completion

        cfg = self.cfg
        data = load_rank_data(cfg.data, world, self.tokenizer, cfg.reward.verifiers)
        # the shard's stream (its seed does not matter: a step of prompts/DP rows takes every row of the shard)
        rows = PromptStream(data.train, seed=cfg.run.seed, shuffle=cfg.data.shuffle).next_batch(prompts)
        prompt_ids = encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_tokens)
        images = load_batch_images(rows, self.inputs, prompt_ids)
        vocab, length = len(self.tokenizer), cfg.rollout.max_new_tokens
        rollouts = []
        for row, ids, image in zip(rows, prompt_ids, images):
            rng = random.Random(row.index)  # the same stand-in responses for a prompt in every variant
            # generation's stand-in: G full-length responses per prompt (see the module docstring)
            completions = [
                Completion(
                    [rng.randrange(vocab) for _ in range(length)],
                    [-3.0 * rng.random() for _ in range(length)],
                    "length",
                )
                for _ in range(cfg.rollout.group_size)
            ]
            rollouts += group_rollouts(row, ids, image, completions, self.tokenizer)
        return rollouts


def _list_bytes(values: list) -> int:
    """A list and its items; ints in [-5, 256] are CPython's shared small ints and cost nothing more."""
    return sys.getsizeof(values) + sum(sys.getsizeof(v) for v in values if not (isinstance(v, int) and -5 <= v <= 256))


def held_bytes(rollouts: list) -> dict[str, int]:
    """What the step's rollouts hold, by kind; a prompt's G rollouts share one PromptImages, counted once."""
    images = {id(r.vision): r.vision for r in rollouts if r.vision is not None}
    encoded = sum(len(b) for im in images.values() for b in im.images)
    pixels = sum(im.nbytes for im in images.values()) - encoded
    ids = sum(_list_bytes(im.prompt_ids) + _list_bytes(im.engine_ids) for im in images.values())
    samples = sum(
        sys.getsizeof(r) + _list_bytes(r.response_ids) + _list_bytes(r.rollout_logprobs) + sys.getsizeof(r.text)
        for r in rollouts
    )
    return {
        "encoded_images": encoded,
        "pixels": pixels,
        "prompt_ids": ids,
        "rollouts": samples,
        "total": encoded + pixels + ids + samples,
    }


class Measure:
    """Memory above this process's idle size, from the moment it is made (see the module docstring)."""

    def __init__(self):
        gc.collect()
        reset_peak()
        self.idle = {field: vm_kib("self", field) for field in ("VmRSS", "RssAnon", "RssFile")}
        self.anon = PeakSampler("RssAnon")
        self.start = time.perf_counter()

    def _above(self, field: str, kib: int | None = None) -> float:
        return ((vm_kib("self", field) if kib is None else kib) - self.idle[field]) / 1024

    def peak(self) -> dict:
        return {
            "idle_mib": self.idle["VmRSS"] / 1024,
            "data_path_s": time.perf_counter() - self.start,
            "peak_anon_mib": self._above("RssAnon", self.anon.stop()),
            "peak_rss_mib": self._above("VmRSS", vm_kib("self", "VmHWM")),
            "file_rss_change_mib": self._above("RssFile"),
        }

    def after(self) -> dict:
        """Once the step's data is dropped: what the allocator kept, and what it keeps after malloc_trim."""
        gc.collect()
        out = {"after_step_mib": self._above("RssAnon")}
        if trim_heap():
            out["after_trim_mib"] = self._above("RssAnon")
        return out


def finish(path: DataPath, rollouts: list, measure: Measure, **fields) -> dict:
    """The record of one process at the step's end; drops the rollouts (as the step's end does) to see what stays."""
    out = {
        **fields,
        **measure.peak(),
        "held": held_bytes(rollouts),
        "prompts": len({id(r.row) for r in rollouts}),
        "rollouts": len(rollouts),
        "opened_files": len(set(path.opened)),
        "opens": len(path.opened),
        "opened": sorted(set(path.opened)),
    }
    rollouts.clear()
    return {**out, **measure.after()}


# ---- the two kinds of controller ---------------------------------------------------------------


def controller_worker(args: argparse.Namespace) -> None:
    """One rank of the parallel variant (under torchrun): its own shard, its own images, its own rollouts."""
    import torch

    from yatt.distributed import close_world, init_world

    torch.set_num_threads(1)
    world = init_world()
    path = DataPath(Path(args.config))
    world.barrier()  # every rank idle before any starts, so no rank's idle size includes another's traffic
    measure = Measure()
    rollouts = path.step(world, path.cfg.data.prompts_per_step // world.size)
    out = finish(path, rollouts, measure, variant="parallel", dp=world.size, rank=world.rank)
    Path(f"{args.result}.rank{world.rank}.json").write_text(json.dumps(out))
    close_world()


def _receive(conn) -> None:
    """A central driver's data-parallel worker: takes its share prompt by prompt and reports what it got. It
    counts the bytes and drops them: the driver is what is measured, and unpickling would only need torch in
    each receiver, DP more processes' worth of RSS on this shared box."""
    conn.send("ready")
    count, size = 0, 0
    while payload := conn.recv_bytes():
        count, size = count + 1, size + len(payload)
    conn.send((count, size))


def central_worker(args: argparse.Namespace) -> None:
    """The single-controller baseline: one driver loads and encodes every image of the global batch and hands each
    of `--receivers` workers its contiguous share, as a central driver's dispatch does."""
    import torch

    from yatt.distributed import World

    torch.set_num_threads(1)
    context = mp.get_context("spawn")  # fresh workers: a fork would share the driver's pages
    pipes = [context.Pipe() for _ in range(args.receivers)]
    workers = [context.Process(target=_receive, args=(child,), daemon=True) for _, child in pipes]
    for w in workers:
        w.start()
    path = DataPath(Path(args.config))
    for parent, _ in pipes:
        assert parent.recv() == "ready"
    measure = Measure()
    prompts = path.cfg.data.prompts_per_step
    rollouts = path.step(World(0, 1, 0, torch.device("cpu")), prompts)  # a world of one: every row is its own
    group = path.cfg.rollout.group_size
    for rank, (parent, _) in enumerate(pipes):
        for g in range(rank * prompts // args.receivers, (rank + 1) * prompts // args.receivers):
            r = rollouts[g * group]
            parent.send_bytes(pickle.dumps((r.vision.engine_ids, r.vision), protocol=pickle.HIGHEST_PROTOCOL))
        parent.send_bytes(b"")
    received = [parent.recv() for parent, _ in pipes]
    out = finish(
        path,
        rollouts,
        measure,
        variant="central",
        dp=args.receivers,
        rank=0,
        shares=[{"prompts": c, "pickled_bytes": b} for c, b in received],
    )
    for w in workers:
        w.join()
    Path(f"{args.result}.rank0.json").write_text(json.dumps(out))


# ---- the orchestrator --------------------------------------------------------------------------


def run_variant(variant: str, dp: int, config: Path, work: Path) -> list[dict]:
    result = work / f"{variant}_dp{dp}"  # a later repeat overwrites: each result is read at once
    role = ["--role", variant, "--config", str(config), "--result", str(result)]
    if variant == "parallel":  # --standalone: a free rendezvous port (another job may hold torchrun's default)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(dp),
            str(Path(__file__).resolve()),
            *role,
        ]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), *role, "--receivers", str(dp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(f"{result}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"{variant} DP={dp} failed (exit {rc}):\n{Path(f'{result}.log').read_text()[-3000:]}")
    return [json.loads(Path(f"{result}.rank{r}.json").read_text()) for r in range(dp if variant == "parallel" else 1)]


FIGURES = ("peak_anon_mib", "peak_rss_mib", "held_mib", "after_step_mib", "after_trim_mib")


def summarize(variant: str, dp: int, repeat: int, processes: list[dict], prompts: int) -> dict:
    """One run of a variant at one DP; per-controller figures are the largest process's (the ranks are alike)."""
    opened = [set(p.pop("opened")) for p in processes]
    out = {
        "variant": variant,
        "dp": dp,
        "repeat": repeat,
        "processes": processes,
        # each image file opened by exactly one process, and all of them by someone
        "opened_disjoint_and_complete": sum(map(len, opened)) == len(set().union(*opened)) == prompts,
    }
    for p in processes:
        p["held_mib"] = p["held"]["total"] / MIB
    for key in FIGURES:
        out[key] = max(p.get(key, float("nan")) for p in processes)
    return out


def aggregate(runs: list[dict]) -> list[dict]:
    """Per variant and DP, the median over repeats of each figure, and the range of the peaks: the heap's
    fragmentation differs from process to process (see the module docstring), so one run is one draw."""
    out = []
    for key in dict.fromkeys((r["variant"], r["dp"]) for r in runs):
        mine = [r for r in runs if (r["variant"], r["dp"]) == key]
        row = {
            "variant": key[0],
            "dp": key[1],
            "repeats": len(mine),
            "processes": [len(r["processes"]) for r in mine][0],
            "opened_files": [p["opened_files"] for p in mine[0]["processes"]],
            "opened_disjoint_and_complete": all(r["opened_disjoint_and_complete"] for r in mine),
        }
        for figure in FIGURES:
            row[figure] = statistics.median(r[figure] for r in mine)
        row["peak_anon_range_mib"] = [min(r["peak_anon_mib"] for r in mine), max(r["peak_anon_mib"] for r in mine)]
        out.append(row)
    return out


def fit(dps: list[int], values: list[float]) -> tuple[float, float]:
    """Least squares of value = fixed + per_batch / DP."""
    n, xs = len(dps), [1.0 / d for d in dps]
    mx, my = sum(xs) / n, sum(values) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def conclude(summary: list[dict], runs: list[dict]) -> dict:
    """The DP = 2 ratios to the central driver (medians over repeats, and the worst pairing of single runs) and the
    scaling model of the parallel controllers."""
    by, out = {(r["variant"], r["dp"]): r for r in summary}, {}
    if ("parallel", 2) in by and ("central", 2) in by:
        par, cen = by["parallel", 2], by["central", 2]
        for key in ("peak_anon_mib", "peak_rss_mib", "held_mib"):
            out[f"dp2_ratio_{key.removesuffix('_mib')}"] = par[key] / cen[key]
        out["dp2_ratio"] = out["dp2_ratio_peak_anon"]
        out["dp2_ratio_worst"] = par["peak_anon_range_mib"][1] / cen["peak_anon_range_mib"][0]
        out["accepted"] = out["dp2_ratio"] <= ACCEPT
    parallel = [r for r in summary if r["variant"] == "parallel"]
    central = [r["peak_anon_mib"] for r in summary if r["variant"] == "central"]
    if len(parallel) >= 2:
        dps, peaks = [r["dp"] for r in parallel], [r["peak_anon_mib"] for r in parallel]
        fixed, per_batch = fit(dps, peaks)
        batch = parallel[0]["held_mib"] * parallel[0]["dp"]
        # the heap's share of each process's peak beyond what it holds: 0, or a fraction of the held bytes
        extra = [p["peak_anon_mib"] / p["held_mib"] - 1 for r in runs for p in r["processes"]]
        line = (
            f"peak per controller ~ (1 + f) x {batch:.0f} MiB / DP, the global batch's held bytes split DP ways, "
            f"f = {min(extra):.2f} to {max(extra):.2f} by process (heap fragmentation); least squares over the "
            f"medians at DP = {', '.join(map(str, dps))}: {fixed:.0f} MiB + {per_batch:.0f} MiB / DP"
            + (f"; the central driver ~{statistics.median(central):.0f} MiB at every DP" if central else "")
        )
        out["model"] = {
            "dps": dps,
            "fixed_mib": fixed,
            "per_batch_mib": per_batch,
            "line": line,
            "fragmentation": [min(extra), max(extra)],
            "residual_mib": max(abs(fixed + per_batch / d - v) for d, v in zip(dps, peaks)),
        }
    return out


def report(results: dict, out: Path) -> str:
    summary, w = results["summary"], results["workload"]
    central = {r["dp"]: r for r in summary if r["variant"] == "central"}
    lines = [
        f"# Controller memory: {w['prompts']} prompts x one {w['image_px']}x{w['image_px']} JPEG "
        f"(mean {w['mean_file_bytes'] / 1024:.0f} KiB), G = {w['group_size']}, {w['response_tokens']}-token "
        f"responses, {summary[0]['repeats']} run(s) each\n",
        "Per controller (parallel: the largest rank; central: the driver), MiB above the process's idle size, "
        "median over runs: peak anon = peak of RssAnon, sampled every 5 ms (the acceptance figure; its range "
        "over runs in brackets); peak RSS = VmHWM after a reset; held = accounted bytes of images, pixels, ids "
        "and rollouts at the step's end; after step / after trim = RssAnon once the step's data is dropped, "
        "before and after malloc_trim.\n",
        "| variant | DP | peak anon [range] | peak RSS | held | after step | after trim | images opened per "
        "process | peak anon / central |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        ratio = r["peak_anon_mib"] / central[r["dp"]]["peak_anon_mib"] if r["dp"] in central else float("nan")
        low, high = r["peak_anon_range_mib"]
        lines.append(
            f"| {r['variant']} | {r['dp']} | {r['peak_anon_mib']:.0f} [{low:.0f}-{high:.0f}] | "
            f"{r['peak_rss_mib']:.0f} | {r['held_mib']:.0f} | {r['after_step_mib']:.0f} | "
            f"{r['after_trim_mib']:.0f} | {'/'.join(map(str, r['opened_files']))} | {ratio:.3f} |"
        )
    lines.append("")
    if "dp2_ratio" in results:
        lines.append(
            f"DP = 2: each controller's peak is {results['dp2_ratio']:.3f} of the central driver's "
            f"(acceptance <= {ACCEPT}: {'met' if results['accepted'] else 'missed'}); by VmHWM "
            f"{results['dp2_ratio_peak_rss']:.3f}, by held bytes {results['dp2_ratio_held']:.3f}; the worst "
            f"pairing of single runs (the controller's highest peak, the driver's lowest) "
            f"{results['dp2_ratio_worst']:.3f}.\n"
        )
    if "model" in results:
        lines.append(f"Model: {results['model']['line']}.\n")
    text = "\n".join(lines)
    Path(f"{out}.md").write_text(text)
    return text


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, colour in (("parallel", "tab:blue"), ("central", "tab:red")):
        rows = [r for r in results["summary"] if r["variant"] == variant]
        if not rows:
            continue
        dps = [r["dp"] for r in rows]
        label = "parallel: each controller" if variant == "parallel" else "central driver"
        peaks = [r["peak_anon_mib"] for r in rows]
        spread = [
            [p - r["peak_anon_range_mib"][0] for p, r in zip(peaks, rows)],
            [r["peak_anon_range_mib"][1] - p for p, r in zip(peaks, rows)],
        ]
        ax.errorbar(
            dps, peaks, yerr=spread, fmt="o-", color=colour, capsize=4, label=f"{label}, peak anon RSS (median, range)"
        )
        ax.plot(dps, [r["held_mib"] for r in rows], "s--", color=colour, alpha=0.6, label=f"{label}, held (accounted)")
        procs = [
            (r["dp"], p["peak_anon_mib"]) for r in results["runs"] if r["variant"] == variant for p in r["processes"]
        ]  # every rank of every run: they are alike
        ax.scatter([d for d, _ in procs], [v for _, v in procs], color=colour, s=10, alpha=0.4)
    if "model" in results:
        m = results["model"]
        xs = [1 + i * 0.05 for i in range(int((max(m["dps"]) - 1) / 0.05) + 1)]
        ax.plot(
            xs,
            [m["fixed_mib"] + m["per_batch_mib"] / x for x in xs],
            ":",
            color="black",
            label=f"fit {m['fixed_mib']:.0f} + {m['per_batch_mib']:.0f} / DP MiB",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["dp"] for r in results["summary"]}))
    from matplotlib.ticker import ScalarFormatter

    ax.get_xaxis().set_major_formatter(ScalarFormatter())
    ax.set_xlabel("data-parallel ranks (DP), fixed global batch")
    ax.set_ylabel("MiB above the process's idle size")
    w = results["workload"]
    ax.set_title(f"controller data memory: {w['prompts']} prompts x {w['image_px']}px image, G={w['group_size']}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measure(args: argparse.Namespace) -> dict:
    """Every variant at every DP, --repeats times, one process group after the other."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="yatt-controller-memory-") as tmp:
        work = Path(tmp)
        workload = write_workload(work / "data", args.prompts, args.image_size)
        print(
            f"{args.prompts} images of {args.image_size}px, mean {workload['mean_file_bytes'] / 1024:.1f} KiB",
            flush=True,
        )
        config = work / "experiment.json"
        config.write_text(
            json.dumps(
                experiment(
                    write_policy(work / "policy", args.image_size),
                    work / "data",
                    args.prompts,
                    args.group_size,
                    args.response_tokens,
                )
            )
        )
        runs = []
        for repeat in range(args.repeats):
            for dp in args.dp:
                for variant in args.variants:  # one after the other, never at once
                    runs.append(summarize(variant, dp, repeat, run_variant(variant, dp, config, work), args.prompts))
                    r = runs[-1]
                    print(
                        f"run {repeat + 1}/{args.repeats}, {variant} DP={dp}: peak anon {r['peak_anon_mib']:.0f} "
                        f"MiB, peak RSS {r['peak_rss_mib']:.0f} MiB, held {r['held_mib']:.0f} MiB per controller",
                        flush=True,
                    )
    return {
        "workload": {
            **workload,
            "prompts": args.prompts,
            "group_size": args.group_size,
            "response_tokens": args.response_tokens,
        },
        "measure": "peak anon RSS above idle (RssAnon sampled every 5 ms) for the ratio; also VmHWM after "
        "/proc/self/clear_refs minus idle VmRSS, and accounted held bytes",
        "summary": aggregate(runs),
        "runs": runs,
        "wall_s": time.perf_counter() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=512, help="global batch: prompts per step, one image each")
    parser.add_argument(
        "--image-size", type=int, default=448, help=f"image side in pixels (a multiple of {PATCH * SHUFFLE})"
    )
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--response-tokens", type=int, default=256, help="tokens per stand-in response")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes to run")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant (fresh processes each)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/controller_memory")
    parser.add_argument("--report-from", type=Path, help="a results JSON: only rewrite its tables and plot")
    parser.add_argument("--role", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--receivers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "parallel":
        controller_worker(args)
        return 0
    if args.role == "central":
        central_worker(args)
        return 0
    for dp in args.dp:
        if args.prompts % dp:
            raise SystemExit(f"--prompts {args.prompts} is not divisible by DP = {dp}")
    if args.report_from:
        results = json.loads(args.report_from.read_text())
    else:
        results = measure(args)
    results.update(conclude(results["summary"], results["runs"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(report(results, args.out))
    plot(results, Path(f"{args.out}.png"))
    if "dp2_ratio" in results:
        print(f"DP=2 / single controller (peak anon RSS above idle): {results['dp2_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

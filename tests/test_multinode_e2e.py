"""Two nodes on one machine: two network namespaces joined by a veth pair, each with its own address and its own
torchrun agent (`--nnodes 2`, c10d rendezvous on node 0's address), the commands README.md's multi-node section
gives. Each node runs one rank and its engines, bound to every interface and reached from the other node
(partial placement: one rank's engines generate, the other's judge). The run secret is exported on both;
checkpoints go to a directory both see.

- The same run on one node (2 ranks) and across the two logs the same metrics and ends with the same weights.
- Every process of node 1 killed (-9) mid-run: node 0 ends within run.peer_timeout_s and a heartbeat with one
  line naming node 1 and its address, leaves no process behind, and relaunching both nodes with the same
  commands resumes from the last checkpoint to the same metrics and weights as the uninterrupted run.
- An engine reached from the other node with a wrong secret is refused.

Making namespaces needs root (CI runs as root); where `ip netns add` is refused the tests skip and say so.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, env, experiment, genrm_reward
from safetensors.torch import load_file
from test_checkpoint_resume_e2e import comparable

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.engine
STEPS = 3
SUBNET = "10.231.{}.{}"
PEER_TIMEOUT_S = 10  # run.peer_timeout_s of the node-loss case: its bound, kept short for CI


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True)


class Nodes:
    """Two network namespaces joined by a veth pair: node i at `self.addresses[i]`."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.names = [f"yatt{tag}n{i}" for i in (0, 1)]
        self.links = [f"yv{tag}n{i}" for i in (0, 1)]
        self.addresses = [SUBNET.format(tag % 250, i + 1) for i in (0, 1)]

    def create(self) -> str | None:
        """None, or why namespaces cannot be made here."""
        made = sh("ip", "netns", "add", self.names[0])
        if made.returncode:
            return f"`ip netns add` is refused here ({made.stderr.strip() or made.returncode}): it needs root"
        sh("ip", "netns", "add", self.names[1])
        steps = [("ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])]
        for name, link, address in zip(self.names, self.links, self.addresses):
            steps += [
                ("ip", "link", "set", link, "netns", name),
                ("ip", "-n", name, "addr", "add", f"{address}/24", "dev", link),
                ("ip", "-n", name, "link", "set", link, "up"),
                ("ip", "-n", name, "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = sh(*step)
            if done.returncode:
                self.remove()
                return f"`{' '.join(step)}` failed: {done.stderr.strip()}"
        return None

    def remove(self) -> None:
        for name in self.names:
            sh("ip", "netns", "del", name)

    def exec(self, node: int, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[node], *args]

    def pids(self, node: int) -> list[int]:
        """Every process in node `node`'s namespace."""
        return [int(pid) for pid in sh("ip", "netns", "pids", self.names[node]).stdout.split()]


@pytest.fixture(scope="module")
def nodes():
    pair = Nodes()
    if why := pair.create():
        pytest.skip(why)
    yield pair
    pair.remove()


def node_command(config: Path, master: str, local: str, port: int, node_rank: int, *args: str) -> list[str]:
    """docs/multinode.md's command for one node (one rank per node here). `is_host`: node 0's agent hosts the
    rendezvous store, and `--local-addr` is the address its ranks reach the store at: torchrun would take both from
    the machine's hostname, which resolves to no namespace's address."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
        "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{port}",
        "--rdzv-id", f"yatt-test-{port}", "--rdzv-conf", f"is_host={int(node_rank == 0)}", "--local-addr", local,
        str(REPO / "launch/train.py"), "--config", str(config), *args,
    ]  # fmt: skip


def start_two_nodes(
    nodes: Nodes, config: Path, run_args: list[str], secret: str, cwd: Path, launch: int = 0, **extra_env: str
) -> list[subprocess.Popen]:
    """Both nodes' agents, started together (`launch`: a fresh rendezvous port for each launch of a test)."""
    port = 29000 + (os.getpid() + 10 * launch) % 1000
    run_env = {**env(), "YATT_RUN_SECRET": secret, **extra_env}
    return [
        subprocess.Popen(
            nodes.exec(i, node_command(config, nodes.addresses[0], nodes.addresses[i], port, i, *run_args)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**run_env, "GLOO_SOCKET_IFNAME": nodes.links[i]},  # the hostname resolves to no shared interface
            cwd=cwd,
        )
        for i in (0, 1)
    ]


def run_two_nodes(
    nodes: Nodes, config: Path, run_args: list[str], secret: str, cwd: Path, launch: int = 0
) -> list[str]:
    """Both nodes' agents, started together; their outputs once both have exited (asserting they succeeded)."""
    procs = start_two_nodes(nodes, config, run_args, secret, cwd, launch)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def partial_genrm(tmp_path_factory, nodes):
    """A partial-placement run judged by a GenRM engine: on one node (2 ranks), and across the two nodes."""
    tmp = tmp_path_factory.mktemp("multinode")
    judge = genrm_reward(tmp, "{backend: hf, bind: 0.0.0.0}")
    body = f"{ONE_TOKEN_GRPO}{judge}checkpoint: {{every: {STEPS}, keep: 1}}\nrun: {{name: r, steps: {STEPS}}}\n"
    config = experiment(tmp, body, name="multinode.yaml")
    common = ["--placement", "partial", "rollout.engine.backend=hf", "rollout.engine.vllm=null"]
    one = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(REPO / "launch/train.py"),
         "--config", str(config), *common, f"run.output_dir={tmp / 'one'}"],
        capture_output=True, text=True, env=env(), cwd=tmp, timeout=600,
    )  # fmt: skip
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    shared = tmp / "shared"  # both nodes see it: the run directory and its checkpoints
    outs = run_two_nodes(nodes, config, common + across_nodes(shared), secrets.token_hex(32), tmp)
    return tmp / "one" / "r", shared / "r", outs, config, common


def across_nodes(shared: Path) -> list[str]:
    """docs/multinode.md's settings: engines reached from the other node, the run on storage both see."""
    return ["rollout.engine.bind=0.0.0.0", f"run.output_dir={shared}", f"checkpoint.dir={shared / 'ckpt'}"]


def assert_same_run(one: Path, other: Path) -> None:
    """The same metrics at every step (timings aside) and bit-equal final weights."""
    assert [r["step"] for r in records(other)] == list(range(STEPS + 1))
    for want, have in zip(comparable(one), comparable(other)):
        assert want == have, {
            k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)
        }
    a, b = (load_file(str(d / "policy" / "model.safetensors")) for d in (one, other))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_across_two_nodes_equals_the_run_on_one(partial_genrm):
    one, across, outs, _, _ = partial_genrm
    assert_same_run(one, across)
    # the judge engine of one node judged the other node's rollouts: partial placement, one rank per role
    steps = records(across)[1:]
    assert all(r["placement/rollout_devices"] == 1 and r["placement/genrm_devices"] == 1 for r in steps)
    assert all(r["genrm/judged"] > 0 for r in steps)
    assert (across.parent / "ckpt" / f"step-{STEPS:08d}" / "manifest.json").is_file()


def test_a_lost_node_ends_the_other_with_one_line_and_both_resume_exactly(partial_genrm, nodes):
    """Rank 1 (node 1) stops at the start of step 2, once step 1's checkpoint is being written
    (tests/faults/sitecustomize.py), so the kill lands mid-run at a known point: node 0 goes on into step 2 and
    waits on node 1. Then every process of node 1 gets SIGKILL, and node 0 must end by itself."""
    one, _, _, config, common = partial_genrm
    tmp = one.parent.parent
    shared, held, secret = tmp / "lost", tmp / "held", secrets.token_hex(32)
    args = [*common, *across_nodes(shared), "checkpoint.every=1", f"run.peer_timeout_s={PEER_TIMEOUT_S}"]
    faults = os.pathsep.join([str(REPO / "tests" / "faults"), env()["PYTHONPATH"]])
    procs = start_two_nodes(nodes, config, args, secret, tmp, launch=1, PYTHONPATH=faults, YATT_TEST_HOLD=f"1@2:{held}")
    try:
        step1 = shared / "ckpt" / f"step-{1:08d}" / "manifest.json"
        deadline = time.monotonic() + 300
        while not (held.is_file() and step1.is_file()) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
            time.sleep(0.2)
        assert held.is_file() and step1.is_file(), "rank 1 never reached step 2 with step 1's checkpoint written"
        for pid in nodes.pids(1):  # its agent, its rank, its engines: the node is gone
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out = procs[0].communicate(timeout=PEER_TIMEOUT_S + 120)[0]
        took = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[0].returncode != 0, out[-3000:]
    # the bound: the peer timeout and a heartbeat (a sixth of it), plus torchrun's agent ending on a loaded box
    assert took < PEER_TIMEOUT_S * 7 / 6 + 30, (took, out[-3000:])
    lines = [line for line in out.splitlines() if line.startswith("error (rank 0)")]
    assert len(lines) == 1 and lines[0].startswith(f"error (rank 0): lost node 1 ({nodes.addresses[1]}"), out[-3000:]
    assert f"run.peer_timeout_s={PEER_TIMEOUT_S}" in lines[0]
    assert f'File "{REPO / "yatt"}' not in out  # no traceback of yatt's: the line is its report (torchrun's follows)
    deadline = time.monotonic() + 30
    while nodes.pids(0) and time.monotonic() < deadline:  # its engines see their parent gone and exit
        time.sleep(0.2)
    assert nodes.pids(0) == []

    # relaunched, both nodes, the same commands (resume auto): from step 1's checkpoint to the same end
    outs = run_two_nodes(nodes, config, args, secret, tmp, launch=2)
    assert f"resuming from {shared / 'ckpt' / f'step-{1:08d}'}" in outs[0], outs[0][-3000:]
    assert_same_run(one, shared / "r")


def test_an_engine_reached_from_the_other_node_with_a_wrong_secret_is_refused(nodes, tmp_path):
    """yatt's RPC service (what an engine serves) in node 0, bound to every interface, and clients in node 1: the
    one holding the run's secret is answered across the veth; one with another secret is refused (CurveZMQ does
    not complete its handshake, so its call times out)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    secret, endpoint = secrets.token_hex(32), tmp_path / "endpoint"
    run_env = {**env(), "YATT_TEST_ADDR": nodes.addresses[0]}
    server = subprocess.Popen(
        nodes.exec(0, [sys.executable, str(script), "serve", secret, str(endpoint)]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not endpoint.is_file() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert endpoint.is_file(), "the service did not start"
        assert nodes.addresses[0] in endpoint.read_text()

        def call(key: str) -> str:
            args = [sys.executable, str(script), "call", key, str(endpoint)]
            done = subprocess.run(nodes.exec(1, args), capture_output=True, text=True, env=run_env, timeout=120)
            return done.stdout + done.stderr

        assert "answered pong" in call(secret)
        assert "refused: TimeoutError" in call(secrets.token_hex(32))
    finally:
        server.kill()
        server.communicate()


PROBE = """
import json, sys
from yatt.transport.rpc import RpcClient, RpcServer
mode, secret, endpoint = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]

class Service:
    RPC_METHODS = ("ping",)

    def ping(self):
        return "pong"

if mode == "serve":
    import os
    server = RpcServer(Service(), secret, host="0.0.0.0", advertise=os.environ["YATT_TEST_ADDR"])
    open(endpoint, "w").write(server.endpoint)
    server.serve_forever()
else:
    client = RpcClient(open(endpoint).read(), secret, timeout_s=3)
    try:
        print("answered", client.call("ping"))
    except Exception as err:
        print("refused:", type(err).__name__, err)
"""

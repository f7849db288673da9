"""Two nodes on one machine: two network namespaces joined by a veth pair, each with its own address and its own
torchrun agent (`--nnodes 2`, c10d rendezvous on node 0's address), the commands README.md's multi-node section
gives. Each node runs one rank and its engines, bound to every interface and reached from the other node
(partial placement: one rank's engines generate, the other's judge). The run secret is exported on both;
checkpoints go to a directory both see.

- The same run on one node (2 ranks) and across the two logs the same metrics and ends with the same weights.
- An engine reached from the other node with a wrong secret is refused.

Making namespaces needs root (CI runs as root); where `ip netns add` is refused the tests skip and say so.
"""

from __future__ import annotations

import json
import os
import secrets
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


def run_two_nodes(nodes: Nodes, config: Path, run_args: list[str], secret: str, cwd: Path) -> list[str]:
    """Both nodes' agents, started together; their outputs once both have exited (asserting they succeeded)."""
    port = 29000 + os.getpid() % 1000
    run_env = {**env(), "YATT_RUN_SECRET": secret}
    procs = [
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
    across = ["rollout.engine.bind=0.0.0.0", f"run.output_dir={shared}", f"checkpoint.dir={shared / 'ckpt'}"]
    outs = run_two_nodes(nodes, config, common + across, secrets.token_hex(32), tmp)
    return tmp / "one" / "r", shared / "r", outs


def test_a_run_across_two_nodes_equals_the_run_on_one(partial_genrm):
    one, across, outs = partial_genrm
    assert [r["step"] for r in records(across)] == list(range(STEPS + 1))
    for want, have in zip(comparable(one), comparable(across)):
        assert want == have, {
            k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)
        }
    a, b = (load_file(str(d / "policy" / "model.safetensors")) for d in (one, across))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the judge engine of one node judged the other node's rollouts: partial placement, one rank per role
    steps = records(across)[1:]
    assert all(r["placement/rollout_devices"] == 1 and r["placement/genrm_devices"] == 1 for r in steps)
    assert all(r["genrm/judged"] > 0 for r in steps)
    assert (across.parent / "ckpt" / f"step-{STEPS:08d}" / "manifest.json").is_file()


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

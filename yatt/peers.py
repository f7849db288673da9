"""Noticing a lost node: the ranks of a multi-node run beat a heartbeat in torchrun's key-value store and watch
the other nodes'; a rank whose peer node stopped beating ends with one line naming that node, in bounded time.

Why a heartbeat. A rank learns of a dead peer only when it next waits on it, and how depends on where it waits:
- in a gloo collective, a peer killed on a host that stays up closes its sockets and the collective fails at
  once, naming only an ip:port; a peer behind a cut network or on a powered-off host leaves it waiting for the
  process group's timeout (30 minutes);
- on an engine of that node (partial placement: the other node's judges), it waits for
  `rollout.engine.request_timeout_s` (10 minutes), then reports an engine that did not answer.
The heartbeat bounds every case: a node whose heartbeat has not moved for `run.peer_timeout_s` is lost, whatever
this rank is doing. A loss is reported at most `peer_timeout_s + peer_timeout_s / 6` after the node died.

How. At start every rank tells the others who it is (rank; node: torchrun's GROUP_RANK; hostname; its address
on the route to MASTER_ADDR). A thread adds 1 to this rank's counter every `peer_timeout_s / 6` and reads the
counter of the first rank of every other node, through a store connection of its own (the default group's
client serialises every op, so a long blocking `get` of the main thread would stall the heartbeat). Time is
this rank's own clock: the nodes' clocks need not agree. A rank that leaves on its own (done, or reporting its
own failure) marks itself stopped, so its silence is no loss. The store lives in the rendezvous host's torchrun
agent: when the store itself stops answering for the timeout, that node is the one lost.

On a loss the watch reports one line (the launcher's `report`: stderr and torchelastic's error file) and ends
the process at once (`os._exit`): the main thread may be blocked in C (a collective, a socket poll) where no
exception reaches it. The engines this rank spawned exit when they see their parent gone (removing its shared
memory), and checkpoints are crash-consistent, so relaunching every node resumes from the last complete one. A
main thread that fails first (a collective that saw the closed socket) asks for the verdict (`wait_verdict`)
before it reports, so that the line names the node, not a socket.

Only runs over several nodes are watched (torchrun's GROUP_WORLD_SIZE > 1): within a node, torchrun's agent sees
a dead rank itself and stops the others.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from yatt.distributed import World, store_client

BEATS_PER_TIMEOUT = 6  # a late beat or two (a loaded box, a long GIL hold) is not yet a loss


@dataclass(frozen=True)
class Peer:
    rank: int
    node: int
    host: str
    address: str

    def describe(self) -> str:
        host = "" if self.host == self.address else f", host {self.host}"
        return f"node {self.node} ({self.address}{host})"


def route_address(master: str) -> str:
    """This host's source address on the route to `master` (UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    except OSError:
        return master


def this_peer(rank: int) -> Peer:
    return Peer(
        rank,
        int(os.environ.get("GROUP_RANK", "0")),
        socket.gethostname(),
        route_address(os.environ.get("MASTER_ADDR", "127.0.0.1")),
    )


class PeerWatch:
    """The heartbeat thread of one rank (see the module docstring). `store`: a store client for this thread only;
    `on_lost(line)`: reports the loss; the watch then ends the process (`exit`, os._exit by default)."""

    def __init__(
        self,
        store,
        me: Peer,
        peers: list[Peer],
        timeout_s: float,
        on_lost: Callable[[str], None],
        store_host: str = "",
        prefix: str = "yatt/peers",
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.store, self.me, self.timeout_s, self.on_lost, self.exit = store, me, timeout_s, on_lost, exit
        self.interval_s = timeout_s / BEATS_PER_TIMEOUT
        firsts: dict[int, Peer] = {}
        for p in sorted(peers, key=lambda p: p.rank):
            firsts.setdefault(p.node, p)
        self.watched = [p for node, p in sorted(firsts.items()) if node != me.node]
        self.store_node = next((p for p in firsts.values() if store_host in (p.address, p.host)), None)
        self.store_host, self.prefix = store_host, prefix
        now = time.monotonic()
        self.counts = {p.rank: -1 for p in self.watched}
        self.moved = {p.rank: now for p in self.watched}  # when each watched counter last moved
        self.store_ok = now
        self.looked = -float("inf")  # when the last tick began (its reads of the counters came after)
        self.stopped: set[int] = set()  # watched ranks that left on their own
        self.lost: str | None = None
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}/{what}/{rank}"

    def start(self) -> PeerWatch:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            lost = self.tick(time.monotonic())
            if lost and not self._stop.is_set():
                self.lost = lost  # from here on the main thread's own failure is not reported (wait_verdict)
                try:
                    self.on_lost(lost)
                finally:
                    self.exit(1)
                return
            self._stop.wait(self.interval_s)

    def tick(self, now: float) -> str | None:
        """One beat and one look at the watched nodes; the line naming a lost node, if one is."""
        try:
            self.store.add(self._key("beat", self.me.rank), 1)
            for p in self.watched:
                count = self.store.add(self._key("beat", p.rank), 0)
                if count != self.counts[p.rank]:
                    self.counts[p.rank], self.moved[p.rank] = count, now
                elif now - self.moved[p.rank] > self.timeout_s and p.rank not in self.stopped:
                    if self.store.check([self._key("stopped", p.rank)]):
                        self.stopped.add(p.rank)
                    else:
                        silent = now - self.moved[p.rank]
                        return (
                            f"lost {p.describe()}: its rank {p.rank} sent no heartbeat for {silent:.0f} s "
                            f"(run.peer_timeout_s={self.timeout_s:g}); relaunch every node with the same command "
                            "to resume from the last checkpoint"
                        )
            self.store_ok = now
        except Exception as err:  # the store (in the rendezvous host's agent) did not answer
            if now - self.store_ok > self.timeout_s:
                who = self.store_node.describe() if self.store_node else f"the node at {self.store_host}"
                return (
                    f"lost {who}: the rendezvous store it hosts did not answer for {now - self.store_ok:.0f} s "
                    f"(run.peer_timeout_s={self.timeout_s:g}; {type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                    "relaunch every node with the same command to resume from the last checkpoint"
                )
        finally:
            with self.changed:
                self.looked = now
                self.changed.notify_all()
        return None

    def wait_verdict(self, since: float) -> None:
        """Wait until every watched node is known alive after `since` (stopped on its own, or a beat sent after
        it), or, when one is lost, for the watch to report it and end the process (this call then never returns).

        A beat sent after `since` is a count that grew after a look made after `since`: the first such look may
        still find a beat sent just before the peer died (a count that moved since the look before)."""
        deadline = since + self.timeout_s + 3 * self.interval_s  # a loss is reported within timeout + one beat
        first: dict[int, int] | None = None  # the counts of the first look after `since`
        with self.changed:
            while self.thread.is_alive() and (self.lost or time.monotonic() < deadline):
                if not self.lost and first is None and self.looked > since:
                    first = dict(self.counts)
                if first is not None and not self.lost:
                    if all(self.counts[p.rank] > first[p.rank] or p.rank in self.stopped for p in self.watched):
                        return
                self.changed.wait(self.interval_s)

    def stop(self) -> None:
        """This rank leaves on its own: its silence from now on is no loss."""
        self._stop.set()
        try:
            self.store.set(self._key("stopped", self.me.rank), "1")
        except Exception:
            pass  # the store is gone: the peers learn it from the store


def watch_peers(world: World, timeout_s: float, on_lost: Callable[[str], None]) -> PeerWatch | None:
    """Start this rank's watch when the run spans several nodes (None otherwise). Collective: every rank calls it
    right after joining the process group."""
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) < 2 or world.size < 2:
        return None
    me = this_peer(world.rank)
    peers = [Peer(*p) for p in world.all_gather_object((me.rank, me.node, me.host, me.address))]
    store = store_client(max(1.0, timeout_s / BEATS_PER_TIMEOUT))
    prefix = f"yatt/peers/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return PeerWatch(store, me, peers, timeout_s, on_lost, store_host=os.environ["MASTER_ADDR"], prefix=prefix).start()

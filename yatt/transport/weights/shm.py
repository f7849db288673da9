"""``shm``: each bucket goes through a POSIX shared-memory segment; only its descriptor goes through the socket.

Sending (`ShmWeights.pack`): the bucket's tensors are cast straight into an owner-only file under /dev/shm
(one copy, from the trainer's tensors, on any device), at 64-byte aligned offsets, and the RPC carries
``{"name", "size", "tensors": [[name, dtype, shape, offset], ...]}``. Receiving (`ShmWeights.unpack`): the
engine checks the descriptor whole (name pattern, dtypes, shapes, every tensor inside the segment) before it
maps the file, then yields views of the mapping that the engine copies its parameters from: the tensor bytes
never pass through a socket.

Lifetime: one segment per engine client, kept between syncs and reused by every bucket of every sync while it
is large enough (a larger bucket replaces it with a larger one), removed when the client closes (and at exit).
Why kept: a fresh segment costs the kernel zeroing all its pages at each sync, and the engine a page fault per
4 KiB page of a new mapping (measured on SmolLM2-sized buckets: most of a sync's time, benchmarks/results/
weight_sync.md); kept, both sides find their mappings populated and a bucket costs two memory copies. The price
is one bucket (``weight_bucket_mb``, at most) of /dev/shm held per engine client between syncs. The engine keeps
its mapping of the last few segments too (`Mappings`), dropping one as soon as an update finds its file removed
or replaced, so a closed client's memory is freed at the engine's next update or exit.

Why a file under /dev/shm rather than `multiprocessing.shared_memory`: its pages are reserved with
``posix_fallocate``, so a full /dev/shm (Docker's default is 64 MB) is an OSError at creation (``auto`` then
falls back to zmq) instead of a SIGBUS at the first write; it is created owner-only (0600) and never followed
through a symlink; and nothing registers it with multiprocessing's resource tracker, which would unlink it
behind our back or warn of "leaks" at exit.

No leak after a crash: segment names carry this host's tag and the creating pid
(``yatt-w-<host>-<pid>-<client>-<generation>``). A client unlinks its segment at `close` (and at exit); an engine
whose parent died unlinks that parent's segments (`yatt.engines.server.watch_parent`); and every new sender
first sweeps this user's segments on this host whose creating process is gone (`sweep`).

Trust: the descriptor is authenticated like every RPC message; the bytes are not, but only the run's user can
read or write an 0600 file, and that user can already do anything to the run.
"""

from __future__ import annotations

import atexit
import logging
import math
import mmap
import os
import re
import socket
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from yatt.tensors import NamedTensors
from yatt.transport.codec import MAX_DIM, MAX_NDIM, WIRE_DTYPE_NAMES, WIRE_DTYPES
from yatt.transport.weights.base import Cast

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "yatt-w-"
NAME = re.compile(r"^yatt-w-([0-9a-f]{8})-(\d{1,10})-([0-9a-f]{12})-(\d{1,10})$")
ALIGN = 64  # every tensor starts on a cache line (and on its element size, which views need)
MAX_TENSORS = 1 << 16
KEPT_MAPPINGS = 4  # segments an engine keeps mapped: one per client that syncs it, in practice one or two


def host_tag() -> str:
    """Short tag of this host, so that a sweep never judges another host's pids (/dev/shm shared by containers)."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def segments(pid: int | None = None) -> list[str]:
    """Names of this user's segments on this host (of `pid` only, if given)."""
    out = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return out
    host, uid = host_tag(), os.getuid()
    for entry in entries:
        m = NAME.match(entry.name)
        if not m or m.group(1) != host or (pid is not None and int(m.group(2)) != pid):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid == uid:
                out.append(entry.name)
        except OSError:
            continue
    return out


def sweep(dead_pid: int | None = None) -> list[str]:
    """Unlink this user's segments on this host left by processes that are gone (or by `dead_pid`, known dead).
    Returns the names removed."""
    removed = []
    for name in segments(dead_pid):
        if dead_pid is None and pid_alive(int(NAME.match(name).group(2))):
            continue
        try:
            os.unlink(SHM_DIR / name)
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segments of dead processes: %s", len(removed), removed[:4])
    return removed


class Segment:
    """An owner-only file in /dev/shm of `size` bytes, its pages reserved up front, mapped read-write."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, rather than SIGBUS at the first write
            # mapped in one call rather than one page fault per 4 KiB page at the first write (measured: ~20% of
            # a fresh 256 MB segment's cost, the rest being the kernel zeroing its pages)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.bytes: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)

    def release(self) -> None:
        self.bytes = None
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: unmapped when it is collected
            pass


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(bucket: NamedTensors, cast: Cast) -> tuple[list[tuple[str, torch.Tensor, torch.dtype, int]], int]:
    """Each tensor's (name, tensor, dtype it travels in, offset), and the bytes the bucket needs."""
    layout, size = [], 0
    for name, t in bucket:
        dtype = cast(t)
        if dtype not in WIRE_DTYPE_NAMES:
            raise TypeError(f"{name}: unsupported tensor dtype {dtype}")
        layout.append((name, t, dtype, size))
        size = _aligned(size + t.numel() * dtype.itemsize)
    return layout, size


class ShmWeights:
    """The sending side (one per engine client) and, as `unpack`, the receiving side of the ``shm`` transport."""

    name = "shm"

    def __init__(self) -> None:
        sweep()  # segments a killed trainer of this user left on this host
        self.tag = uuid.uuid4().hex[:12]
        self.generation = 0
        self.segment: Segment | None = None
        atexit.register(self.close)

    def begin(self, buckets: list[NamedTensors]) -> None:
        """Make the segment as large as the sync's largest bucket now, so that a later, larger bucket does not
        replace it mid-sync (a fresh segment is the cost this transport avoids)."""
        self._room(max((_layout(b, lambda t: t.dtype)[1] for b in buckets), default=0))

    def pack(self, bucket: NamedTensors, cast: Cast) -> dict[str, Any]:
        layout, size = _layout(bucket, cast)
        self._room(size)
        buf = self.segment.bytes
        for _, t, dtype, offset in layout:
            if t.numel():  # cast and copy in one pass, from whatever device the trainer holds it on
                buf[offset : offset + t.numel() * dtype.itemsize].view(dtype).view(t.shape).copy_(t.detach())
        tensors = [[name, WIRE_DTYPE_NAMES[dtype], list(t.shape), offset] for name, t, dtype, offset in layout]
        return {"transport": self.name, "descriptor": {"name": self.segment.name, "size": size, "tensors": tensors}}

    def _room(self, size: int) -> None:
        if self.segment is None or self.segment.size < size:
            self._release()
            self.generation += 1
            name = f"{PREFIX}{host_tag()}-{os.getpid()}-{self.tag}-{self.generation}"
            self.segment = Segment(name, max(size, ALIGN))

    def finish(self) -> None:
        """The sync is over; the segment stays for the next one (see the module docstring)."""

    def close(self) -> None:
        self._release()
        atexit.unregister(self.close)

    def _release(self) -> None:
        if self.segment is not None:
            self.segment.release()
            self.segment = None

    @staticmethod
    @contextmanager
    def unpack(payload: dict[str, Any]) -> Iterator[NamedTensors]:
        name, size, entries = check_descriptor(payload)
        with MAPPINGS.mapped(name, size) as whole:
            pairs: NamedTensors = [
                (n, whole[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
                for n, dtype, shape, offset in entries
            ]
            try:
                yield pairs
            finally:
                pairs.clear()  # the caller's name for the list goes on existing; the views must not


class Mapped:
    """The engine's mapping of one segment, identified by its file (device, inode) so that a removed or replaced
    file is never read through an old mapping."""

    def __init__(self, fd: int) -> None:
        st = os.fstat(fd)
        self.file, self.length = (st.st_dev, st.st_ino), st.st_size
        # shared, not a private copy: a private page the engine wrote to (copy-on-write) would no longer show the
        # sender's next bucket. What the engine might write is harmless: the sender rewrites every byte it
        # describes at every bucket.
        self.mm = mmap.mmap(fd, self.length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)

    def current(self, name: str) -> bool:
        """Whether `name` is still the file this maps."""
        try:
            st = os.stat(SHM_DIR / name, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.file and st.st_size == self.length

    def close(self) -> None:
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # a failed update's traceback may still hold a view; it is unmapped with it
            log.warning("a view of a weight segment outlived its update; it is unmapped when collected")


class Mappings:
    """The segments an engine has mapped, kept between updates (a kept mapping needs no page faults): at most
    `KEPT_MAPPINGS`, and each dropped as soon as an update finds its file removed or replaced."""

    def __init__(self) -> None:
        self.kept: OrderedDict[str, Mapped] = OrderedDict()
        self.lock = threading.Lock()

    @contextmanager
    def mapped(self, name: str, size: int) -> Iterator[torch.Tensor]:
        with self.lock:  # one update at a time may read a mapping; none is replaced under it
            for other in [n for n, m in self.kept.items() if not m.current(n)]:
                self.kept.pop(other).close()
            m = self.kept.pop(name, None)
            if m is None:
                fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
                try:
                    m = Mapped(fd)
                finally:
                    os.close(fd)
            if m.length < max(size, 1):
                m.close()
                raise ValueError(f"shared-memory segment {name} has {m.length} bytes, the update describes {size}")
            self.kept[name] = m  # the most recently used last
            while len(self.kept) > KEPT_MAPPINGS:
                self.kept.popitem(last=False)[1].close()
            yield m.bytes

    def close(self) -> None:
        with self.lock:
            while self.kept:
                self.kept.popitem()[1].close()


MAPPINGS = Mappings()  # the receiving side's, one per engine process


def check_descriptor(payload: dict[str, Any]) -> tuple[str, int, list[tuple[str, torch.dtype, list[int], int]]]:
    """The descriptor's parts, checked whole before anything is mapped: a bad one is a ValueError naming why."""
    desc = payload.get("descriptor")
    if set(payload) != {"descriptor"} or not isinstance(desc, dict) or set(desc) != {"name", "size", "tensors"}:
        raise ValueError("an shm weight update carries descriptor: {name, size, tensors}")
    name, size, tensors = desc["name"], desc["size"], desc["tensors"]
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"bad shared-memory segment name {str(name)[:80]!r}")
    if type(size) is not int or size < 0:
        raise ValueError(f"bad segment size {size!r}")
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise ValueError(f"tensors must be a list of at most {MAX_TENSORS} entries")
    out = []
    for entry in tensors:
        if not isinstance(entry, list) or len(entry) != 4:
            raise ValueError("each tensor is [name, dtype, shape, offset]")
        tname, dtype_name, shape, offset = entry
        if not isinstance(tname, str) or dtype_name not in WIRE_DTYPES:
            raise ValueError(f"bad tensor name or dtype: {str(entry)[:120]}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
        ):
            raise ValueError(f"{tname}: bad shape {str(shape)[:120]}")
        dtype = WIRE_DTYPES[dtype_name]
        end = offset + math.prod(shape) * dtype.itemsize if type(offset) is int else -1
        if type(offset) is not int or offset < 0 or offset % dtype.itemsize or end > size:
            raise ValueError(
                f"{tname}: offset {offset!r} with shape {shape} of {dtype_name} is not inside {size} bytes"
            )
        out.append((tname, dtype, shape, offset))
    return name, size, out

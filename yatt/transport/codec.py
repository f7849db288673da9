"""Authenticated message codec for ZMQ multipart frames, without pickle.

Why not pickle: unpickling executes code chosen by the sender, so any process that can reach
the socket could run code in the trainer or in an engine. Here a message is plain msgpack data
plus raw tensor bytes, and nothing is parsed before its HMAC has been checked.

Wire format: ``[mac, header, *buffers]``. ``header`` is msgpack of the message in which every
``torch.Tensor`` is replaced by ``{"__tensor__": i, "dtype": "float32", "shape": [..]}`` and its
bytes travel as ``buffers[i]`` (zero-copy on send). ``mac`` is HMAC-SHA256 over the frame count
and every frame (header and buffers), each prefixed by its 8-byte length, so bytes cannot be
shifted between frames without detection.

Cheap rejection: `decode` refuses a message with too many frames or too many bytes before computing the MAC
(the MAC's cost is then bounded too), and parses nothing before the MAC matches. An authentic message is
still checked as untrusted data: nesting depth, tensor rank, dimension sizes and dtype are bounded before
anything is allocated, and every failure is a `MalformedMessage`, never another exception.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

TENSOR_KEY = "__tensor__"
MAC_SIZE = hashlib.sha256().digest_size
MAX_DEPTH = 32  # nesting of lists/maps in a header: far above any real message, far below the recursion limit
MAX_NDIM = 16
MAX_DIM = 2**48

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
# the dtypes a message may carry, by name, for other carriers of tensors (yatt.transport.weights.shm's descriptors)
WIRE_DTYPES, WIRE_DTYPE_NAMES = dict(_DTYPES), dict(_DTYPE_NAMES)

Buffer = bytes | bytearray | memoryview


class TransportError(Exception):
    """Base class for every codec/RPC failure caused by what came over the wire."""


class AuthenticationError(TransportError):
    """The message's MAC is missing or wrong: it was not sent by a holder of the secret."""


class MalformedMessage(TransportError):
    """The message is authentic but cannot be decoded (bad msgpack, placeholders or sizes)."""


def new_secret() -> bytes:
    """A fresh 32-byte shared secret for one trainer/engine pair."""
    return secrets.token_bytes(32)


def _mac(secret: bytes, frames: Sequence[Buffer]) -> bytes:
    h = hmac.new(secret, struct.pack("<Q", len(frames)), hashlib.sha256)
    for frame in frames:
        h.update(struct.pack("<Q", memoryview(frame).nbytes))
        h.update(frame)
    return h.digest()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor, as a zero-copy view where possible (bf16 goes through uint8)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def encode(msg: dict[str, Any], secret: bytes) -> list[Buffer]:
    """Encode `msg` into authenticated frames ``[mac, header, *tensor_buffers]``."""
    buffers: list[Buffer] = []

    def strip(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.dtype not in _DTYPE_NAMES:
                raise TypeError(f"unsupported tensor dtype {obj.dtype}")
            buffers.append(_tensor_bytes(obj))
            return {TENSOR_KEY: len(buffers) - 1, "dtype": _DTYPE_NAMES[obj.dtype], "shape": list(obj.shape)}
        if isinstance(obj, dict):
            if TENSOR_KEY in obj:
                raise ValueError(f"dict key {TENSOR_KEY!r} is reserved by the codec")
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [strip(v) for v in obj]
        return obj

    if not isinstance(msg, dict):
        raise TypeError("a message must be a dict")
    header = msgpack.packb(strip(msg), use_bin_type=True)
    payload: list[Buffer] = [header, *buffers]
    return [_mac(secret, payload), *payload]


def _restore(obj: Any, buffers: Sequence[memoryview], used: set[int], depth: int = 0) -> Any:
    if isinstance(obj, (dict, list)) and depth >= MAX_DEPTH:
        raise MalformedMessage(f"header nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if TENSOR_KEY in obj:
            return _tensor_from(obj, buffers, used)
        return {k: _restore(v, buffers, used, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v, buffers, used, depth + 1) for v in obj]
    return obj


def _tensor_from(ph: dict[str, Any], buffers: Sequence[memoryview], used: set[int]) -> torch.Tensor:
    idx, dtype_name, shape = ph.get(TENSOR_KEY), ph.get("dtype"), ph.get("shape")
    if set(ph) != {TENSOR_KEY, "dtype", "shape"}:
        raise MalformedMessage(f"tensor placeholder has unexpected keys {sorted(map(str, ph))}")
    if type(idx) is not int or not 0 <= idx < len(buffers) or idx in used:
        raise MalformedMessage(f"bad or reused tensor buffer index {idx!r}")
    if dtype_name not in _DTYPES:
        raise MalformedMessage(f"unknown tensor dtype {dtype_name!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise MalformedMessage(f"bad tensor shape {str(shape)[:200]}")
    dtype = _DTYPES[dtype_name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = buffers[idx]
    if buf.nbytes != math.prod(shape) * itemsize:
        raise MalformedMessage(f"tensor {idx}: {buf.nbytes} bytes for shape {shape} of {dtype_name}")
    used.add(idx)
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray copies the frame: the tensor owns writable memory independent of ZMQ's buffer.
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype).reshape(shape)


class MessageTooLarge(TransportError):
    """More frames or bytes than the receiver accepts; refused before the MAC is computed."""


def check_size(frames: Sequence[Buffer], max_frames: int | None, max_bytes: int | None) -> None:
    if max_frames is not None and len(frames) > max_frames:
        raise MessageTooLarge(f"{len(frames)} frames (at most {max_frames})")
    if max_bytes is not None:
        total = sum(memoryview(f).nbytes for f in frames)
        if total > max_bytes:
            raise MessageTooLarge(f"{total} bytes (at most {max_bytes})")


def decode(
    frames: Sequence[Buffer], secret: bytes, max_frames: int | None = None, max_bytes: int | None = None
) -> dict[str, Any]:
    """Verify and decode frames made by `encode`; raises MessageTooLarge/AuthenticationError/MalformedMessage."""
    check_size(frames, max_frames, max_bytes)
    views = [memoryview(f).cast("B") for f in frames]
    if len(views) < 2 or views[0].nbytes != MAC_SIZE:
        raise AuthenticationError("missing MAC or header frame")
    if not hmac.compare_digest(_mac(secret, views[1:]), views[0].tobytes()):
        raise AuthenticationError("MAC mismatch")
    try:
        raw = msgpack.unpackb(views[1], raw=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise MalformedMessage(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict):
        raise MalformedMessage("header is not a map")
    used: set[int] = set()
    try:
        msg = _restore(raw, views[2:], used)
    except MalformedMessage:
        raise
    except Exception as e:  # e.g. a shape torch refuses: still the sender's fault, never the receiver's crash
        raise MalformedMessage(f"cannot rebuild the message: {type(e).__name__}: {e}") from None
    if len(used) != len(views) - 2:
        raise MalformedMessage(f"{len(views) - 2 - len(used)} tensor buffers are not referenced")
    return msg
